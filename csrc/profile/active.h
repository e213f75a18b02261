// The one selector that PyTorch's convolutions consult while a record is enabled. Kernels run on
// any thread (autograd runs CUDA backward on its own device threads, which do not inherit our
// thread_locals), so it is a process-wide pointer, not thread state; a kernel copies the
// shared_ptr, so disable() never frees a selector that a running convolution still uses.
#pragma once

#include <memory>

#include "profile/selector.h"

namespace terra::profile {

std::shared_ptr<Selector> active_selector();
// Returns the previous one (so that the caller can flush it).
std::shared_ptr<Selector> set_active_selector(std::shared_ptr<Selector> selector);

}  // namespace terra::profile
