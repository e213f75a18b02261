// One co-executed program (a wrapped model or a terra_torch.function): the traces merged so far,
// the Program and graph generated from them, and the PythonRunner/GraphRunner pair running that
// graph. The phases themselves (trace until covered, generate, co-execute, fall back) are
// decided in Python (terra_torch/runtime.py), which calls these steps.
#pragma once

#include <Python.h>
#include <frameobject.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "capture/region.h"
#include "emit/captured_program.h"
#include "emit/emitted_graph.h"
#include "runtime/python_runner.h"
#include "trace/program.h"

namespace terra::runtime {

struct SessionOptions {
  Drive drive = Drive::kCoExec;
  bool optimize = false;  // TorchScript passes on the generated graph
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
  PythonRunner& runner();

  // A co-execution region whose ops the runner validates; its graph iteration is started.
  std::shared_ptr<capture::Region> open_region(PyFrameObject* stop_frame, bool ignore_outermost_loops = false);
  // Ends the iteration and closes the region. Returns true if it diverged. `partial`: see
  // PythonRunner::end_iteration.
  bool close_region(capture::Region& region, bool partial = false);

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
  std::unique_ptr<PythonRunner> runner_;  // points into structured_ and emitted_
  int64_t builds_ = 0;
  int64_t last_uncovered_ = -1;
  std::vector<std::vector<std::string>> node_frames_;
  // The latest co-execution region, reused by the next open_region() when nobody else holds
  // it (Python drops it when the iteration ends, unless a fallback's location keeps it).
  std::shared_ptr<capture::Region> spare_region_;
};

}  // namespace terra::runtime
