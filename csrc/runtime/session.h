// One co-executed program (a wrapped model or a terra_torch.function): the traces merged so far,
// the Program and graph generated from them, and the PythonRunner/GraphRunner pair running that
// graph. The phases themselves (trace until covered, generate, co-execute, fall back) are
// decided in Python (terra_torch/runtime.py), which calls these steps.
#pragma once

#include <Python.h>
#include <frameobject.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "capture/region.h"
#include "emit/captured_program.h"
#include "emit/emitted_graph.h"
#include "runtime/python_runner.h"
#include "trace/program.h"

namespace terra::runtime {

class FusedExecutor;

struct SessionOptions {
  Drive drive = Drive::kCoExec;
  bool optimize = false;  // TorchScript passes on the generated graph
  // Straight-line stretches run compiled once compiled and checked (runtime/fused_executor.h):
  // results within a tolerance of eager's, not bitwise.
  bool fused = false;
  // Every merged trace is also kept as JSON, for export_program (warm start).
  bool keep_traces = false;
};

class Session {
 public:
  explicit Session(SessionOptions options) : options_(options) {}
  ~Session();

  // Merges the trace of a closed region. Returns true when the program as it stood already
  // accepted the trace (the iteration was covered: nothing new was learned).
  bool add(const capture::Region& region);
  size_t num_traces() const { return program_.num_traces(); }
  // The record at which the trace add() last merged left the program (its size: at its end),
  // -1 when it was covered: where a program that does not converge keeps differing.
  int64_t last_uncovered() const { return last_uncovered_; }

  // Generates the graph of everything merged so far and starts a runner for it. A previous
  // runner is synchronized (its live placeholders get their values) and shut down first.
  void build();
  bool has_runner() const { return runner_ != nullptr; }
  // Stops the program for good: the runner is synchronized and shut down, and compiled segments
  // are let go (FusedExecutor::close). Safe to call again.
  void shut_down();

  // Warm start (docs/RUNTIME.md, "Warm start"): the traces merged so far as one JSON text that
  // import_program merges again in another process, where locations mean the same
  // (capture/trace_json.h). Needs SessionOptions::keep_traces; throws std::invalid_argument
  // naming what cannot be kept (an argument without a written form). The text also holds the
  // ops learned to raise and each location's frames (for pictures).
  std::string export_program() const;
  // Merges the traces of an export_program text into this session, which has merged nothing
  // yet; build() then generates their graph. Throws std::invalid_argument, leaving the session
  // as it was, on a text it cannot read (malformed, another format, an operator unknown here).
  void import_program(const std::string& text);
  // The current graph's FusedExecutor (SessionOptions::fused), for its compiler; else null.
  const std::shared_ptr<FusedExecutor>& fused_executor() const { return fused_; }
  PythonRunner& runner();

  // A co-execution region whose ops the runner validates; its graph iteration is started.
  // `iteration` is the program's count, for the iteration log.
  std::shared_ptr<capture::Region> open_region(PyFrameObject* stop_frame, bool ignore_outermost_loops = false,
                                               int64_t iteration = -1);
  // Ends the iteration and closes the region. Returns true if it diverged. `partial`: see
  // PythonRunner::end_iteration.
  bool close_region(capture::Region& region, bool partial = false);

  // One co-executed iteration as Python's side saw it, from open_region to close_region: what
  // timelines draw and stats() sums. Kept here rather than in the phase machine
  // (terra_torch/runtime.py), which used to read two clocks and two counter tuples per
  // iteration for it: a boundary crosses into the extension twice (open, close), not four times.
  struct IterationSpan {
    int64_t iteration = -1;
    int64_t start_ns = 0, end_ns = 0;  // steady clock (CLOCK_MONOTONIC, as time.monotonic_ns)
    int64_t stall_ns = 0;              // Python blocked on the graph
    int64_t decisions = 0, feeds = 0, reads = 0;
  };
  // The latest kMaxIterationSpans co-executed iterations, oldest first.
  static constexpr size_t kMaxIterationSpans = 200'000;
  const std::deque<IterationSpan>& iteration_spans() const { return spans_; }
  // Sums over every co-executed iteration: Python's time in them minus its stalls, and the stalls.
  int64_t python_exec_ns() const { return python_exec_ns_; }
  int64_t python_stall_ns() const { return python_stall_ns_; }

  const emit::CapturedProgram& program() const { return program_; }
  const trace::Program* structured() const { return structured_ ? &*structured_ : nullptr; }
  const emit::EmittedGraph* emitted() const { return emitted_ ? &*emitted_ : nullptr; }
  int64_t builds() const { return builds_; }
  // Per TraceGraph node: the frames of the first record merged into it (for pictures).
  const std::vector<std::vector<std::string>>& node_frames() const { return node_frames_; }

 private:
  void remap_node_frames(const std::vector<std::vector<trace::NodeId>>& before);

  SessionOptions options_;
  emit::CapturedProgram program_;
  std::optional<trace::Program> structured_;
  std::optional<emit::EmittedGraph> emitted_;
  std::shared_ptr<FusedExecutor> fused_;  // runner_'s executor, when SessionOptions::fused
  std::unique_ptr<PythonRunner> runner_;  // points into structured_ and emitted_
  int64_t builds_ = 0;
  int64_t last_uncovered_ = -1;
  std::vector<std::vector<std::string>> node_frames_;
  // SessionOptions::keep_traces: each merged trace as JSON, and the tokens standing for its
  // externals' addresses (capture/trace_json.h).
  std::vector<std::string> kept_traces_;
  std::unordered_map<const void*, uint64_t> tokens_;
  uint64_t next_token_ = 1;
  // Per check key of a kept record: its location and operator, how export names a check.
  std::unordered_map<uint64_t, std::pair<uint64_t, c10::OperatorName>> kept_ops_;
  // Why the program cannot be kept ("" while it can): the first trace keep() refused.
  std::string unkept_;
  void keep(const capture::Trace& trace);
  // The latest co-execution region, reused by the next open_region() when nobody else holds
  // it (Python drops it when the iteration ends, unless a fallback's location keeps it).
  std::shared_ptr<capture::Region> spare_region_;
  // The open iteration's span: its start and the runner's counters then.
  IterationSpan open_span_;
  std::deque<IterationSpan> spans_;
  int64_t python_exec_ns_ = 0, python_stall_ns_ = 0;
  // The runner's cumulative counters, in IterationSpan's fields (start_ns: now).
  IterationSpan counters_now();
  void log_span();  // the open iteration ends now: its span joins the log and the sums
};

}  // namespace terra::runtime
