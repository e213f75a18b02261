#include "runtime/feed_snapshot.h"

#include <ATen/MapAllocator.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty_strided.h>

#include "capture/terra_key.h"

namespace terra::runtime {

bool python_writable_memory(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || !t.has_storage()) return false;
  const c10::Storage& storage = t.unsafeGetTensorImpl()->unsafe_storage();
  // Tensors torch allocates keep their allocator (resizable storages); at::from_blob, which
  // from_numpy, frombuffer and DLPack imports use, leaves it null. So does shared memory
  // received from another process (a file-descriptor MapAllocator), which is not Python's to
  // overwrite.
  if (storage.allocator() != nullptr) return false;
  return at::MapAllocator::fromDataPtr(storage.data_ptr()) == nullptr;
}

at::Tensor FeedValues::value(const at::Tensor& t, bool graph_writes) {
  if (!python_writable_memory(t)) return t;
  c10::StorageImpl* storage = t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  if (graph_writes) {
    written_.insert_or_assign(storage, t.unsafeGetTensorImpl()->unsafe_storage().getWeakStorageImpl());
    return t;
  }
  if (const auto w = written_.find(storage); w != written_.end()) {
    if (!w->second.expired()) return t;
    written_.erase(w);  // (another storage at the address of one that is gone)
  }
  // Several elements over one address (np.broadcast_to) cannot be written as a copy with the
  // same strides: fed as it is (not covered, as before).
  if (at::has_internal_overlap(t) != at::MemOverlap::No) return t;
  capture::SuspendGuard no_interception;              // not an op of the user's program
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor copy = at::empty_strided(t.sizes(), t.strides(), t.options());
  // The same conjugate and negative bits before copy_, which then copies the stored values as
  // they are (with different bits it would resolve them).
  copy._set_conj(t.is_conj());
  copy._set_neg(t.is_neg());
  copy.copy_(t);
  return copy;
}

}  // namespace terra::runtime
