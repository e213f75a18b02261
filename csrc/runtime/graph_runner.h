// The GraphRunner of co-execution (docs/RUNTIME.md): a C++ thread that runs the
// generated graph once per iteration while the Python thread keeps running the user's program
// and talks to the graph through a ConcurrentChannel. Python never waits for the graph except
// where it needs data (a fetch) or asks to (wait_iteration / synchronize).
//
// Threading: the worker owns no Python state and needs no GIL to run the graph; the only time
// it may take the GIL is when it drops the last reference to a tensor whose Python object C++
// kept alive. So every blocking call from Python (waits, shutdown) must release the GIL first.
// The worker's thread-local state is set explicitly: grad mode off (the graph already contains
// the backward ops the program ran, and optimizer steps update leaves in place), no terra
// interception key in the TLS include set (checked per iteration: the graph must not be
// recorded), and the ChannelScope of this runner's channel. On a device with streams the graph
// runs on the channel's worker stream (runtime/stream_sync.h): start_iteration() leaves an event
// on the caller's current stream that the worker stream waits for, and wait_iteration() /
// synchronize() make the caller's current stream wait for the worker stream.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "runtime/team_guard.h"
#include "runtime/channels.h"
#include "runtime/executor.h"
#include "runtime/worker_threads.h"

namespace terra::runtime {

struct RunnerStats {
  int64_t iterations_started = 0;
  int64_t iterations_run = 0;     // finished without error
  int64_t iterations_failed = 0;  // error, cancel, or shut down before running
  int64_t exec_ns = 0;            // wall time inside Executor::run (includes graph stalls)
  int64_t python_wait_ns = 0;     // Python blocked in wait_iteration / synchronize
  WorkerThreadBudget threads;     // the worker's intra-op and MKL teams (runtime/worker_threads.h)
  TeamGuardCalls guarded;         // its guarded calls on one thread or torch's teams (team_guard.h)
};

class GraphRunner {
 public:
  GraphRunner(std::shared_ptr<Executor> executor, std::shared_ptr<ConcurrentChannel> channel);
  // shutdown(): cancels what is in flight and joins the worker.
  ~GraphRunner();
  GraphRunner(const GraphRunner&) = delete;
  GraphRunner& operator=(const GraphRunner&) = delete;

  const std::shared_ptr<ConcurrentChannel>& channel() const { return channel_; }

  // Enqueues one run of the graph; returns its number (0, 1, ...). Iterations run in order.
  // Throws std::logic_error after shutdown.
  int64_t start_iteration();
  // Waits at most `max_wait` for the oldest iteration not yet waited for. True once it has
  // finished (rethrowing its exception if it failed), false on timeout. Throws std::logic_error
  // if every started iteration has been waited for.
  bool wait_iteration(std::chrono::nanoseconds max_wait);
  // Counts as waited for the iterations that finished without error, oldest first, up to the
  // first that failed (left for wait_iteration to rethrow); returns how many. Never blocks, so
  // the caller may hold the GIL.
  int64_t take_finished();
  // Waits for every started iteration; rethrows the first error among those not yet waited for.
  bool synchronize(std::chrono::nanoseconds max_wait);
  // Stops the running iteration at its next channel op; it fails with `reason`. Queued
  // iterations fail too, until reset().
  void cancel(const std::string& reason) { channel_->cancel(reason); }
  // After a failed or cancelled iteration: drops what the channel still holds and clears the
  // cancel so the next iteration starts clean. Throws std::logic_error while one is in flight.
  void reset();
  // Cancels the running iteration, fails the queued ones, joins the worker. Idempotent.
  void shutdown();
  // For teardown while the Python interpreter is finalizing: a worker that needed the GIL could
  // then never get it, so instead of joining, cancel and detach it (its state is shared, it
  // exits on its own). Idempotent; a no-op after shutdown().
  void abandon();
  bool is_shut_down() const;
  // The program runs on the Python thread for now (eager or tracing): once the worker has no
  // iteration to run, it gives its OpenMP pool back (runtime/worker_threads.h). Never blocks.
  void release_pool();
  // How many iterations are started and not finished.
  int64_t in_flight() const;
  RunnerStats stats() const;
  // (start, end) of the most recent graph runs, steady-clock nanoseconds (the clock Python's
  // time.perf_counter_ns reads on Linux), oldest first; at most kMaxSpans are kept.
  std::vector<std::pair<int64_t, int64_t>> spans() const;
  static constexpr size_t kMaxSpans = 4096;

 private:
  struct State;
  static void worker_main(std::shared_ptr<State> state);
  void stop(bool join);

  std::shared_ptr<ConcurrentChannel> channel_;
  std::shared_ptr<State> state_;
  std::mutex stop_mu_;  // serializes shutdown()/abandon(): std::thread::join is not reentrant
  std::thread thread_;
};

}  // namespace terra::runtime
