// Kernels that read GradMode below autograd, and how capture and the graph keep them exact.
//
// Below autograd almost no kernel looks at GradMode; aten::mkldnn_rnn_layer (nn.LSTM and nn.GRU
// on CPU, aten/src/ATen/native/mkldnn/RNN.cpp) does: it runs oneDNN's training primitive, which
// also fills the workspace its backward reads, only with GradMode on (in torch 2.13 whatever its
// `train` argument says; other versions may also require `train`). The training primitive's
// outputs differ from the inference one's in the last bits. The graph runs with GradMode off
// (runtime/executor.cpp): run as recorded, a training LSTM got no workspace and its backward
// failed, and one under torch.no_grad() would be exact only by accident.
//
// So capture folds GradMode into the `train` argument, in the form that leaves the kernel's
// choice unchanged (GradMode where the kernel ignores `train`, else `train && GradMode`; which
// one is probed once). The trace records it and co-execution validates it like any argument, and
// the graph sets GradMode to it around the op (emit/graph_emitter.cpp), so the graph's kernel
// chooses what eager's chose.
//
// Example: a generate loop under torch.no_grad() without model.eval():
//     eager:    mkldnn_rnn_layer(..., train=True), GradMode off  -> inference primitive
//     recorded: mkldnn_rnn_layer(..., train=False)
//     graph:    set_grad_enabled(False); mkldnn_rnn_layer(..., train=False); set_grad_enabled(False)
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstddef>
#include <optional>

namespace terra::capture {

// Position of the argument GradMode is folded into, for an op whose kernel reads GradMode.
std::optional<size_t> grad_mode_argument(const c10::OperatorHandle& op);

// Folds GradMode into that argument (see above); `args` are the op's arguments on the stack.
void fold_grad_mode(const c10::OperatorHandle& op, c10::IValue* args);

}  // namespace terra::capture
