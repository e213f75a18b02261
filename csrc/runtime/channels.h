// The channel between the Python thread and the GraphRunner thread during co-execution
// (docs/RUNTIME.md, "The protocol"): the scripted channel replays a finished recording, this
// one is fed while the graph runs. The graph side blocks in case_select / loop_cond / feed until
// Python has posted the value; Python blocks in wait_fetch until the graph has published one.
// Each site and slot is its own FIFO: a site inside a loop decides once per iteration, a slot
// inside a loop feeds or fetches once per iteration, and Python may post ahead (even for the
// next graph iteration) because consumption order per site/slot is program order.
#pragma once

#include <chrono>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "emit/channel.h"
#include "runtime/stream_sync.h"

namespace terra::runtime {

class ValueTable;

// Gates share the decision queues under their own key range (sites are small numbers).
inline constexpr int64_t kGateKeyBase = int64_t(1) << 40;
// Scalar feeds: a float as its bits, an int or bool as itself, an int list as its length and
// then its elements (float lists: length, then the elements' bits). One range for all kinds.
inline constexpr int64_t kScalarKeyBase = int64_t(2) << 40;
inline bool is_scalar_key(int64_t key) { return key >= kScalarKeyBase; }
// Selected reads' case-select sites (emit/channel.h) lie below the gates.
inline bool is_select_site(int64_t key) { return key >= emit::kSelectSiteBase && key < kGateKeyBase; }

// Thrown on both sides once the channel is cancelled. On the graph side it unwinds the running
// graph out of whatever channel op it was in (the interpreter rethrows it as a runtime_error,
// which is why the GraphRunner asks the channel, not the exception type, whether it was a cancel).
class ChannelCancelled : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ChannelStats {
  int64_t graph_stall_ns = 0;   // graph thread blocked waiting for a decision or a feed
  int64_t python_stall_ns = 0;  // Python blocked in wait_fetch
  int64_t decisions = 0;        // consumed by the graph
  int64_t feeds = 0;            // consumed by the graph
  int64_t fetches = 0;          // published by the graph
  // The stream the graph runs on while events order it with Python's (none: CPU, or no policy).
  std::optional<c10::Stream> worker_stream;
};

// What the graph thread is blocked on right now (for tests and diagnostics).
struct GraphWait {
  enum class Kind { kDecision, kFeed, kGate, kScalar } kind;
  int64_t id;  // site or slot
};

class ConcurrentChannel final : public emit::ChannelSource {
 public:
  // ---- graph side (the terra:: ops call these on the GraphRunner thread) ----
  int64_t case_select(int64_t site) override;
  bool loop_cond(int64_t site) override;
  at::Tensor feed(int64_t slot) override;
  // Publishes a copy: the graph may update the tensor in place after Python asked for it, and
  // Python must see the value at the point of the read (ScriptedChannel does the same).
  void fetch(int64_t slot, const at::Tensor& value) override;
  // Co-execution: waits for Python's token for `node` (posted when Python validated the op).
  void gate(int64_t node) override;
  // Co-execution: hands the value to the value table (which must be attached). Takes no lock of
  // the channel's: it runs once per value the graph computes, and each acquisition of mu_ could
  // meet Python posting.
  void publish(int64_t tag, const at::Tensor& value) override;
  // Publishes the values the table had to leave with the graph thread (ValueTable::publish):
  // `wait` before the graph waits for Python (a channel op with nothing posted) and at the end
  // of an iteration (the GraphRunner); otherwise only if Python does not hold the table's lock.
  void flush_published(bool wait);
  // After an iteration: the value table's dead entries go, on the graph thread (ValueTable::sweep).
  void sweep_values();
  double feed_scalar(int64_t slot) override;
  int64_t feed_int(int64_t slot) override;

  // ---- Python side (never blocks except wait_fetch) ----
  // Case index at a case-select site, or kLoopContinue / kLoopExit at a loop-cond site: sites
  // share one numbering (trace::Program::sites), so one queue per site serves both.
  void post_decision(int64_t site, int64_t value);
  void post_case(int64_t site, int64_t index) { post_decision(site, index); }
  void post_loop(int64_t site, bool again);
  // An undefined tensor means "none" (a feed_or_none slot that takes the graph's own value).
  void post_feed(int64_t slot, at::Tensor value);
  // Many posts under one lock and one wake-up of the graph thread (the PythonRunner batches its
  // posts: waking the graph per op costs a context switch per op).
  // kDeferredFeed: the tensor is the graph's own value at `value` of the value table (Python
  // holds a placeholder of an earlier iteration; `tensor` keeps it alive until the graph's feed).
  // A gate token (Python validated a side-effecting op) is a decision at kGateKeyBase + node, a
  // Python float one at kScalarKeyBase + slot holding its bits.
  struct Post {
    enum class Kind { kDecision, kFeed, kDeferredFeed } kind;
    int64_t key;     // site (gates and scalars: their key range), or feed slot
    int64_t value;   // decision value, or the value table index of a deferred feed
    at::Tensor tensor;
  };
  void post_batch(std::vector<Post>& posts);
  // How the graph's stream and Python's are ordered (stream_sync.h). Set before the graph runs
  // or Python posts, never changed afterwards: both threads read it without the lock.
  void use_streams(StreamSync streams) { streams_ = std::move(streams); }
  const StreamSync& streams() const { return streams_; }
  // The value table behind publish and deferred feeds; waiters on it are woken whenever the
  // graph blocks here, so that they can tell "not yet" from "never". Attached before the graph
  // runs, never changed afterwards: the graph thread reads it without the lock.
  void attach_values(std::shared_ptr<ValueTable> values);
  // The next value published at `slot`, waiting at most `max_wait`; nullopt on timeout. Values
  // published before a cancel stay readable; once the queue is empty a cancel throws.
  std::optional<at::Tensor> wait_fetch(int64_t slot, std::chrono::nanoseconds max_wait);

  // ---- both ----
  // Wakes every waiter; every later channel op on the graph side and every wait that would
  // block on the Python side throws ChannelCancelled, until reset(). The first reason is kept.
  void cancel(const std::string& reason);
  bool cancelled() const;
  std::string cancel_reason() const;
  // Drops every queued decision, feed and fetched value and clears the cancel. Only meaningful
  // while no graph runs on this channel (GraphRunner::reset checks that).
  void reset();
  // Empty if nothing is queued in either direction, else a description (tests check that an
  // iteration consumed exactly what was posted and Python read every fetch).
  std::string leftovers() const;
  std::optional<GraphWait> graph_waiting_for() const;
  // What the graph thread waits for while its queue is empty, as wait_code(), else -1; read
  // without the lock. A poster that holds that post in an unsent batch sends the batch at once:
  // until it does, the graph is idle, and a read later in the iteration would wait for all the
  // graph work the batch held back (PythonRunner::post).
  static int64_t wait_code(bool feed, int64_t key) { return key * 2 + (feed ? 1 : 0); }
  int64_t graph_wants() const { return wanted_.load(std::memory_order_acquire); }
  // The graph is blocked on a decision, feed or gate that nobody has posted yet. When the only
  // poster (the Python thread) asks this, "true" means the graph will not move until it posts.
  bool graph_stuck() const;
  ChannelStats stats() const;

 private:
  int64_t take_decision(int64_t site);
  // The graph thread found its queue empty (mu_ held via `lock`): spins for the budget
  // (common/spin.h) while nothing is posted, then sleeps on graph_cv_ until `ready` or a cancel.
  template <class Ready>
  void wait_for_post(std::unique_lock<std::mutex>& lock, Ready&& ready);
  [[noreturn]] void throw_cancelled(const char* side) const;  // mu_ held

  mutable std::mutex mu_;
  std::condition_variable graph_cv_;   // the graph thread waits here for posts
  std::condition_variable python_cv_;  // Python waits here for fetches
  std::unordered_map<int64_t, std::deque<int64_t>> decisions_;
  struct Fed {
    at::Tensor tensor;
    int64_t index = -1;  // >= 0: the value table's entry (tensor is the placeholder to keep)
    StreamMark mark;     // what the worker stream waits for before it reads the tensor
  };
  // The poster's mark when what it posts needs one (a feed on the worker's device, a gate).
  StreamMark mark_for(const std::vector<Post>& posts) const;
  static bool is_gate(int64_t key) { return key >= kGateKeyBase && key < kScalarKeyBase; }
  std::unordered_map<int64_t, std::deque<Fed>> feeds_;
  // Beside each gate token while streams_ is active: the graph writes what Python may be using
  // on its own stream only once that stream's earlier work is done.
  std::unordered_map<int64_t, std::deque<StreamMark>> gate_marks_;
  StreamSync streams_;
  std::shared_ptr<ValueTable> values_;
  std::unordered_map<int64_t, std::deque<at::Tensor>> fetched_;
  std::atomic<bool> cancelled_{false};  // written under mu_; publish() reads it without
  // Counts posts and cancels (stored under mu_), so that the graph thread can spin on it
  // without the lock.
  std::atomic<uint64_t> post_seq_{0};
  std::string reason_;
  std::optional<GraphWait> graph_waiting_;
  std::atomic<int64_t> wanted_{-1};  // graph_wants(): set and cleared with graph_waiting_ (Waiting)
  ChannelStats stats_;
};

}  // namespace terra::runtime
