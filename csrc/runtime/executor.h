// The one interface through which generated graphs are run. TorchScript is deprecated (its
// Python entry points warn since torch 2.11, torch/jit/_script.py); keeping execution behind
// this class lets another executor (FusedExecutor) replace the TorchScript interpreter without
// touching graph generation's callers.
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <vector>

namespace torch::jit {
struct Graph;
}

namespace terra::runtime {

class Executor {
 public:
  virtual ~Executor() = default;
  // Runs the graph once: graph inputs in, graph outputs out. Channel ops talk to the
  // ChannelSource current on the calling thread (terra::emit::ChannelScope). Needs no GIL.
  virtual std::vector<c10::IValue> run(std::vector<c10::IValue> inputs) = 0;
};

enum class TorchScriptMode {
  kInterpreter,    // torch::jit::Code + InterpreterState: runs the graph as given
  kGraphExecutor,  // torch::jit::GraphExecutor: profiles the first runs, then specializes
};

// When the interpreter's code for the graph is made (torch::jit::Code compiles the graph into
// instructions: about a third of a co-executed program's graph build, ~2.5 ms of trip_count's
// 7-8 ms; docs/RUNTIME.md). kNow: in the constructor, where an error surfaces to its caller. kFirstRun:
// at the first run(), on the thread that runs the graph: the PythonRunner's worker compiles while
// Python validates the first ops of the iteration, instead of Python waiting at the iteration
// boundary. Only for graphs made by the emitter, whose nodes all resolve to an operator
// (graph_emitter.cpp, resolves_to_recorded), so that making the code cannot fail there.
enum class CodeWhen { kNow, kFirstRun };

// Runs with autograd off: the graph already holds the backward ops the program ran, and
// in-place updates of leaves (optimizer steps) must not be refused.
class TorchScriptExecutor final : public Executor {
 public:
  explicit TorchScriptExecutor(std::shared_ptr<torch::jit::Graph> graph,
                               TorchScriptMode mode = TorchScriptMode::kInterpreter, CodeWhen when = CodeWhen::kNow);
  ~TorchScriptExecutor() override;
  std::vector<c10::IValue> run(std::vector<c10::IValue> inputs) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace terra::runtime
