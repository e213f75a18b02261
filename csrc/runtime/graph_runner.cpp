// GraphRunner: the worker thread, its iteration queue and the outcomes Python waits for.
#include "common/clock.h"
#include "common/spin.h"
#include "runtime/graph_runner.h"

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/thread_name.h>
#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <typeinfo>

#include "capture/terra_key.h"

namespace terra::runtime {

namespace {

using common::Clock;
using common::deadline_after;
using common::ns_since;



std::string iteration_name(int64_t it) { return "graph iteration " + std::to_string(it); }

// The interpreter reports every failing op as a plain runtime_error ("The following operation
// failed in the TorchScript interpreter..."); naming the iteration tells Python which one. Other
// types (NotImplementedError, errors raised by the executor itself) pass unchanged, so that
// Python still sees the matching exception class.
std::exception_ptr with_iteration(std::exception_ptr error, int64_t it) {
  try {
    std::rethrow_exception(error);
  } catch (const std::runtime_error& e) {
    if (typeid(e) == typeid(std::runtime_error))
      return std::make_exception_ptr(std::runtime_error("terra_torch: " + iteration_name(it) + " failed: " + e.what()));
  } catch (...) {
  }
  return error;
}

}  // namespace

// Shared by the GraphRunner object and its worker, so that an abandoned (detached) worker
// never touches freed memory.
struct GraphRunner::State {
  std::shared_ptr<Executor> executor;  // (shared: a FusedExecutor is also its compiler's)
  std::shared_ptr<ConcurrentChannel> channel;

  mutable std::mutex mu;
  std::condition_variable work_cv;  // the worker waits for iterations or a stop
  std::condition_variable done_cv;  // Python waits for finished iterations
  int64_t started = 0;              // iterations enqueued; they run in this order
  int64_t finished = 0;             // iterations with an outcome
  int64_t waited = 0;               // outcomes consumed by wait_iteration / synchronize
  std::deque<std::exception_ptr> outcomes;  // iterations waited..finished-1; null = success
  std::deque<StreamMark> marks;             // iterations finished..started-1: Python's stream then
  bool stopping = false;
  bool release_pool = false;  // release_pool() asked; the worker's next idle wait takes it
  // Bumped (under mu) whenever the worker has something new to look at: an iteration, a stop,
  // a pool release. The idle worker spins on it before it sleeps on work_cv (worker_main).
  std::atomic<uint64_t> kicks{0};
  RunnerStats stats;
  std::deque<std::pair<int64_t, int64_t>> spans;  // for timelines

  // One graph run on the worker thread; returns its error or null.
  std::exception_ptr run_once(int64_t it, const StreamMark& mark) {
    try {
      // The worker was created without terra's key; a graph run that got intercepted would be
      // recorded as a trace instead of computing, so refuse rather than guess.
      const auto tls = c10::impl::tls_local_dispatch_key_set();
      TORCH_CHECK(!tls.included_.has_backend(capture::kTerraBackendBit),
                  "terra_torch: the GraphRunner thread has terra's interception key in its TLS");
      c10::AutoGradMode no_grad(false);  // an op of the last run must not leave it on
      // Below ADInplaceOrView as well: the graph's in-place updates of real tensors (parameters,
      // optimizer state) must not bump their version counters, which Python's own placeholder
      // ops already bumped exactly as eager would; a second, asynchronous bump makes autograd
      // report a saved tensor as modified.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      emit::ChannelScope scope(channel.get());
      // The graph's kernels go to its own stream, after what Python's stream had been given when
      // the iteration started (docs/RUNTIME.md, "Streams").
      StreamSync::WorkerScope on_stream(channel->streams());
      channel->streams().worker_waits(mark);
      TeamGuardScope team_guard(true);  // small calls on one thread where calibrated (team_guard.h)
      executor->run({});
      channel->flush_published(true);  // the iteration's last values (ValueTable::publish)
      channel->sweep_values();
      return nullptr;
    } catch (const abi::__forced_unwind&) {
      throw;  // thread cancellation (pthread_exit) must keep unwinding
    } catch (...) {
      try {
        channel->flush_published(true);  // what the graph computed before it failed stays readable
      } catch (...) {
        // (a second mismatch: the first error is the one to report)
      }
      // A cancel unwinds the graph from a channel op with ChannelCancelled, but the TorchScript
      // interpreter rethrows every op's exception as its own runtime_error: ask the channel.
      if (channel->cancelled())
        return std::make_exception_ptr(std::runtime_error("terra_torch: " + iteration_name(it) +
                                                          " was cancelled: " + channel->cancel_reason()));
      // Python may be blocked on a fetch that will now never come: wake it with the reason.
      channel->cancel(iteration_name(it) + " failed");
      return with_iteration(std::current_exception(), it);
    }
  }
};

GraphRunner::GraphRunner(std::shared_ptr<Executor> executor, std::shared_ptr<ConcurrentChannel> channel)
    : channel_(std::move(channel)), state_(std::make_shared<State>()) {
  TORCH_CHECK(executor != nullptr && channel_ != nullptr, "terra_torch: GraphRunner needs an executor and a channel");
  state_->executor = std::move(executor);
  state_->channel = channel_;
  thread_ = std::thread(&GraphRunner::worker_main, state_);
}

GraphRunner::~GraphRunner() { stop(/*join=*/true); }

namespace {
// How long the worker waits for an iteration before it gives its OpenMP pool back.
constexpr std::chrono::milliseconds kPoolIdle{20};
}  // namespace

void GraphRunner::worker_main(std::shared_ptr<State> s) {
  c10::setThreadName("terra_graph");
  // A new thread's OpenMP team is the library default (all cores), not what the user set with
  // torch.set_num_threads: take the process's setting (runtime/worker_threads.h).
  const WorkerThreadBudget threads = adopt_worker_thread_budget();
  // A new thread starts with default TLS (grad mode on); the graph holds its backward ops
  // explicitly and updates leaves in place, so it runs without autograd.
  c10::GradMode::set_enabled(false);
  std::unique_lock lock(s->mu);
  s->stats.threads = threads;
  while (true) {
    auto has_work = [&] { return s->stopping || s->finished < s->started; };
    auto wake = [&] { return has_work() || s->release_pool; };
    if (!wake()) {
      // Python starts the next iteration a few tens of microseconds after this one ended (its
      // iteration boundary). Asleep on work_cv, the worker had to be woken by a futex syscall
      // that Python paid in start_iteration (2.8% of the Python thread on the branches program,
      // ~15 us a step); spinning for a short budget first (common/spin.h) lets start_iteration's
      // notify find no waiter. A worker that spun in vain sleeps as before.
      const uint64_t seen = s->kicks.load(std::memory_order_acquire);
      lock.unlock();
      common::spin_until([&] { return s->kicks.load(std::memory_order_acquire) != seen; }, common::spin_budget());
      lock.lock();
    }
    // The program runs eagerly or traces on the Python thread (release_pool(), or no iteration
    // for a while): its kernels would share the cores with this thread's idle OpenMP pool
    // (runtime/worker_threads.h). Between co-executed iterations the wait is far shorter.
    if (!s->work_cv.wait_for(lock, kPoolIdle, wake)) s->release_pool = true;
    while (!has_work()) {
      if (s->release_pool) {
        s->release_pool = false;
        lock.unlock();
        release_openmp_pool();  // (keeps the thread's team size)
        lock.lock();
      }
      s->work_cv.wait(lock, wake);
    }
    if (s->stopping) {
      for (int64_t it = s->finished; it < s->started; ++it) {
        s->outcomes.push_back(std::make_exception_ptr(
            std::runtime_error("terra_torch: " + iteration_name(it) + " did not run: the GraphRunner was shut down")));
        ++s->stats.iterations_failed;
      }
      s->finished = s->started;
      s->marks.clear();
      s->done_cv.notify_all();
      return;
    }
    const int64_t it = s->finished;
    StreamMark mark = std::move(s->marks.front());
    s->marks.pop_front();
    lock.unlock();
    const auto t0 = Clock::now();
    std::exception_ptr error = s->run_once(it, mark);
    mark.reset();
    const int64_t dt = ns_since(t0);
    lock.lock();
    s->stats.exec_ns += dt;
    s->stats.guarded = team_guard_calls_on_this_thread();  // (this thread's, since it started)
    const int64_t start = std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
    s->spans.emplace_back(start, start + dt);
    if (s->spans.size() > kMaxSpans) s->spans.pop_front();
    ++(error ? s->stats.iterations_failed : s->stats.iterations_run);
    s->outcomes.push_back(std::move(error));
    ++s->finished;
    s->done_cv.notify_all();
  }
}

int64_t GraphRunner::start_iteration() {
  int64_t it = 0;
  StreamMark mark = channel_->streams().mark_poster();
  {
    std::lock_guard lock(state_->mu);
    if (state_->stopping) throw std::logic_error("terra_torch: start_iteration() after the GraphRunner was shut down");
    state_->marks.push_back(std::move(mark));
    it = state_->started++;
    ++state_->stats.iterations_started;
    state_->release_pool = false;  // co-executing again: the pool is wanted
    state_->kicks.fetch_add(1, std::memory_order_release);
  }
  state_->work_cv.notify_all();
  return it;
}

bool GraphRunner::wait_iteration(std::chrono::nanoseconds max_wait) {
  State& s = *state_;
  std::exception_ptr error;
  {
    std::unique_lock lock(s.mu);
    if (s.waited >= s.started) throw std::logic_error("terra_torch: wait_iteration() with no iteration started");
    const auto t0 = Clock::now();
    const bool done = s.done_cv.wait_until(lock, deadline_after(max_wait), [&] { return s.finished > s.waited; });
    s.stats.python_wait_ns += ns_since(t0);
    if (!done) return false;
    error = std::move(s.outcomes.front());
    s.outcomes.pop_front();
    ++s.waited;
  }
  channel_->streams().reader_joins();  // the caller's stream goes on after the graph's work
  if (error) std::rethrow_exception(error);
  return true;
}

int64_t GraphRunner::take_finished() {
  State& s = *state_;
  int64_t taken = 0;
  {
    std::lock_guard lock(s.mu);
    while (s.finished > s.waited && s.outcomes.front() == nullptr) {
      s.outcomes.pop_front();
      ++s.waited;
      ++taken;
    }
  }
  if (taken > 0) channel_->streams().reader_joins();  // as wait_iteration does
  return taken;
}

bool GraphRunner::synchronize(std::chrono::nanoseconds max_wait) {
  State& s = *state_;
  std::exception_ptr first;
  {
    std::unique_lock lock(s.mu);
    const auto t0 = Clock::now();
    const bool done = s.done_cv.wait_until(lock, deadline_after(max_wait), [&] { return s.finished == s.started; });
    s.stats.python_wait_ns += ns_since(t0);
    if (!done) return false;
    for (auto& e : s.outcomes)
      if (e && !first) first = e;
    s.outcomes.clear();
    s.waited = s.finished;
  }
  channel_->streams().reader_joins();
  if (first) std::rethrow_exception(first);
  return true;
}

void GraphRunner::reset() {
  std::lock_guard lock(state_->mu);  // held across the channel reset: no iteration can start
  const int64_t busy = state_->started - state_->finished;
  if (busy > 0)
    throw std::logic_error("terra_torch: reset() with " + std::to_string(busy) +
                           " iteration(s) in flight; wait for them first");
  channel_->reset();
}

void GraphRunner::shutdown() { stop(/*join=*/true); }
void GraphRunner::abandon() { stop(/*join=*/false); }

void GraphRunner::stop(bool join) {
  std::lock_guard stop_lock(stop_mu_);  // two Python threads may shut down at once
  bool busy = false;
  {
    std::lock_guard lock(state_->mu);
    state_->stopping = true;
    state_->kicks.fetch_add(1, std::memory_order_release);
    busy = state_->finished < state_->started;
  }
  state_->work_cv.notify_all();
  // Only when something runs: an idle runner leaves its channel as it was.
  if (busy) channel_->cancel("the GraphRunner was shut down");
  if (!thread_.joinable()) return;
  if (join)
    thread_.join();
  else
    thread_.detach();
}

bool GraphRunner::is_shut_down() const {
  std::lock_guard lock(state_->mu);
  return state_->stopping;
}

int64_t GraphRunner::in_flight() const {
  std::lock_guard lock(state_->mu);
  return state_->started - state_->finished;
}

std::vector<std::pair<int64_t, int64_t>> GraphRunner::spans() const {
  std::lock_guard lock(state_->mu);
  return {state_->spans.begin(), state_->spans.end()};
}

void GraphRunner::release_pool() {
  {
    std::lock_guard lock(state_->mu);
    state_->release_pool = true;
    state_->kicks.fetch_add(1, std::memory_order_release);
  }
  state_->work_cv.notify_all();
}

RunnerStats GraphRunner::stats() const {
  std::lock_guard lock(state_->mu);
  return state_->stats;
}

}  // namespace terra::runtime
