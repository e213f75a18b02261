// The one selector that PyTorch's convolutions consult while a record is enabled. Kernels run on
// any thread (autograd runs CUDA backward on its own device threads, which do not inherit our
// thread_locals), so it is a process-wide pointer, not thread state; a kernel holds a shared_ptr,
// so disable() never frees a selector that a running convolution still uses.
#pragma once

#include <memory>

#include "profile/selector.h"

namespace terra::profile {

std::shared_ptr<Selector> active_selector();
// Returns the previous one (so that the caller can flush it).
std::shared_ptr<Selector> set_active_selector(std::shared_ptr<Selector> selector);

// The per-call form: the calling thread keeps a copy of the active selector and re-reads the
// process-wide slot (under its mutex) only when set_active_selector has changed it since, which
// an atomic generation says. So a steady-state call takes no lock and touches no reference
// count. The pointer is valid until this thread's next call of this function. nullptr: none.
Selector* active_selector_for_this_thread();

}  // namespace terra::profile
