#include "capture/grad_mode_kernels.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace terra::capture {

namespace {

struct RnnLayer {
  std::optional<c10::OperatorHandle> op;
  std::optional<size_t> train;
};

// (aten operators are registered once for the process: the handle is looked up once)
const RnnLayer& rnn_layer() {
  static const RnnLayer layer = [] {
    RnnLayer l;
    l.op = c10::Dispatcher::singleton().findSchema({"aten::mkldnn_rnn_layer", ""});
    if (l.op) l.train = l.op->schema().argumentIndexWithName("train");
    return l;
  }();
  return layer;
}

// Whether the kernel trains with GradMode on even when told train=false: one LSTM step of size 1.
// Called from inside Region::handle, whose own calls are not intercepted.
bool kernel_ignores_train() {
  static const bool ignores = [] {
    try {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      c10::AutoGradMode grad(true);
      const auto z = [](c10::IntArrayRef sizes) { return at::zeros(sizes, at::kFloat); };
      auto out = at::mkldnn_rnn_layer(z({1, 1, 1}), z({4, 1}), z({4, 1}), z({4}), z({4}), z({1, 1}), z({1, 1}),
                                      /*reverse=*/false, /*batch_sizes=*/{}, /*mode=LSTM*/ 2, /*hidden_size=*/1,
                                      /*num_layers=*/1, /*has_biases=*/true, /*bidirectional=*/false,
                                      /*batch_first=*/false, /*train=*/false);
      return std::get<3>(out).defined();
    } catch (const std::exception&) {
      return false;  // (then `train && GradMode`, which is right for a kernel that reads both)
    }
  }();
  return ignores;
}

}  // namespace

std::optional<size_t> grad_mode_argument(const c10::OperatorHandle& op) {
  const RnnLayer& l = rnn_layer();
  if (l.op && l.train && op == *l.op) return l.train;
  return std::nullopt;
}

void fold_grad_mode(const c10::OperatorHandle& op, c10::IValue* args) {
  const std::optional<size_t> i = grad_mode_argument(op);
  if (!i || !args[*i].isBool()) return;
  const bool grad = c10::GradMode::is_enabled();
  args[*i] = c10::IValue(kernel_ignores_train() ? grad : (args[*i].toBool() && grad));
}

}  // namespace terra::capture
