// ConcurrentChannel: one mutex, one condition variable per direction.
//
// The graph thread never holds mu_ while it could need the GIL (dropping the last reference to a
// tensor whose Python object C++ kept alive takes the GIL): it moves tensors out of the queues
// and lets them die after unlocking. Python holds the GIL while posting, which is fine because
// the graph thread holds mu_ only for queue operations.
#include "common/clock.h"
#include "common/spin.h"
#include "runtime/channels.h"
#include "runtime/value_table.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>

#include "trace/program.h"

namespace terra::runtime {

namespace {

using common::Clock;
using common::deadline_after;
using common::ns_since;



}  // namespace

template <class Ready>
void ConcurrentChannel::wait_for_post(std::unique_lock<std::mutex>& lock, Ready&& ready) {
  const auto budget = common::spin_budget();
  if (budget.count() > 0) {
    const auto deadline = Clock::now() + budget;
    while (!cancelled_ && !ready()) {
      const uint64_t seen = post_seq_.load(std::memory_order_acquire);
      lock.unlock();
      const auto left = deadline - Clock::now();
      const bool posted = left.count() > 0 &&
                          common::spin_until([&] { return post_seq_.load(std::memory_order_acquire) != seen; },
                                             std::chrono::duration_cast<std::chrono::nanoseconds>(left));
      lock.lock();
      if (!posted) break;
    }
  }
  graph_cv_.wait(lock, [&] { return cancelled_ || ready(); });
}

void ConcurrentChannel::throw_cancelled(const char* side) const {
  throw ChannelCancelled(std::string("terra_torch: channel cancelled (") + reason_ + ") while the " + side +
                         " was waiting; reset the runner before the next iteration");
}

// ---- graph side -------------------------------------------------------------------------------

namespace {

// What the graph thread waits for, for the span of one wait: graph_waiting_ (under the lock) and
// its lock-free code for posters (graph_wants()), both cleared on every way out (a cancel throws).
struct Waiting {
  std::optional<GraphWait>& waiting;
  std::atomic<int64_t>& wanted;
  Waiting(std::optional<GraphWait>& slot, std::atomic<int64_t>& code, GraphWait what, int64_t wait_code)
      : waiting(slot), wanted(code) {
    waiting = what;
    wanted.store(wait_code, std::memory_order_release);
  }
  ~Waiting() {
    wanted.store(-1, std::memory_order_release);
    waiting.reset();
  }
};

}  // namespace

int64_t ConcurrentChannel::take_decision(int64_t site) {
  flush_published(false);
  StreamMark mark;  // a gate's; released after the lock, like tensors
  std::unique_lock lock(mu_);
  if (cancelled_) throw_cancelled("graph");
  auto& q = decisions_[site];
  if (q.empty()) {
    const auto t0 = Clock::now();
    {
      Waiting waiting(graph_waiting_, wanted_,
                      site >= kScalarKeyBase ? GraphWait{GraphWait::Kind::kScalar, site - kScalarKeyBase}
                      : site >= kGateKeyBase ? GraphWait{GraphWait::Kind::kGate, site - kGateKeyBase}
                                             : GraphWait{GraphWait::Kind::kDecision, site},
                      wait_code(false, site));
      flush_published(true);  // Python may wait for those values before it posts
      if (values_) values_->notify();
      wait_for_post(lock, [&] { return !q.empty(); });
    }
    stats_.graph_stall_ns += ns_since(t0);
    if (cancelled_) throw_cancelled("graph");
  }
  const int64_t v = q.front();
  q.pop_front();
  ++stats_.decisions;
  if (streams_.active() && is_gate(site)) {
    auto& marks = gate_marks_[site];
    if (!marks.empty()) {
      mark = std::move(marks.front());
      marks.pop_front();
    }
    lock.unlock();
    streams_.worker_waits(mark);
  }
  return v;
}

int64_t ConcurrentChannel::case_select(int64_t site) { return take_decision(site); }

bool ConcurrentChannel::loop_cond(int64_t site) {
  return take_decision(site) == static_cast<int64_t>(trace::kLoopContinue);
}

at::Tensor ConcurrentChannel::feed(int64_t slot) {
  flush_published(false);
  std::unique_lock lock(mu_);
  if (cancelled_) throw_cancelled("graph");
  auto& q = feeds_[slot];
  if (q.empty()) {
    const auto t0 = Clock::now();
    {
      Waiting waiting(graph_waiting_, wanted_, GraphWait{GraphWait::Kind::kFeed, slot}, wait_code(true, slot));
      flush_published(true);  // Python may wait for those values before it posts
      if (values_) values_->notify();
      wait_for_post(lock, [&] { return !q.empty(); });
    }
    stats_.graph_stall_ns += ns_since(t0);
    if (cancelled_) throw_cancelled("graph");
  }
  Fed fed = std::move(q.front());
  q.pop_front();
  ++stats_.feeds;
  std::shared_ptr<ValueTable> values = values_;
  lock.unlock();
  if (fed.index < 0) {
    if (streams_.active() && fed.tensor.defined() && fed.tensor.has_storage()) {
      streams_.worker_waits(fed.mark);
      streams_.worker_uses(fed.tensor.storage().data_ptr());
    }
    return std::move(fed.tensor);
  }
  // An earlier iteration computed it, so it is in the table while the placeholder lives.
  std::optional<at::Tensor> v = values ? values->take(fed.index) : std::nullopt;
  if (!v || !v->defined())
    throw std::runtime_error("terra_torch internal error: feed slot " + std::to_string(slot) +
                             " needs output " + std::to_string(fed.index) +
                             " of the program, which the graph has not kept");
  return *v;
}

void ConcurrentChannel::gate(int64_t node) { take_decision(kGateKeyBase + node); }

void ConcurrentChannel::publish(int64_t tag, const at::Tensor& value) {
  if (cancelled_.load(std::memory_order_acquire)) {
    std::lock_guard lock(mu_);  // (reason_ is read under it)
    throw_cancelled("graph");
  }
  if (!values_) throw std::runtime_error("terra_torch: terra::publish ran on a channel without a value table");
  values_->publish(tag, value);
}

void ConcurrentChannel::flush_published(bool wait) {
  if (values_) values_->flush_pending(wait);
}

void ConcurrentChannel::sweep_values() {
  if (values_) values_->sweep();
}

void ConcurrentChannel::attach_values(std::shared_ptr<ValueTable> values) {
  std::lock_guard lock(mu_);
  values_ = std::move(values);
}

StreamMark ConcurrentChannel::mark_for(const std::vector<Post>& posts) const {
  if (!streams_.active()) return nullptr;
  for (const Post& p : posts) {
    const bool device_feed = p.kind == Post::Kind::kFeed && p.tensor.defined() && streams_.covers(p.tensor.device());
    if (device_feed || (p.kind == Post::Kind::kDecision && is_gate(p.key))) return streams_.mark_poster();
  }
  return nullptr;
}

void ConcurrentChannel::post_batch(std::vector<Post>& posts) {
  if (posts.empty()) return;
  const StreamMark mark = mark_for(posts);  // one event covers the batch
  {
    std::lock_guard lock(mu_);
    if (cancelled_) throw_cancelled("Python side");
    for (Post& p : posts) {
      switch (p.kind) {
        case Post::Kind::kDecision:
          decisions_[p.key].push_back(p.value);
          if (mark && is_gate(p.key)) gate_marks_[p.key].push_back(mark);
          break;
        case Post::Kind::kFeed:
          feeds_[p.key].push_back(Fed{std::move(p.tensor), -1, mark});
          break;
        case Post::Kind::kDeferredFeed:  // the graph's own value: on its stream already
          feeds_[p.key].push_back(Fed{std::move(p.tensor), p.value, nullptr});
          break;
      }
    }
    post_seq_.fetch_add(1, std::memory_order_release);
  }
  posts.clear();
  graph_cv_.notify_all();
}

double ConcurrentChannel::feed_scalar(int64_t slot) {
  const int64_t bits = take_decision(kScalarKeyBase + slot);
  double value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

int64_t ConcurrentChannel::feed_int(int64_t slot) { return take_decision(kScalarKeyBase + slot); }

void ConcurrentChannel::fetch(int64_t slot, const at::Tensor& value) {
  at::Tensor copy = value.clone();  // outside the lock: it can be a large copy
  {
    std::lock_guard lock(mu_);
    if (cancelled_) throw_cancelled("graph");
    fetched_[slot].push_back(std::move(copy));
    ++stats_.fetches;
  }
  python_cv_.notify_all();
}

// ---- Python side ------------------------------------------------------------------------------

void ConcurrentChannel::post_decision(int64_t site, int64_t value) {
  const StreamMark mark = is_gate(site) ? streams_.mark_poster() : nullptr;
  {
    std::lock_guard lock(mu_);
    if (cancelled_) throw_cancelled("Python side");
    decisions_[site].push_back(value);
    if (mark) gate_marks_[site].push_back(mark);
    post_seq_.fetch_add(1, std::memory_order_release);
  }
  graph_cv_.notify_all();
}

void ConcurrentChannel::post_loop(int64_t site, bool again) {
  post_decision(site, again ? trace::kLoopContinue : trace::kLoopExit);
}

void ConcurrentChannel::post_feed(int64_t slot, at::Tensor value) {
  const StreamMark mark = value.defined() && streams_.covers(value.device()) ? streams_.mark_poster() : nullptr;
  {
    std::lock_guard lock(mu_);
    if (cancelled_) throw_cancelled("Python side");
    feeds_[slot].push_back(Fed{std::move(value), -1, mark});
    post_seq_.fetch_add(1, std::memory_order_release);
  }
  graph_cv_.notify_all();
}

std::optional<at::Tensor> ConcurrentChannel::wait_fetch(int64_t slot, std::chrono::nanoseconds max_wait) {
  std::unique_lock lock(mu_);
  auto& q = fetched_[slot];
  if (q.empty()) {
    if (cancelled_) throw_cancelled("Python side");
    const auto t0 = Clock::now();
    python_cv_.wait_until(lock, deadline_after(max_wait), [&] { return cancelled_ || !q.empty(); });
    stats_.python_stall_ns += ns_since(t0);
    if (q.empty()) {
      if (cancelled_) throw_cancelled("Python side");
      return std::nullopt;
    }
  }
  at::Tensor t = std::move(q.front());
  q.pop_front();
  return t;
}

// ---- both -------------------------------------------------------------------------------------

void ConcurrentChannel::cancel(const std::string& reason) {
  {
    std::lock_guard lock(mu_);
    if (!cancelled_) reason_ = reason;
    cancelled_ = true;
    post_seq_.fetch_add(1, std::memory_order_release);
  }
  graph_cv_.notify_all();
  python_cv_.notify_all();
}

bool ConcurrentChannel::cancelled() const { return cancelled_.load(std::memory_order_acquire); }

std::string ConcurrentChannel::cancel_reason() const {
  std::lock_guard lock(mu_);
  return reason_;
}

void ConcurrentChannel::reset() {
  // Swapped out under the lock, destroyed after it: the caller (Python, GIL held) may free
  // tensors whose Python objects C++ kept alive, and that must not happen under mu_.
  std::unordered_map<int64_t, std::deque<int64_t>> decisions;
  std::unordered_map<int64_t, std::deque<Fed>> feeds;
  std::unordered_map<int64_t, std::deque<at::Tensor>> fetched;
  std::unordered_map<int64_t, std::deque<StreamMark>> gate_marks;
  {
    std::lock_guard lock(mu_);
    decisions.swap(decisions_);
    feeds.swap(feeds_);
    gate_marks.swap(gate_marks_);
    fetched.swap(fetched_);
    cancelled_ = false;
    reason_.clear();
  }
}

std::string ConcurrentChannel::leftovers() const {
  std::lock_guard lock(mu_);
  std::string out;
  for (const auto& [site, q] : decisions_)
    if (!q.empty()) out += std::to_string(q.size()) + " decisions for site " + std::to_string(site) + "; ";
  for (const auto& [slot, q] : feeds_)
    if (!q.empty()) out += std::to_string(q.size()) + " feeds for slot " + std::to_string(slot) + "; ";
  for (const auto& [slot, q] : fetched_)
    if (!q.empty()) out += std::to_string(q.size()) + " unread fetches at slot " + std::to_string(slot) + "; ";
  return out;
}

std::optional<GraphWait> ConcurrentChannel::graph_waiting_for() const {
  std::lock_guard lock(mu_);
  return graph_waiting_;
}

bool ConcurrentChannel::graph_stuck() const {
  std::lock_guard lock(mu_);
  if (!graph_waiting_) return false;
  const int64_t id = graph_waiting_->id;
  switch (graph_waiting_->kind) {
    case GraphWait::Kind::kFeed: {
      auto it = feeds_.find(id);
      return it == feeds_.end() || it->second.empty();
    }
    case GraphWait::Kind::kGate:
    case GraphWait::Kind::kScalar:
    case GraphWait::Kind::kDecision: {
      const int64_t key = graph_waiting_->kind == GraphWait::Kind::kGate     ? id + kGateKeyBase
                          : graph_waiting_->kind == GraphWait::Kind::kScalar ? id + kScalarKeyBase
                                                                             : id;
      auto it = decisions_.find(key);
      return it == decisions_.end() || it->second.empty();
    }
  }
  return false;
}

ChannelStats ConcurrentChannel::stats() const {
  std::lock_guard lock(mu_);
  ChannelStats out = stats_;
  if (streams_.active()) out.worker_stream = streams_.worker_stream();
  return out;
}

}  // namespace terra::runtime
