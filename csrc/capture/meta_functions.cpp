#include "capture/meta_functions.h"

#include <ATen/MetaFunctions.h>
#include <ATen/Operators.h>
#include <ATen/ScalarOps.h>
#include <ATen/ops/_unsafe_view_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/empty_like_compositeexplicitautograd_dispatch.h>

#include <string>
#include <unordered_map>

#include "common/env.h"

namespace terra::capture {

namespace {

// The boxed form of the unboxed function `F`, whose C++ signature is `Sig`: the op's own schema
// (at::_ops::<op>::schema), so a signature torch changes is a compile error here, not a
// misread stack.
template <class Sig, Sig* F>
c10::KernelFunction boxed() {
  return c10::KernelFunction::makeFromUnboxedFunction(c10::CompileTimeFunctionPointer<Sig, F>());
}

// relu is not structured: its CPU kernel is clamp_min(self, 0) after refusing bool inputs
// (aten/src/ATen/native/Activation.cpp), so its outputs are clamp_min's.
at::Tensor relu_meta(const at::Tensor& self) {
  TORCH_CHECK(self.scalar_type() != at::kBool, "Boolean inputs not supported for relu");
  return at::meta::clamp_min(self, 0);
}

// ones_like and zeros_like are empty_like, then filled (aten/src/ATen/native/TensorFactories.cpp):
// their outputs are empty_like's, whose kernel is the same C++ function on every device.
at::Tensor like_meta(const at::Tensor& self, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                     std::optional<at::Device> device, std::optional<bool> pin_memory,
                     std::optional<at::MemoryFormat> memory_format) {
  return at::compositeexplicitautograd::empty_like(self, dtype, layout, device, pin_memory, memory_format);
}

// The Scalar overloads of the binary ops wrap the number as a 0-dim CPU tensor and call the
// Tensor overload (aten/src/ATen/native/BinaryOps.cpp), which is structured.
at::Tensor add_scalar_meta(const at::Tensor& self, const at::Scalar& other, const at::Scalar& alpha) {
  return at::meta::add(self, at::native::wrapped_scalar_tensor(other), alpha);
}
at::Tensor sub_scalar_meta(const at::Tensor& self, const at::Scalar& other, const at::Scalar& alpha) {
  return at::meta::sub(self, at::native::wrapped_scalar_tensor(other), alpha);
}
at::Tensor mul_scalar_meta(const at::Tensor& self, const at::Scalar& other) {
  return at::meta::mul(self, at::native::wrapped_scalar_tensor(other));
}
at::Tensor div_scalar_meta(const at::Tensor& self, const at::Scalar& other) {
  return at::meta::div(self, at::native::wrapped_scalar_tensor(other));
}
at::Tensor& add__scalar_meta(at::Tensor& self, const at::Scalar& other, const at::Scalar& alpha) {
  return at::meta::add_(self, at::native::wrapped_scalar_tensor(other), alpha);
}
at::Tensor& sub__scalar_meta(at::Tensor& self, const at::Scalar& other, const at::Scalar& alpha) {
  return at::meta::sub_(self, at::native::wrapped_scalar_tensor(other), alpha);
}
at::Tensor& mul__scalar_meta(at::Tensor& self, const at::Scalar& other) {
  return at::meta::mul_(self, at::native::wrapped_scalar_tensor(other));
}
at::Tensor& div__scalar_meta(at::Tensor& self, const at::Scalar& other) {
  return at::meta::div_(self, at::native::wrapped_scalar_tensor(other));
}

// _ctc_loss_backward has no meta kernel. Its CPU and CUDA kernels return
// full_like(log_probs, -inf, LEGACY_CONTIGUOUS_MEMORY_FORMAT), then filled (aten/src/ATen/native/
// LossCTC.cpp, cuda/LossCTC.cu): log_probs' sizes and dtype, contiguous. Without it, every
// backward through F.ctc_loss waited for the graph.
at::Tensor ctc_loss_backward_meta(const at::Tensor& /*grad*/, const at::Tensor& log_probs, const at::Tensor& /*targets*/,
                                  at::IntArrayRef /*input_lengths*/, at::IntArrayRef /*target_lengths*/,
                                  const at::Tensor& /*neg_log_likelihood*/, const at::Tensor& /*log_alpha*/,
                                  int64_t /*blank*/, bool /*zero_infinity*/) {
  return at::compositeexplicitautograd::empty_like(log_probs, {}, at::MemoryFormat::Contiguous);
}
at::Tensor ctc_loss_backward_tensor_meta(const at::Tensor& grad, const at::Tensor& log_probs, const at::Tensor& targets,
                                         const at::Tensor& /*input_lengths*/, const at::Tensor& /*target_lengths*/,
                                         const at::Tensor& neg_log_likelihood, const at::Tensor& log_alpha,
                                         int64_t blank, bool zero_infinity) {
  return ctc_loss_backward_meta(grad, log_probs, targets, {}, {}, neg_log_likelihood, log_alpha, blank, zero_infinity);
}

// The samplers and sampler gradients torch.distributions uses that have no meta kernel: each CPU
// kernel makes its result as at::zeros or at::empty of its first argument's sizes and options,
// then fills it (aten/src/ATen/native/Distributions.cpp: _s_dirichlet_cpu, _s_binomial_cpu,
// _standard_gamma_grad_cpu, _dirichlet_grad_cpu). Without them a Beta, Dirichlet or Binomial
// sample ran for real on the Python side and again in the graph: two draws per sample.
at::Tensor first_argument_like(const at::Tensor& first) {
  return at::compositeexplicitautograd::empty_like(first, {}, at::MemoryFormat::Contiguous);
}
at::Tensor sample_dirichlet_meta(const at::Tensor& alpha, std::optional<at::Generator> /*generator*/) {
  return first_argument_like(alpha);
}
at::Tensor binomial_meta(const at::Tensor& count, const at::Tensor& /*prob*/, std::optional<at::Generator> /*generator*/) {
  return first_argument_like(count);
}
at::Tensor standard_gamma_grad_meta(const at::Tensor& self, const at::Tensor& /*output*/) {
  return first_argument_like(self);
}
at::Tensor dirichlet_grad_meta(const at::Tensor& x, const at::Tensor& /*alpha*/, const at::Tensor& /*total*/) {
  return first_argument_like(x);
}

// zero_ writes its argument and returns it; zero fits every dtype, so it refuses nothing.
at::Tensor& zero_meta(at::Tensor& self) { return self; }

struct Entry {
  const char* name;      // "aten::add"
  const char* overload;  // "Tensor", or "" for the default overload
  c10::KernelFunction (*make)();
};

// Structured ops only: libtorch exports their at::meta functions (generated), not the hand-written
// meta kernels of a few in-place ops (relu_, hardtanh_, masked_fill_), which would leave this
// library with an undefined symbol.
// OPS: the at::_ops struct of the overload (add_Tensor for aten::add.Tensor, add__Tensor for
// aten::add_.Tensor); FN: the at::meta function, picked among its overloads by the schema (its
// _symint form where the schema takes SymInts).
#define TERRA_META(OPS, FN) \
  Entry { at::_ops::OPS::name, at::_ops::OPS::overload_name, &boxed<at::_ops::OPS::schema, &at::meta::FN> }

const Entry kTable[] = {
    TERRA_META(addmm, addmm),
    TERRA_META(mm, mm),
    TERRA_META(bmm, bmm),
    TERRA_META(baddbmm, baddbmm),
    TERRA_META(addmv, addmv),
    TERRA_META(add_Tensor, add),
    TERRA_META(sub_Tensor, sub),
    TERRA_META(mul_Tensor, mul),
    TERRA_META(div_Tensor, div),
    TERRA_META(div_Tensor_mode, div),
    TERRA_META(add__Tensor, add_),
    TERRA_META(sub__Tensor, sub_),
    TERRA_META(mul__Tensor, mul_),
    TERRA_META(div__Tensor, div_),
    TERRA_META(div__Tensor_mode, div_),
    TERRA_META(neg, neg),
    TERRA_META(exp, exp),
    TERRA_META(log, log),
    TERRA_META(log1p, log1p),
    TERRA_META(sqrt, sqrt),
    TERRA_META(rsqrt, rsqrt),
    TERRA_META(tanh, tanh),
    TERRA_META(sigmoid, sigmoid),
    TERRA_META(sin, sin),
    TERRA_META(cos, cos),
    TERRA_META(reciprocal, reciprocal),
    TERRA_META(sign, sign),
    TERRA_META(erf, erf),
    TERRA_META(floor, floor),
    TERRA_META(ceil, ceil),
    TERRA_META(trunc, trunc),
    TERRA_META(exp2, exp2),
    TERRA_META(log2, log2),
    TERRA_META(expm1, expm1),
    TERRA_META(neg_, neg_),
    TERRA_META(exp_, exp_),
    TERRA_META(log_, log_),
    TERRA_META(sqrt_, sqrt_),
    TERRA_META(rsqrt_, rsqrt_),
    TERRA_META(tanh_, tanh_),
    TERRA_META(sigmoid_, sigmoid_),
    TERRA_META(reciprocal_, reciprocal_),
    TERRA_META(threshold, threshold),
    TERRA_META(threshold_, threshold_),
    TERRA_META(threshold_backward, threshold_backward),
    TERRA_META(gelu, gelu),
    TERRA_META(gelu_, gelu_),
    TERRA_META(gelu_backward, gelu_backward),
    TERRA_META(silu, silu),
    TERRA_META(silu_, silu_),
    TERRA_META(leaky_relu, leaky_relu),
    TERRA_META(leaky_relu_, leaky_relu_),
    TERRA_META(leaky_relu_backward, leaky_relu_backward),
    TERRA_META(elu, elu),
    TERRA_META(elu_, elu_),
    TERRA_META(elu_backward, elu_backward),
    TERRA_META(softplus, softplus),
    TERRA_META(softplus_backward, softplus_backward),
    TERRA_META(tanh_backward, tanh_backward),
    TERRA_META(sigmoid_backward, sigmoid_backward),
    TERRA_META(hardsigmoid, hardsigmoid),
    TERRA_META(mish, mish),
    TERRA_META(_log_softmax, _log_softmax),
    TERRA_META(_log_softmax_backward_data, _log_softmax_backward_data),
    TERRA_META(_softmax, _softmax),
    TERRA_META(_softmax_backward_data, _softmax_backward_data),
    TERRA_META(nll_loss_forward, nll_loss_forward_symint),
    TERRA_META(nll_loss_backward, nll_loss_backward_symint),
    TERRA_META(mse_loss, mse_loss),
    TERRA_META(smooth_l1_loss, smooth_l1_loss),
    TERRA_META(mean_dim, mean),
    TERRA_META(sum_dim_IntList, sum),
    TERRA_META(amax, amax),
    TERRA_META(amin, amin),
    TERRA_META(argmax, argmax),
    TERRA_META(argmin, argmin),
    TERRA_META(max_dim, max),
    TERRA_META(min_dim, min),
    TERRA_META(cumsum, cumsum),
    TERRA_META(cumprod, cumprod),
    TERRA_META(norm_ScalarOpt_dim, norm),
    TERRA_META(linalg_vector_norm, linalg_vector_norm),
    TERRA_META(all_dim, all),
    TERRA_META(any_dim, any),
    TERRA_META(prod_dim_int, prod),
    TERRA_META(eq_Scalar, eq),
    TERRA_META(eq_Tensor, eq),
    TERRA_META(ne_Scalar, ne),
    TERRA_META(ne_Tensor, ne),
    TERRA_META(lt_Scalar, lt),
    TERRA_META(lt_Tensor, lt),
    TERRA_META(le_Scalar, le),
    TERRA_META(le_Tensor, le),
    TERRA_META(gt_Scalar, gt),
    TERRA_META(gt_Tensor, gt),
    TERRA_META(ge_Scalar, ge),
    TERRA_META(ge_Tensor, ge),
    TERRA_META(clamp_Tensor, clamp),
    TERRA_META(clamp_min, clamp_min),
    TERRA_META(clamp_max, clamp_max),
    TERRA_META(clamp_min_, clamp_min_),
    TERRA_META(clamp_max_, clamp_max_),
    TERRA_META(clamp__Tensor, clamp_),
    TERRA_META(pow_Tensor_Scalar, pow),
    TERRA_META(pow_Tensor_Tensor, pow),
    TERRA_META(pow_Scalar, pow),
    TERRA_META(pow__Scalar, pow_),
    TERRA_META(maximum, maximum),
    TERRA_META(minimum, minimum),
    TERRA_META(atan2, atan2),
    TERRA_META(lerp_Scalar, lerp),
    TERRA_META(lerp_Tensor, lerp),
    TERRA_META(lerp__Scalar, lerp_),
    TERRA_META(lerp__Tensor, lerp_),
    TERRA_META(addcmul, addcmul),
    TERRA_META(addcdiv, addcdiv),
    TERRA_META(addcmul_, addcmul_),
    TERRA_META(addcdiv_, addcdiv_),
    TERRA_META(cat, cat),
    TERRA_META(gather, gather),
    TERRA_META(scatter_src, scatter),
    TERRA_META(scatter_value, scatter),
    TERRA_META(scatter_add, scatter_add),
    TERRA_META(index_add, index_add),
    TERRA_META(topk, topk_symint),
    TERRA_META(sort_stable, sort),
    TERRA_META(index_Tensor, index),
    TERRA_META(max_pool2d_with_indices, max_pool2d_with_indices),
    TERRA_META(max_pool2d_with_indices_backward, max_pool2d_with_indices_backward),
    TERRA_META(avg_pool2d, avg_pool2d),
    TERRA_META(avg_pool2d_backward, avg_pool2d_backward),
    TERRA_META(upsample_nearest2d, upsample_nearest2d_symint),
    TERRA_META(upsample_bilinear2d, upsample_bilinear2d_symint),
    TERRA_META(adaptive_max_pool2d, adaptive_max_pool2d),
    TERRA_META(adaptive_max_pool2d_backward, adaptive_max_pool2d_backward),
    TERRA_META(clamp, clamp),
    TERRA_META(clamp_, clamp_),
#define TERRA_META_AS(OPS, FN) Entry{at::_ops::OPS::name, at::_ops::OPS::overload_name, &boxed<at::_ops::OPS::schema, &FN>}
    TERRA_META_AS(relu, relu_meta),
    TERRA_META_AS(ones_like, like_meta),
    TERRA_META_AS(zeros_like, like_meta),
    TERRA_META_AS(empty_like, like_meta),
    TERRA_META_AS(zero_, zero_meta),
    TERRA_META_AS(_ctc_loss_backward, ctc_loss_backward_meta),
    TERRA_META_AS(_ctc_loss_backward_Tensor, ctc_loss_backward_tensor_meta),
    TERRA_META_AS(_sample_dirichlet, sample_dirichlet_meta),
    TERRA_META_AS(binomial, binomial_meta),
    TERRA_META_AS(_standard_gamma_grad, standard_gamma_grad_meta),
    TERRA_META_AS(_dirichlet_grad, dirichlet_grad_meta),
    TERRA_META_AS(add_Scalar, add_scalar_meta),
    TERRA_META_AS(sub_Scalar, sub_scalar_meta),
    TERRA_META_AS(mul_Scalar, mul_scalar_meta),
    TERRA_META_AS(div_Scalar, div_scalar_meta),
    TERRA_META_AS(add__Scalar, add__scalar_meta),
    TERRA_META_AS(sub__Scalar, sub__scalar_meta),
    TERRA_META_AS(mul__Scalar, mul__scalar_meta),
    TERRA_META_AS(div__Scalar, div__scalar_meta),
    // _unsafe_view is view's code without the alias annotation (aten/src/ATen/native/TensorShape.cpp)
    TERRA_META_AS(_unsafe_view, at::compositeexplicitautograd::_unsafe_view_symint),
#undef TERRA_META_AS
};

#undef TERRA_META

std::string key_of(const std::string& name, const std::string& overload) { return name + "." + overload; }

const std::unordered_map<std::string, c10::KernelFunction>& table() {
  // Built on first use, never destroyed (shape inference may run while other statics go away).
  static const auto* built = [] {
    auto* m = new std::unordered_map<std::string, c10::KernelFunction>();
    for (const Entry& e : kTable) m->emplace(key_of(e.name, e.overload), e.make());
    return m;
  }();
  return *built;
}

}  // namespace

const c10::KernelFunction* cpp_meta_function(const c10::OperatorHandle& op) {
  // TERRA_CPP_META=0: every op through the dispatcher, as before the table (for A/B benchmarks).
  static const bool enabled = !common::switched_off("TERRA_CPP_META");
  if (!enabled) return nullptr;
  const c10::OperatorName& name = op.operator_name();
  const auto& t = table();
  const auto it = t.find(key_of(name.name, name.overload_name));
  return it == t.end() ? nullptr : &it->second;
}

std::vector<std::string> cpp_meta_function_names() {
  std::vector<std::string> out;
  for (const auto& [key, kernel] : table()) out.push_back(key);
  return out;
}

}  // namespace terra::capture
