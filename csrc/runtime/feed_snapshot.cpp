#include "runtime/feed_snapshot.h"

#include <ATen/MapAllocator.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty_strided.h>

#include "capture/placeholder.h"
#include "capture/terra_key.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace terra::runtime {

namespace {

// Storages handed to Python as arrays (note_exported_memory), by address, each with the tensors
// whose lives bound the arrays': an array made by `t.numpy()` holds the tensor torch made it from
// as its base, so while that tensor lives the array may, and once it is gone the memory is torch's
// alone again (`plt.imshow(conv.weight.detach().numpy())` once does not make every later update
// of the weight wait for the graph). Most programs export none, and the lookup is skipped while
// the table has never held one.
class ExportedStorages {
 public:
  using Holder = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

  void add(const at::Tensor& holder) {
    const c10::StorageImpl* storage = holder.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
    std::lock_guard<std::mutex> lock(mu_);
    // (Dead entries dropped when the table has doubled: a loop that exports a fresh tensor per
    // step, for a metric, leaves one per step.)
    if (table_.size() >= 2 * pruned_ + 64) {
      for (auto it = table_.begin(); it != table_.end();) it = live(it->first, it->second) ? std::next(it) : table_.erase(it);
      pruned_ = table_.size();
    }
    std::vector<Holder>& holders = table_[storage];
    holders.erase(std::remove_if(holders.begin(), holders.end(), [](const Holder& h) { return h.expired(); }),
                  holders.end());
    holders.emplace_back(holder.getIntrusivePtr());
    any_.store(true, std::memory_order_release);
  }
  bool contains(const c10::StorageImpl* storage) const {
    if (!any_.load(std::memory_order_acquire)) return false;
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = table_.find(storage);
    return it != table_.end() && live(storage, it->second);
  }

 private:
  // Some holder lives and still holds that storage (not another one at a freed address).
  static bool live(const c10::StorageImpl* storage, const std::vector<Holder>& holders) {
    for (const Holder& h : holders) {
      const auto impl = h.lock();
      if (impl && impl->has_storage() && impl->unsafe_storage().unsafeGetStorageImpl() == storage) return true;
    }
    return false;
  }

  std::atomic<bool> any_{false};
  mutable std::mutex mu_;
  std::unordered_map<const c10::StorageImpl*, std::vector<Holder>> table_;  // guarded by mu_
  size_t pruned_ = 0;  // guarded by mu_
};

ExportedStorages& exported() {
  static ExportedStorages* table = new ExportedStorages();  // (never destroyed: used until exit)
  return *table;
}

}  // namespace

bool python_writable_memory(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || !t.has_storage()) return false;
  const c10::Storage& storage = t.unsafeGetTensorImpl()->unsafe_storage();
  // Tensors torch allocates keep their allocator (resizable storages); at::from_blob, which
  // from_numpy, frombuffer and DLPack imports use, leaves it null. So does shared memory
  // received from another process (a file-descriptor MapAllocator), which is not Python's to
  // overwrite.
  if (storage.allocator() != nullptr) return exported().contains(storage.unsafeGetStorageImpl());
  // A placeholder's storage has no allocator either: dataless, or holding the graph's value, the
  // runtime's memory. Only a view over memory Python handed in (over_memory) is Python's. (Taken
  // for Python's, every in-place op on a placeholder made Python wait for the graph: a
  // co-executed Adam MLP step took 0.61 ms instead of 0.46.)
  if (const auto* placeholder = dynamic_cast<const capture::PlaceholderImpl*>(t.unsafeGetTensorImpl()))
    if (!placeholder->over_memory()) return false;
  return at::MapAllocator::fromDataPtr(storage.data_ptr()) == nullptr;
}

void note_exported_memory(const at::Tensor& holder) {
  if (!holder.defined() || !holder.device().is_cpu() || !holder.has_storage()) return;
  const c10::Storage& storage = holder.unsafeGetTensorImpl()->unsafe_storage();
  if (storage.allocator() == nullptr) return;  // (python_writable_memory already says so)
  exported().add(holder);
}

void WrittenMemory::note(const c10::Storage& storage) {
  // (Ranges of storages that died go first: their addresses may hold other memory now.)
  ranges_.erase(std::remove_if(ranges_.begin(), ranges_.end(), [](const Range& r) { return r.storage.expired(); }),
                ranges_.end());
  for (const Range& r : ranges_)
    if (r.storage._unsafe_get_target() == storage.unsafeGetStorageImpl()) return;
  const char* begin = static_cast<const char*>(storage.data());
  ranges_.push_back({storage.getWeakStorageImpl(), begin, begin + storage.nbytes()});
}

bool WrittenMemory::overlaps(const c10::Storage& storage) const {
  const char* begin = static_cast<const char*>(storage.data());
  const char* end = begin + storage.nbytes();
  for (const Range& r : ranges_)
    if (!r.storage.expired() && begin < r.end && r.begin < end) return true;
  return false;
}

at::Tensor FeedValues::value(const at::Tensor& t, bool graph_writes) {
  if (!python_writable_memory(t)) return t;
  const c10::Storage& storage = t.unsafeGetTensorImpl()->unsafe_storage();
  if (graph_writes) {
    written_.note(storage);
    return t;
  }
  if (written_.overlaps(storage)) return t;  // the graph writes this memory, maybe through another storage
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
