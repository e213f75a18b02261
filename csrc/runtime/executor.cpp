// TorchScriptExecutor: the first Executor, on the TorchScript interpreter.
#include "runtime/executor.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include <mutex>
#include <optional>

namespace terra::runtime {

struct TorchScriptExecutor::Impl {
  std::shared_ptr<torch::jit::Graph> graph;
  TorchScriptMode mode = TorchScriptMode::kInterpreter;
  std::once_flag made;                                // code or executor below, made once
  std::optional<torch::jit::Code> code;               // kInterpreter
  std::optional<torch::jit::GraphExecutor> executor;  // kGraphExecutor

  void make() {
    if (mode == TorchScriptMode::kInterpreter) {
      // Code copies the graph it is given before it rewrites anything (its PreprocessGraph step,
      // torch/csrc/jit/runtime/interpreter/preprocess_graph.h), so the caller's graph is safe and
      // a copy here would be a second copy of the whole graph. (Copying only reads the graph:
      // the Python thread may print it meanwhile.)
      code.emplace(graph, "terra_graph");
    } else {
      // GraphExecutor rewrites the graph it is given, and the caller may keep printing or
      // re-optimizing its own: this executor owns a copy.
      graph = graph->copy();
      executor.emplace(graph, "terra_graph");
    }
  }
};

TorchScriptExecutor::TorchScriptExecutor(std::shared_ptr<torch::jit::Graph> graph, TorchScriptMode mode,
                                         CodeWhen when)
    : impl_(std::make_unique<Impl>()) {
  impl_->graph = std::move(graph);
  impl_->mode = mode;
  if (when == CodeWhen::kNow) std::call_once(impl_->made, [this] { impl_->make(); });
}

TorchScriptExecutor::~TorchScriptExecutor() = default;

std::vector<c10::IValue> TorchScriptExecutor::run(std::vector<c10::IValue> inputs) {
  std::call_once(impl_->made, [this] { impl_->make(); });  // (kFirstRun: here, on the graph's thread)
  at::AutoGradMode no_grad(false);
  torch::jit::Stack stack(std::make_move_iterator(inputs.begin()), std::make_move_iterator(inputs.end()));
  if (impl_->code) {
    torch::jit::InterpreterState(*impl_->code).run(stack);
  } else {
    impl_->executor->run(stack);
  }
  return std::vector<c10::IValue>(std::make_move_iterator(stack.begin()), std::make_move_iterator(stack.end()));
}

}  // namespace terra::runtime
