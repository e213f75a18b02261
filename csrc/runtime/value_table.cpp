// ValueTable: one mutex, one condition variable (Python waits for the graph to publish).
//
// Locking: the graph thread only ever tries mu_ (publish, sweep) or takes it where it would wait
// for Python anyway (flush_pending(true), take): a graph thread asleep on mu_ turns every Python
// unlock into a futex wake-up. The Python thread takes it once per kStagedClaims claims and per
// read.
//
// Tensors are never destroyed under mu_: a tensor whose Python object C++ kept alive takes the
// GIL when it dies, and the Python side may hold the GIL while it waits for mu_.
#include "runtime/value_table.h"

#include "common/env.h"
#include "common/spin.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

#include <c10/core/Contiguity.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/util/accumulate.h>
#include <c10/core/TensorImpl.h>
#include <string>

namespace terra::runtime {

void ValueTable::mismatch(int64_t index, int64_t expected_tag, int64_t published_tag) {
  throw std::runtime_error("terra_torch internal error: output " + std::to_string(index) +
                           " of the program is node " + std::to_string(expected_tag >> 8) + " output " +
                           std::to_string(expected_tag & 255) + " for Python but node " +
                           std::to_string(published_tag >> 8) + " output " + std::to_string(published_tag & 255) +
                           " for the graph");
}

void ValueTable::publish(int64_t tag, at::Tensor value) {
  pending_.emplace_back(tag, std::move(value));  // (an undefined value is published too)
  flush_pending(/*wait=*/pending_.size() >= kMaxPending);
}

void ValueTable::flush_pending(bool wait) {
  if (pending_.empty()) return;
  std::unique_lock lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) {
    if (!wait) return;
    lock.lock();
  }
  publish_pending(lock);
}

void ValueTable::publish_pending(std::unique_lock<std::mutex>& lock) {
  // On every path, a mismatch's too: the count for spinners is stored, the lock goes, and only
  // then do the published-over and dropped values die (never under mu_). Each pending value is
  // published once.
  struct Release {
    ValueTable& table;
    std::unique_lock<std::mutex>& lock;
    ~Release() {
      table.published_seen_.store(table.published_, std::memory_order_release);
      if (lock.owns_lock()) lock.unlock();
      table.pending_.clear();
      table.dropped_.clear();
    }
  };
  bool wake = false;
  {
    const Release release{*this, lock};
    for (auto& [tag, value] : pending_) {
      const int64_t index = published_++;
      Entry& e = *entries_.try_emplace(index).first;
      e.published = true;
      if (e.expected) {
        if (e.tag != tag) mismatch(index, e.tag, tag);
        if (dead(e)) {
          dropped_.push_back(std::move(value));
          entries_.erase(index);
        } else {
          e.value = std::move(value);
        }
      } else {
        e.tag = tag;  // Python has not got here yet: keep it for the placeholder to come
        e.value = std::move(value);
      }
    }
    // Only the publish that reaches the count Python waits for wakes it: a wake per value made
    // the waiting thread and the worker trade the mutex (and two context switches) per op.
    wake = waiting_for_ > 0 && published_ >= waiting_for_;
  }
  if (wake) cv_.notify_all();
}

int64_t ValueTable::expect(int64_t tag, const at::Tensor& holder) {
  const int64_t index = expected_++;
  Claim& c = claims_.emplace_back();
  c.index = index;
  c.holder = holder.defined();
  c.entry.tag = tag;
  if (holder.defined() && holder.has_storage()) {
    Entry& e = c.entry;
    e.holder.emplace(holder.getIntrusivePtr());
    const c10::Storage& storage = holder.unsafeGetTensorImpl()->unsafe_storage();
    if (storage.data() == nullptr) e.storage.emplace(storage.getWeakStorageImpl());
    e.options = holder.options();
    e.sizes.assign(holder.sizes().begin(), holder.sizes().end());
    e.strides.assign(holder.strides().begin(), holder.strides().end());
    e.storage_offset = holder.storage_offset();
  }
  apply_if_full();
  return index;
}

size_t ValueTable::claim_batch() {
  // TERRA_STAGED_CLAIMS=0 applies every claim at once, under the lock (to compare).
  static const size_t batch = common::switched_off("TERRA_STAGED_CLAIMS") ? size_t{1} : kStagedClaims;
  return batch;
}

void ValueTable::apply_if_full() {
  if (claims_.size() < claim_batch()) return;
  const PythonLock lock(*this);
}

void ValueTable::apply_claims(std::vector<at::Tensor>& dropped) {
  if (claims_.empty()) return;
  struct Done {  // also when a claim raises a mismatch: no claim is applied twice
    std::vector<Claim>& claims;
    ~Done() { claims.clear(); }
  } done{claims_};
  for (Claim& c : claims_) claim(c, dropped);
}

void ValueTable::claim(Claim& c, std::vector<at::Tensor>& dropped) {
  const int64_t index = c.index;
  if (c.retire) return retire_now(index, dropped);
  Entry& e = *entries_.try_emplace(index).first;
  if (e.published && e.tag != c.entry.tag) mismatch(index, c.entry.tag, e.tag);
  e.tag = c.entry.tag;
  e.expected = true;
  if (c.entry.holder) {
    e.holder = std::move(c.entry.holder);
    e.storage = std::move(c.entry.storage);
    e.options = c.entry.options;
    e.sizes = std::move(c.entry.sizes);
    e.strides = std::move(c.entry.strides);
    e.storage_offset = c.entry.storage_offset;
  }
  if (e.published && !c.holder) {
    dropped.push_back(std::move(e.value));
    entries_.erase(index);
  } else if (c.holder) {
    held_.push_back(index);
  }
}

void ValueTable::pin(int64_t index) {
  const PythonLock lock(*this);
  ++entries_.try_emplace(index).first->pins;
}

std::optional<at::Tensor> ValueTable::take(int64_t index) {
  at::Tensor dropped;
  std::lock_guard lock(mu_);
  Entry* e = entries_.find(index);
  if (e == nullptr || !e->published) return std::nullopt;
  at::Tensor v = e->value;
  if (e->pins > 0) --e->pins;
  if (e->pins == 0 && e->retired) {
    dropped = std::move(e->value);
    entries_.erase(index);
  }
  return v;
}

void ValueTable::retire(int64_t index) {
  Claim& c = claims_.emplace_back();  // staged like a claim, in order with them
  c.index = index;
  c.retire = true;
  apply_if_full();
}

void ValueTable::retire_now(int64_t index, std::vector<at::Tensor>& dropped) {
  Entry* e = entries_.find(index);
  if (e == nullptr) return;
  if (e->pins > 0) {
    e->retired = true;  // the deferred feed takes it, then it goes
    return;
  }
  if (e->published) {
    dropped.push_back(std::move(e->value));
    entries_.erase(index);
  } else {
    e->holder.reset();  // the graph's value is dropped when it arrives
    e->storage.reset();
  }
}

std::optional<at::Tensor> ValueTable::value(int64_t index) {
  const PythonLock lock(*this);
  const Entry* e = entries_.find(index);
  if (e == nullptr || !e->published) return std::nullopt;
  return e->value;
}

template <typename Matches>
std::optional<int64_t> ValueTable::newest_over(const c10::StorageImpl* storage, Matches&& matches) {
  const PythonLock lock(*this);
  std::optional<int64_t> found;
  entries_.for_each([&](int64_t index, const Entry& e) {
    if (!e.storage || e.storage->_unsafe_get_target() != storage || e.storage->expired() || e.retired) return;
    if (matches(e) && (!found || index > *found)) found = index;
  });
  return found;
}

std::optional<int64_t> ValueTable::index_over_storage(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return std::nullopt;
  const c10::TensorImpl& want = *t.unsafeGetTensorImpl();
  return newest_over(want.unsafe_storage().unsafeGetStorageImpl(), [&](const Entry& e) {
    return e.options.dtype() == want.dtype() && e.storage_offset == want.storage_offset() &&
           c10::IntArrayRef(e.sizes) == want.sizes() && c10::IntArrayRef(e.strides) == want.strides();
  });
}

std::optional<int64_t> ValueTable::index_covering(const c10::StorageImpl* storage, caffe2::TypeMeta dtype,
                                                   size_t nbytes) {
  return newest_over(storage, [&](const Entry& e) {
    if (e.options.dtype() != dtype || e.storage_offset != 0) return false;
    const int64_t numel = c10::multiply_integers(e.sizes);
    return c10::_compute_contiguous<int64_t>(e.sizes, e.strides, numel) &&
           static_cast<size_t>(numel) * dtype.itemsize() == nbytes;
  });
}

int64_t ValueTable::published() const {
  std::lock_guard lock(mu_);
  return published_;
}

bool ValueTable::spin_published(int64_t count, std::chrono::nanoseconds budget) const {
  return common::spin_until([&] { return published_seen_.load(std::memory_order_acquire) >= count; }, budget);
}

std::optional<int64_t> ValueTable::tag_at(int64_t index) {
  const PythonLock lock(*this);
  const Entry* e = entries_.find(index);
  if (e == nullptr || !e->expected) return std::nullopt;
  return e->tag;
}

int64_t ValueTable::expected() const { return expected_; }

bool ValueTable::wait_published(int64_t count, std::chrono::nanoseconds slice) {
  PythonLock python(*this);
  std::unique_lock<std::mutex>& lock = python.lock;
  if (published_ >= count) return true;
  waiting_for_ = count;
  const bool reached = cv_.wait_for(lock, slice, [&] { return published_ >= count; });
  waiting_for_ = 0;
  return reached;
}

std::vector<std::pair<at::Tensor, at::Tensor>> ValueTable::live_values() {
  // The entries are copied under the lock and their weak pointers locked after it: locking a
  // TensorImpl's weak pointer may take the GIL (its Python object), and a Python thread holding
  // the GIL may be waiting for this lock (materialize -> published()).
  std::vector<std::pair<int64_t, Entry>> candidates;
  {
    const PythonLock lock(*this);
    entries_.for_each([&](int64_t index, const Entry& e) {
      if (e.published && e.holder && e.value.defined()) candidates.emplace_back(index, e);
    });
  }
  std::vector<std::pair<int64_t, std::pair<at::Tensor, at::Tensor>>> found;
  for (auto& [index, e] : candidates) {
    if (auto impl = e.holder->lock()) {
      found.push_back({index, {at::Tensor(std::move(impl)), e.value}});
      continue;
    }
    if (!e.storage) continue;
    auto storage = e.storage->lock();
    if (!storage) continue;
    // Only a storage is left: a plain tensor of the same layout over it receives the value.
    at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(std::move(storage)), c10::DispatchKeySet(c10::computeDispatchKey(std::nullopt, std::nullopt, e.options.device())),
        e.options.dtype());
    view.unsafeGetTensorImpl()->set_sizes_and_strides(e.sizes, e.strides, e.storage_offset);
    found.push_back({index, {std::move(view), e.value}});
  }
  candidates.clear();  // (their values die here, without the lock)
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  out.reserve(found.size());
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

void ValueTable::sweep() {
  // (The values die after the lock is released, as at publish: destroyed after `lock`.)
  std::vector<at::Tensor> dropped;
  std::unique_lock lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;  // Python holds it: the next iteration's sweep (see Locking)
  // Keeps the indices of `list` whose entries may still be needed (in place), drops the rest.
  auto walk = [&](std::vector<int64_t>& list, std::vector<int64_t>* survivors) {
    size_t kept = 0;
    for (const int64_t index : list) {
      Entry* e = entries_.find(index);
      if (e == nullptr) continue;  // retired, taken or dropped at publish
      if (e->expected && e->published && dead(*e)) {
        dropped.push_back(std::move(e->value));
        entries_.erase(index);
        continue;
      }
      if (survivors != nullptr) survivors->push_back(index);
      else list[kept++] = index;
    }
    if (survivors != nullptr) list.clear();
    else list.resize(kept);
  };
  walk(held_, &old_held_);
  if (old_held_.size() >= 2 * old_checked_ + 64) {
    walk(old_held_, nullptr);
    old_checked_ = old_held_.size();
  }
}

void ValueTable::clear() {
  common::FlatMap<int64_t, Entry> dropped;  // dies after the lock is released
  std::lock_guard lock(mu_);
  std::swap(dropped, entries_);
  claims_.clear();
  pending_.clear();  // (the graph is stopped: its thread touches them no more)
  held_.clear();
  old_held_.clear();
  old_checked_ = 0;
  published_ = 0;
  published_seen_.store(0, std::memory_order_release);
  expected_ = 0;
  waiting_for_ = 0;
}

size_t ValueTable::size() {
  const PythonLock lock(*this);
  return entries_.size();
}

}  // namespace terra::runtime
