// The values behind placeholders during co-execution (docs/RUNTIME.md, "Placeholders and the
// output sequence").
//
// Both runners walk the same program, so both see the same sequence of op outputs: the graph
// publishes output i of the sequence (terra::publish) when it has computed it, the Python side
// hands out a placeholder for output i when it validates the op. Index i is the meeting point.
// An entry keeps the graph's value only while Python still holds the placeholder (or has not
// reached it yet), so dead temporaries cost a hash lookup and nothing else, and every live
// placeholder can be materialized from a value the graph already computed: for a read, for a
// fall back to eager at a divergence, or for a feed into the next iteration.
//
// Each entry also carries the tag (node, output) both sides expect, so a disagreement about the
// sequence is an error at the first differing value rather than a wrong number later.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include "common/flat_map.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace terra::runtime {

class ValueTable {
 public:
  // ---- graph side ----
  // Output number published() of the sequence. Throws std::runtime_error on a tag mismatch.
  // Never waits for the Python thread: when Python holds the lock, the value waits in the graph
  // thread's own list (at most kMaxPending of them) and goes in, in order, with the next
  // publish or flush_pending(). A publish that blocked on Python's lock cost Python a futex
  // wake-up at every unlock (4.3% of its samples in the Adam MLP, perf) and the graph a sleep.
  void publish(int64_t tag, at::Tensor value);
  // Publishes what publish() left. `wait`: also when Python holds the lock (graph side: before
  // the graph waits for Python, which may be waiting for these values, and at the end of each
  // iteration); otherwise only if the lock is free.
  void flush_pending(bool wait);

  // ---- Python side ----
  // Claims the next index for a value with `tag`; `holder` (the placeholder, or undefined when
  // Python keeps nothing) decides how long the value stays. Returns the index. Takes no lock:
  // claims are staged and applied in batches (every kStagedClaims, and before any other Python
  // call, PythonLock), as if Python had reached them then; a value the graph publishes first stays until its
  // claim arrives. A claim per op took the lock the graph publishes under once per op: 37 us of a
  // 390 us Adam step went to expect(), 20 of them in lock and unlock (the demo's MLP, perf).
  int64_t expect(int64_t tag, const at::Tensor& holder);
  // Python is done with `index` (a placeholder that has moved on to a newer index). A value a
  // deferred feed still waits for stays until the graph has taken it. Staged like expect().
  void retire(int64_t index);
  // A deferred feed of `index` was posted: keep its value until take() (graph side).
  void pin(int64_t index);
  std::optional<at::Tensor> take(int64_t index);
  // The graph's value at `index`, if it has been published and kept.
  std::optional<at::Tensor> value(int64_t index);
  // The newest index kept for a placeholder over `t`'s storage with `t`'s metadata, whose own
  // TensorImpl may be gone (autograd's copy of a saved output outlives the output: its entry is
  // kept while the storage lives, see Entry::storage). A search over the table: for the rare
  // tensor PythonRunner::linked_index finds no link for.
  std::optional<int64_t> index_over_storage(const at::Tensor& t);
  // The newest entry (not retired) whose value fills the whole of `storage` (a dataless
  // placeholder storage of `nbytes` bytes): offset 0, contiguous, of `dtype`. The base of the
  // tensors over that storage, when no view records it (PythonRunner::bind_base_first).
  std::optional<int64_t> index_covering(const c10::StorageImpl* storage, caffe2::TypeMeta dtype, size_t nbytes);
  int64_t published() const;
  // Spins (common/spin.h) until published() >= count, without the lock. True when reached.
  bool spin_published(int64_t count, std::chrono::nanoseconds budget) const;
  // The tag Python expects at `index`, if it has claimed that index.
  std::optional<int64_t> tag_at(int64_t index);
  int64_t expected() const;
  // Waits until published() >= count or `slice` has passed. True when reached. One thread
  // waits at a time (the Python side); publish() wakes it only when the count is reached.
  bool wait_published(int64_t count, std::chrono::nanoseconds slice);
  // Wakes waiters so that they re-check other conditions (the graph blocked or failed).
  void notify() { cv_.notify_all(); }
  // What materializing everything at a divergence needs, in index order (newer values last):
  // the holder if it is still alive, else a tensor over its storage that some other tensor
  // (autograd's saved copy of an output, a view) still uses; and the value.
  std::vector<std::pair<at::Tensor, at::Tensor>> live_values();
  // Graph side, after each iteration (GraphRunner): drops entries whose holder has died and that
  // both sides have passed: every such entry kept since the last sweep, and the older ones when
  // they have doubled in number (amortized: the cost is the entries kept since the last sweep,
  // not the table). The others go as soon as both sides have passed them (expect, publish).
  // Claims Python has staged but not applied, and a sweep that finds Python holding the lock,
  // wait for the next sweep. On the Python thread, at
  // each iteration boundary, the walk and the values' destruction were 2.3% of its
  // instructions in the `branches` program (callgrind); the graph thread mostly waits for
  // Python in such programs.
  void sweep();
  // Forgets everything and restarts both counters at 0 (the graph must be stopped).
  void clear();
  size_t size();

 private:
  struct Entry {
    int64_t tag = -1;
    bool expected = false;
    bool published = false;
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> holder;
    // The holder's storage when it has no memory yet: the value is needed while anything uses
    // it, not only the holder (autograd keeps outputs it saved as separate TensorImpls over the
    // same storage). A view of a real tensor reads that tensor's memory and needs nothing.
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
    c10::TensorOptions options;
    // Inline: expect() fills them for nearly every placeholder, and heap vectors cost two
    // mallocs (and two frees) per output.
    c10::SmallVector<int64_t, 5> sizes, strides;
    int64_t storage_offset = 0;
    at::Tensor value;
    int32_t pins = 0;
    bool retired = false;
  };
  // The newest entry (not retired) over `storage` that `matches`; under the lock.
  template <typename Matches>
  std::optional<int64_t> newest_over(const c10::StorageImpl* storage, Matches&& matches);
  static bool dead(const Entry& e) {
    if (e.storage) return e.storage->expired();
    return !e.holder || e.holder->expired();
  }
  [[noreturn]] static void mismatch(int64_t index, int64_t expected_tag, int64_t published_tag);
  // Graph thread, `lock` holding mu_: publishes pending_ in order, releases the lock, then the
  // values nobody needs die and a waiting Python is woken (a mismatch leaves with the lock
  // released).
  void publish_pending(std::unique_lock<std::mutex>& lock);
  // A claim expect() has not applied yet (Python thread only): the entry's Python half. It holds
  // the holder weakly, like the entry: a strong reference would be visible to the program
  // (autograd's AccumulateGrad steals a gradient only while nothing else holds it, and cloned it
  // instead, so that the backward took other ops than the traced one).
  struct Claim {
    int64_t index = 0;
    bool retire = false;  // a retire(), not a claim
    bool holder = false;  // a holder was given (defined)
    Entry entry;          // tag, and the holder's fields when it has storage
  };
  static constexpr size_t kStagedClaims = 32;
  static size_t claim_batch();  // kStagedClaims, or 1 with TERRA_STAGED_CLAIMS=0
  // Applies the staged claims (under mu_); values they drop go to `dropped`, to die after the
  // lock is released.
  void apply_claims(std::vector<at::Tensor>& dropped);
  void apply_if_full();  // after staging one: applies them once claim_batch() are staged
  // The lock of a Python-side call, the staged claims applied first. What they drop dies after
  // the lock is released (members are destroyed in reverse order, also when a claim throws).
  struct PythonLock {
    std::vector<at::Tensor> dropped;
    std::unique_lock<std::mutex> lock;
    explicit PythonLock(ValueTable& t) : lock(t.mu_) { t.apply_claims(dropped); }
  };
  void claim(Claim& c, std::vector<at::Tensor>& dropped);  // under mu_
  void retire_now(int64_t index, std::vector<at::Tensor>& dropped);  // under mu_

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Open addressing: every output of the program claims an entry and most are dropped within the
  // iteration; a node-based map paid a malloc and a free for each.
  common::FlatMap<int64_t, Entry> entries_;
  // Indices expect() kept for a live holder: the only entries sweep() has to look at. Young
  // ones (kept since the last sweep) are looked at every sweep; the ones that survived one are
  // old and looked at only when their number has doubled since they were last: a program that
  // keeps placeholders for good (`losses.append(loss.detach())`) made every iteration's sweep
  // walk all of them, so the iteration boundary grew with the run.
  std::vector<int64_t> held_;
  std::vector<int64_t> old_held_;
  size_t old_checked_ = 0;  // old_held_.size() after its last walk
  int64_t published_ = 0;
  int64_t waiting_for_ = 0;  // the count wait_published() waits for; 0: nobody waits
  // Each thread's own fields on cache lines the other thread never writes (x86: 64 bytes): the
  // Python thread's claims, the graph thread's published count for spinners and its pending
  // values. Sharing a line, each expect() paid for the line's trip from the other core.
  alignas(64) int64_t expected_ = 0;  // claimed by expect(), staged or applied (Python thread only)
  std::vector<Claim> claims_;         // staged (Python thread only)
  alignas(64) std::atomic<int64_t> published_seen_{0};  // published_, stored after each publish
  // The graph thread's own: values publish() could not hand over yet, and values to destroy
  // once mu_ is released (kept as members so that a publish allocates nothing).
  static constexpr size_t kMaxPending = 64;
  std::vector<std::pair<int64_t, at::Tensor>> pending_;
  std::vector<at::Tensor> dropped_;
};

}  // namespace terra::runtime
