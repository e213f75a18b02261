// The PythonRunner's link to the GraphRunner: posts (batched), waits for published values,
// stopping the graph (divergence, failure), draining finished iterations and recovering from a
// graph that failed.
#include "common/clock.h"
#include "common/spin.h"
#include "runtime/feed_snapshot.h"
#include "runtime/python_runner.h"

#include <Python.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Exceptions.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "capture/collectives.h"
#include "capture/placeholder.h"
#include "capture/region.h"
#include "capture/terra_key.h"
#include "capture/value_checks.h"
#include "runtime/executor.h"
#include "runtime/gil_release.h"
#include "runtime/runner_helpers.h"
#include "trace/hash.h"

namespace terra::runtime {

namespace {

using common::Clock;
using common::ns_since;


// Adds the time until the end of its scope to the Python side's stall counter.
struct StallAccount {
  int64_t& stall_ns;
  Clock::time_point t0 = Clock::now();
  ~StallAccount() { stall_ns += ns_since(t0); }
};

// Ctrl-C while Python waits for the graph: raise KeyboardInterrupt in the user's program.
void check_signals() {
  if (!Py_IsInitialized()) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  if (PyErr_CheckSignals() != 0) {
    python_error e;  // takes the pending KeyboardInterrupt, restored when it reaches Python
    e.persist();
    PyGILState_Release(gil);
    throw e;
  }
  PyGILState_Release(gil);
}

}  // namespace

// ---- posting -----------------------------------------------------------------------------------

namespace {

// Whether the graph thread, idle until it gets a post, waits for one of `pending` (the newest
// first: usually it waits for the post just made).
bool graph_waits_for(const std::vector<ConcurrentChannel::Post>& pending, int64_t wanted) {
  if (wanted < 0) return false;
  for (auto p = pending.rbegin(); p != pending.rend(); ++p)
    if (ConcurrentChannel::wait_code(p->kind != ConcurrentChannel::Post::Kind::kDecision, p->key) == wanted)
      return true;
  return false;
}

}  // namespace

void PythonRunner::post(Post p) {
  if (p.kind == Post::Kind::kFeed && p.tensor.defined())
    p.tensor = feed_values_.value(p.tensor, emitted_.feeds.at(static_cast<size_t>(p.key)).written);
  pending_.push_back(std::move(p));
  // Batched, so that a graph busy with earlier work is woken once per batch. In a program that
  // waits for the graph (send_early_), a batch goes at once when the graph sits idle waiting for
  // one of its posts: held back, it kept the graph idle until the batch filled or Python read,
  // and the read then waited for all the graph work the batch had held back (a read in the
  // middle of each forward: most of an iteration's work).
  if (drive_ != Drive::kCoExec) return;
  if (pending_.size() >= kPostBatch) {
    flush();
  } else if (send_early_ && graph_waits_for(pending_, channel_->graph_wants())) {
    ++stats_.early_batches;
    flush();
  }
}

void PythonRunner::flush() {
  for (const Post& p : pending_) {
    if (p.kind == Post::Kind::kDecision) {
      ++stats_.posted_decisions;
      continue;
    }
    ++stats_.posted_feeds;
    if (drive_ != Drive::kCoExec || !p.tensor.defined()) continue;
    if (kept_feeds_.empty() || kept_feeds_.back().first != started_) {
      std::vector<at::Tensor> list;
      if (!spare_feed_lists_.empty()) {
        list = std::move(spare_feed_lists_.back());
        spare_feed_lists_.pop_back();
      }
      kept_feeds_.emplace_back(started_, std::move(list));
    }
    kept_feeds_.back().second.push_back(p.tensor);
  }
  try {
    channel_->post_batch(pending_);
  } catch (const ChannelCancelled&) {
    surface_failure();  // a graph that failed cancelled the channel: its own error, not this one
    throw;
  }
}

void PythonRunner::surface_failure() {
  try {
    drain_outcomes(true);
  } catch (const python_error&) {
    throw;
  } catch (const std::exception& e) {
    recover_from_failure(describe_failure(e.what()));
  }
}

// "aten::select.int received the Python value 7 as index where the traced iterations passed 3".
// ---- waiting and values ------------------------------------------------------------------------

void PythonRunner::wait_for_graph(int64_t count) {
  // Python reads after this: its stream must also wait for the graph's (docs/RUNTIME.md, "Streams").
  StreamSync::JoinOnExit join(channel_->streams());
  if (values_->published() >= count) return;
  flush();
  try {
    wait_published(count);
  } catch (const python_error&) {
    throw;  // KeyboardInterrupt
  } catch (const std::exception& e) {
    recover_from_failure(describe_failure(e.what()));
  }
}

void PythonRunner::stop_graph(const std::string& why) {
  pending_.clear();
  channel_->cancel(why);
  {
    GilRelease no_gil;
    while (waited_ < started_) {
      try {
        runner_->wait_iteration(std::chrono::nanoseconds::max());
      } catch (...) {
        // a failed iteration, or one the cancel stopped
      }
      ++waited_;
    }
    runner_->reset();
  }
  release_kept_feeds();
}

void PythonRunner::recover_from_failure(const std::string& error) {
  stop_graph("the graph failed");
  known_.clear();  // what the graph had not computed did not happen
  // What it had computed did: the program may catch the error and go on with those tensors
  // (they ran before the op that failed, in program order).
  for (const auto& [holder, value] : values_->live_values()) refresh(holder, value);
  values_->clear();
  forget_links();
  if (in_iteration_ && !diverged_) {
    // Nothing of this iteration can run on the graph any more: the rest of it records real ops.
    diverged_ = true;
    reason_ = "the graph failed: " + error;
    divergence_record_ = -1;
    ++stats_.divergences;
  }
  throw std::runtime_error(error);
}

std::string PythonRunner::describe_failure(const std::string& error) {
  // The graph runs ops in the order Python validated them and publishes each op's outputs
  // when it has run: the first value not published is the op that failed (if Python had
  // reached it; the graph may also have run ahead into ops Python has not validated yet).
  // Iterations queued after the failed one are cancelled at their first channel op, and every
  // publish is one, so the count stays where the failure left it.
  if (error.find("The following operation failed") == std::string::npos) return error;
  const std::optional<int64_t> tag = values_->tag_at(values_->published());
  if (!tag) return error;
  const trace::NodeId node = static_cast<trace::NodeId>(*tag >> 8);
  const uint64_t key = program_.check_key(node);
  if (key == 0) return error;
  std::string where;
  if (node_frames_ != nullptr && node < node_frames_->size())
    for (const std::string& frame : (*node_frames_)[node]) where += "\n  " + frame;
  const emit::OpInfo* info = program_.info(node);
  if (info != nullptr && capture::is_collective(info->op))
    // Not the program's arguments but the process group: another rank failed, left or timed
    // out. Nothing to check before the next run (a check would issue the collective twice).
    return "terra_torch: the collective " + c10::toString(info->op.operator_name()) +
           " failed in the graph (did another rank fail or leave?)" +
           (where.empty() ? std::string() : ", issued at:" + where) + "\n" + error;
  program_.add_check(key);
  return "terra_torch: " + (info ? c10::toString(info->op.operator_name()) : std::string("an op")) +
         " raised in the graph after Python had gone past it (no except clause of the program covers it, and it "
         "had not raised here before; from now on it is checked before the graph runs it)" +
         (where.empty() ? std::string() : ", issued at:" + where) + "\n" + error;
}

void PythonRunner::wait_published(int64_t count) {
  ++read_waits_;
  const StallAccount account{stats_.stall_ns};
  const auto t0 = account.t0;
  GilRelease no_gil;
  // A value the graph is about to publish: seen in ~1 us by spinning, ~25 us later by sleeping.
  if (values_->spin_published(count, common::spin_budget())) return;
  auto last_signal_check = t0;
  while (!values_->wait_published(count, std::chrono::milliseconds(2))) {
    if (channel_->cancelled()) {
      // A failed graph cancels the channel before its iteration counts as finished: wait for
      // it (it stops at its next channel op), so that its own error is the one raised.
      drain_outcomes(true);
      throw std::runtime_error("terra_torch: the graph was cancelled (" + channel_->cancel_reason() + ")");
    }
    if (runner_->in_flight() == 0) {
      drain_outcomes(false);  // rethrows the graph's error, if it failed
      if (values_->published() >= count) return;
      throw std::runtime_error("terra_torch internal error: the graph stopped before computing output " +
                               std::to_string(count - 1) + " of the program");
    }
    if (channel_->graph_stuck()) {
      if (values_->published() >= count) return;
      const auto w = channel_->graph_waiting_for();
      std::ostringstream msg;
      msg << "terra_torch internal error: Python needs output " << count - 1 << " of the program but the graph ("
          << values_->published() << " published) waits for ";
      if (w) {
        msg << (w->kind == GraphWait::Kind::kFeed ? "feed " : w->kind == GraphWait::Kind::kGate ? "gate " : "decision ")
            << w->id;
      }
      throw std::runtime_error(msg.str());
    }
    if (Clock::now() - last_signal_check > std::chrono::milliseconds(100)) {
      last_signal_check = Clock::now();
      check_signals();
    }
  }
}

void PythonRunner::release_kept_feeds() {
  while (!kept_feeds_.empty() && kept_feeds_.front().first <= waited_) {
    std::vector<at::Tensor>& list = kept_feeds_.front().second;
    list.clear();  // (the tensors go here, on the Python thread: see kept_feeds_)
    if (spare_feed_lists_.size() < 4) spare_feed_lists_.push_back(std::move(list));
    kept_feeds_.pop_front();
  }
}

void PythonRunner::wait_until_in_flight_below(int64_t n) {
  if (started_ - waited_ < n) return;
  const StallAccount account{stats_.stall_ns};
  GilRelease no_gil;
  // Waits at most `wait` for the oldest iteration; a failed one is counted, then rethrown.
  auto take_one = [&](std::chrono::nanoseconds wait) {
    bool done = false;
    try {
      done = runner_->wait_iteration(wait);
    } catch (...) {
      ++waited_;
      throw;
    }
    if (done) ++waited_;
    return done;
  };
  while (started_ - waited_ >= n) {
    if (take_one(std::chrono::milliseconds(100))) continue;
    // A long iteration: Ctrl-C still reaches the program, and a graph that waits for a post
    // nobody will make (every started iteration has ended on this side, so Python owes it
    // nothing) is an error, not a hang.
    check_signals();
    if (channel_->graph_stuck() && !take_one(std::chrono::nanoseconds(0))) {
      const auto w = channel_->graph_waiting_for();
      const char* what = !w                                  ? "a post"
                         : w->kind == GraphWait::Kind::kFeed ? "feed "
                         : w->kind == GraphWait::Kind::kGate ? "gate "
                                                             : "decision ";
      throw std::runtime_error(std::string("terra_torch internal error: an iteration Python has ended waits on the "
                                           "graph side for ") + what + (w ? std::to_string(w->id) : std::string()));
    }
  }
}

void PythonRunner::drain_outcomes(bool block) {
  GilRelease no_gil;
  while (waited_ < started_) {
    bool done = false;
    try {
      done = runner_->wait_iteration(block ? std::chrono::nanoseconds::max() : std::chrono::nanoseconds(0));
    } catch (...) {
      ++waited_;
      throw;
    }
    if (!done) return;
    ++waited_;
  }
}

}  // namespace terra::runtime
