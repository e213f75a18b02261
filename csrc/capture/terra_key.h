// The dispatch key terra_torch claims, and the guards that switch interception on and off.
//
// Why PrivateUse3 (a backend key): interception must sit below autograd (so that backward ops are
// ops of their own, as a TorchDispatchMode sees them) and must also catch factories. A backend
// bit in the TLS include set survives BackendSelect, whose kernels recompute the key set through
// computeDispatchKeySet(), which re-applies TLS includes; a functionality key would be dropped
// there. PrivateUse1 is what out-of-tree devices use; PrivateUse3 is, in practice, free.
//
// Why not an ExcludeDispatchKeyGuard to step out: TLS exclusion subtracts functionality bits only
// (DispatchKeySet::operator-), so excluding a backend key would exclude Dense for everyone. We
// save and restore the whole LocalDispatchKeySet instead.
#pragma once

#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstdint>

namespace terra::capture {

constexpr c10::DispatchKey kTerraKey = c10::DispatchKey::PrivateUse3;
constexpr c10::BackendComponent kTerraBackendBit = c10::BackendComponent::PrivateUse3Bit;

// The bits our TLS include adds: the Dense functionality and the PrivateUse3 backend.
inline c10::DispatchKeySet terra_keyset() { return c10::DispatchKeySet(kTerraKey); }

// Turns interception on for this thread (and, via at::ThreadLocalState, for the autograd
// engine's threads during backward()).
//
// A region lives from one iteration's start to the next one's, across the user's own changes of
// the thread's key sets: `with torch.autocast(...)` or `torch.inference_mode()` entered inside
// the iteration and left after it. So the guard gives back only our bits, as they were before
// it, and keeps everything else as it is now; restoring the whole saved set turned autocast back
// on for the rest of the program once the region that had opened inside it closed.
class InterceptGuard {
 public:
  InterceptGuard() : ours_before_(c10::impl::tls_local_dispatch_key_set().included_.raw_repr() & terra_keyset().raw_repr()) {
    auto local = c10::impl::tls_local_dispatch_key_set();
    local.included_ = local.included_ | terra_keyset();
    c10::impl::_force_tls_local_dispatch_key_set(local);
  }
  ~InterceptGuard() {
    auto local = c10::impl::tls_local_dispatch_key_set();
    local.included_ =
        c10::DispatchKeySet(c10::DispatchKeySet::RAW, (local.included_.raw_repr() & ~terra_keyset().raw_repr()) | ours_before_);
    c10::impl::_force_tls_local_dispatch_key_set(local);
  }
  InterceptGuard(const InterceptGuard&) = delete;
  InterceptGuard& operator=(const InterceptGuard&) = delete;

 private:
  uint64_t ours_before_;  // our bits in the include set before the guard
};

// Turns interception off while a real kernel runs, so ops nested inside kernels are not seen
// (exactly as a TorchDispatchMode is popped while its handler runs).
class SuspendGuard {
 public:
  SuspendGuard() : saved_(c10::impl::tls_local_dispatch_key_set()) {
    auto local = saved_;
    local.included_ = c10::DispatchKeySet(c10::DispatchKeySet::RAW,
                                          local.included_.raw_repr() & ~terra_keyset().raw_repr());
    c10::impl::_force_tls_local_dispatch_key_set(local);
  }
  ~SuspendGuard() { c10::impl::_force_tls_local_dispatch_key_set(saved_); }
  SuspendGuard(const SuspendGuard&) = delete;
  SuspendGuard& operator=(const SuspendGuard&) = delete;

 private:
  c10::impl::LocalDispatchKeySet saved_;
};

}  // namespace terra::capture
