// Makes PyTorch's own cuDNN convolutions consult the profile record. While a record is enabled,
// terra's kernels replace aten::cudnn_convolution and aten::cudnn_convolution_transpose (where
// at::_convolution sends cuDNN forward work) and aten::convolution_backward (where autograd sends
// every convolution's backward) on the CUDA dispatch key. They are registered through a
// torch::Library created on enable and destroyed on disable, so PyTorch's kernels are back the
// moment the record is disabled. Anything they do not handle (no record, other backends, 64-bit
// sizes, a device the record does not describe, nothing ran) goes to PyTorch's own
// implementation, called directly (at::native::*, exported by libtorch_cuda / libtorch_cpu).
//
// Per call (issue 17, item 3) a kernel takes no lock and builds no string: the active selector
// is read through a per-thread copy (active.h), the record's device is checked once per thread,
// and the problem is handed over as a POD PlanKey plus pointers into the tensors' own sizes and
// strides; a cached plan then runs (conv_runner.h).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/native/ConvUtils.h>
#include <ATen/ops/convolution_backward_native.h>
#include <ATen/ops/cudnn_convolution_native.h>
#include <ATen/ops/cudnn_convolution_transpose_native.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <climits>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "profile/active.h"
#include "profile/cuda_hooks.h"
#include "profile/cudnn_problem.h"
#include "profile/plan_key.h"

namespace terra::profile::cuda {

namespace {

using at::Tensor;
using c10::SymIntArrayRef;

std::optional<DType> dtype_of(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return DType::float32;
    case c10::ScalarType::Half: return DType::float16;
    case c10::ScalarType::BFloat16: return DType::bfloat16;
    case c10::ScalarType::Double: return DType::float64;
    default: return std::nullopt;
  }
}

std::vector<int64_t> dims_of(at::IntArrayRef a) { return std::vector<int64_t>(a.begin(), a.end()); }

// Points into the tensor's own size and stride arrays: valid while the tensor lives.
DeviceTensor device_tensor(const Tensor& t) {
  return {t.data_ptr(), static_cast<int>(t.dim()), t.sizes().data(), t.strides().data()};
}

// One cuDNN problem in cuDNN's roles, keyed for the plan cache. nullopt: leave it to PyTorch.
std::optional<CudnnProblem> make_problem(Role role, const Tensor& x, const Tensor& w, const Tensor& y,
                                         const int64_t* padding, const int64_t* stride, const int64_t* dilation,
                                         int64_t groups, at::MemoryFormat format, bool allow_tf32, bool deterministic) {
  auto dtype = dtype_of(x.scalar_type());
  if (!dtype) return std::nullopt;
  const bool last = format == at::MemoryFormat::ChannelsLast || format == at::MemoryFormat::ChannelsLast3d;
  ProblemDims d;
  d.role = role;
  d.spatial = static_cast<int>(x.dim()) - 2;
  d.x = x.sizes().data(), d.w = w.sizes().data(), d.y = y.sizes().data();
  d.padding = padding, d.stride = stride, d.dilation = dilation;
  d.groups = groups;
  d.dtype = *dtype;
  d.layout = layout_for(last, d.spatial);
  d.math_mode = math_mode_for(*dtype, allow_tf32);
  d.deterministic = deterministic;
  d.device = x.get_device();
  d.align_x = byte_alignment(x.data_ptr()), d.align_w = byte_alignment(w.data_ptr()),
  d.align_y = byte_alignment(y.data_ptr());
  auto key = make_plan_key(d);
  if (!key) return std::nullopt;
  return CudnnProblem{*key, device_tensor(x), device_tensor(w), device_tensor(y)};
}

// What the provider takes: 2-d or 3-d convolutions of one floating type on one device, with at
// most 2^31 elements per tensor (PyTorch splits larger batches; we leave those to it).
bool eligible(std::initializer_list<const Tensor*> tensors) {
  const Tensor& first = **tensors.begin();
  if (!dtype_of(first.scalar_type())) return false;
  for (const Tensor* t : tensors) {
    if (!t->is_cuda() || t->device() != first.device() || t->scalar_type() != first.scalar_type()) return false;
    if (t->dim() != 4 && t->dim() != 5) return false;
    if (t->numel() == 0 || t->numel() > INT_MAX) return false;
  }
  return true;
}

// The record holds one device's timings; another kind of GPU in the same process uses PyTorch.
// Decided once per thread, selector and device (string compares are not per-call work).
bool record_describes(const Selector& selector, c10::DeviceIndex device) {
  thread_local uint64_t seen_selector = 0;
  thread_local uint64_t checked = 0, described = 0;  // bit per device index < 64
  if (seen_selector != selector.id()) seen_selector = selector.id(), checked = described = 0;
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit && (checked & bit)) return (described & bit) != 0;
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(device);
  const RecordHeader& h = selector.header();
  const bool same =
      h.device_name == p->name && h.compute_capability == std::to_string(p->major) + "." + std::to_string(p->minor);
  checked |= bit;
  if (same) described |= bit;
  if (same) return true;
  TORCH_WARN_ONCE("terra_torch profile record ", selector.path(), " describes ", h.device_label(), ", not cuda:",
                  static_cast<int>(device), " (", p->name, "); convolutions there use PyTorch's own choice");
  return false;
}

// Output size of a convolution, and of a transposed one (whose output is a convolution's input).
std::vector<int64_t> conv_out_size(const Tensor& x, const Tensor& w, at::IntArrayRef pad, at::IntArrayRef stride,
                                   at::IntArrayRef dil) {
  std::vector<int64_t> out{x.size(0), w.size(0)};
  for (int64_t d = 2; d < x.dim(); ++d)
    out.push_back((x.size(d) + 2 * pad[d - 2] - dil[d - 2] * (w.size(d) - 1) - 1) / stride[d - 2] + 1);
  return out;
}

std::vector<int64_t> conv_transpose_out_size(const Tensor& x, const Tensor& w, at::IntArrayRef pad,
                                             at::IntArrayRef out_pad, at::IntArrayRef stride, at::IntArrayRef dil,
                                             int64_t groups) {
  std::vector<int64_t> out{x.size(0), w.size(1) * groups};
  for (int64_t d = 2; d < x.dim(); ++d)
    out.push_back((x.size(d) - 1) * stride[d - 2] - 2 * pad[d - 2] + dil[d - 2] * (w.size(d) - 1) + 1 +
                  out_pad[d - 2]);
  return out;
}

// Runs one problem through the selector; warnings become torch warnings (Python warnings for
// the caller, replayed from autograd's threads too). False: let PyTorch do it.
bool run_problem(Selector& selector, const CudnnProblem& problem) {
  Outcome outcome = run_cudnn(selector, problem);
  for (const Diagnostic& d : selector.drain_warnings()) TORCH_WARN("terra_torch profile record: ", d.message);
  return outcome.ok;
}

Tensor conv_forward(const Tensor& input, const Tensor& weight, SymIntArrayRef padding_s, SymIntArrayRef stride_s,
                    SymIntArrayRef dilation_s, c10::SymInt groups_s, bool benchmark, bool deterministic,
                    bool allow_tf32) {
  at::IntArrayRef padding = C10_AS_INTARRAYREF_SLOW(padding_s), stride = C10_AS_INTARRAYREF_SLOW(stride_s),
                  dilation = C10_AS_INTARRAYREF_SLOW(dilation_s);
  const int64_t groups = groups_s.expect_int();
  auto native = [&] {
    return at::native::cudnn_convolution(input, weight, padding, stride, dilation, groups, benchmark, deterministic,
                                         allow_tf32);
  };
  Selector* selector = active_selector_for_this_thread();
  if (!selector || !eligible({&input, &weight}) || !record_describes(*selector, input.device().index()))
    return native();
  c10::cuda::CUDAGuard guard(input.device());
  const at::MemoryFormat format = at::native::cudnn_conv_suggest_memory_format(input, weight);
  Tensor x = input.contiguous(format), w = weight.contiguous(format);
  Tensor y = at::empty(conv_out_size(x, w, padding, stride, dilation), x.options().memory_format(format));
  if (!eligible({&y})) return native();
  auto problem = make_problem(Role::forward, x, w, y, padding.data(), stride.data(), dilation.data(), groups, format,
                              allow_tf32, deterministic);
  return problem && run_problem(*selector, *problem) ? y : native();
}

// cuDNN runs a transposed convolution as the data gradient of the mirror convolution.
Tensor conv_transpose_forward(const Tensor& input, const Tensor& weight, SymIntArrayRef padding_s,
                              SymIntArrayRef output_padding_s, SymIntArrayRef stride_s, SymIntArrayRef dilation_s,
                              c10::SymInt groups_s, bool benchmark, bool deterministic, bool allow_tf32) {
  at::IntArrayRef padding = C10_AS_INTARRAYREF_SLOW(padding_s), output_padding = C10_AS_INTARRAYREF_SLOW(output_padding_s),
                  stride = C10_AS_INTARRAYREF_SLOW(stride_s), dilation = C10_AS_INTARRAYREF_SLOW(dilation_s);
  const int64_t groups = groups_s.expect_int();
  auto native = [&] {
    return at::native::cudnn_convolution_transpose(input, weight, padding, output_padding, stride, dilation, groups,
                                                   benchmark, deterministic, allow_tf32);
  };
  Selector* selector = active_selector_for_this_thread();
  if (!selector || !eligible({&input, &weight}) || !record_describes(*selector, input.device().index()))
    return native();
  c10::cuda::CUDAGuard guard(input.device());
  const at::MemoryFormat format = at::native::cudnn_conv_suggest_memory_format(input, weight);
  Tensor dy = input.contiguous(format), w = weight.contiguous(format);
  Tensor out = at::empty(conv_transpose_out_size(dy, w, padding, output_padding, stride, dilation, groups),
                         dy.options().memory_format(format));
  if (!eligible({&out})) return native();
  // The mirror convolution maps `out` to `dy`: its data gradient is this op's forward.
  auto problem = make_problem(Role::backward_data, out, w, dy, padding.data(), stride.data(), dilation.data(), groups,
                              format, allow_tf32, deterministic);
  return problem && run_problem(*selector, *problem) ? out : native();
}

std::tuple<Tensor, Tensor, Tensor> conv_backward(const Tensor& grad_output, const Tensor& input, const Tensor& weight,
                                                 at::OptionalSymIntArrayRef bias_sizes_s, SymIntArrayRef stride_s,
                                                 SymIntArrayRef padding_s, SymIntArrayRef dilation_s, bool transposed,
                                                 SymIntArrayRef output_padding_s, c10::SymInt groups_s,
                                                 std::array<bool, 3> mask) {
  const int64_t groups = groups_s.expect_int();
  auto native = [&] {
    at::OptionalIntArrayRef bias_sizes;
    if (bias_sizes_s) bias_sizes = C10_AS_INTARRAYREF_SLOW(*bias_sizes_s);
    return at::native::convolution_backward(grad_output, input, weight, bias_sizes, C10_AS_INTARRAYREF_SLOW(stride_s),
                                            C10_AS_INTARRAYREF_SLOW(padding_s), C10_AS_INTARRAYREF_SLOW(dilation_s),
                                            transposed, C10_AS_INTARRAYREF_SLOW(output_padding_s), groups, mask);
  };
  Selector* selector = active_selector_for_this_thread();
  if (!selector || !input.is_cuda() || !(mask[0] || mask[1])) return native();
  // Only what PyTorch itself would give to cuDNN (not depthwise kernels, not empty tensors, ...).
  at::native::ConvBackend backend = at::native::select_conv_backend(
      input, weight, std::nullopt, stride_s, padding_s, dilation_s, transposed, output_padding_s, groups_s, bias_sizes_s);
  if (backend != at::native::ConvBackend::Cudnn && backend != at::native::ConvBackend::CudnnTranspose) return native();

  // 1-d convolutions run as 2-d ones with a unit height, as ATen's view4d does.
  std::vector<int64_t> stride = dims_of(C10_AS_INTARRAYREF_SLOW(stride_s));
  std::vector<int64_t> padding = dims_of(C10_AS_INTARRAYREF_SLOW(padding_s));
  std::vector<int64_t> dilation = dims_of(C10_AS_INTARRAYREF_SLOW(dilation_s));
  Tensor x = input, w = weight, gy = grad_output;
  const bool one_d = weight.dim() == 3;
  if (one_d) {
    x = x.unsqueeze(2), w = w.unsqueeze(2), gy = gy.unsqueeze(2);
    stride.insert(stride.begin(), 1), padding.insert(padding.begin(), 0), dilation.insert(dilation.begin(), 1);
  }
  if (!eligible({&x, &w, &gy}) || !record_describes(*selector, x.device().index())) return native();
  c10::cuda::CUDAGuard guard(x.device());
  const at::MemoryFormat format = at::native::cudnn_conv_suggest_memory_format(x, w);
  x = x.contiguous(format), w = w.contiguous(format), gy = gy.contiguous(format);
  const at::Context& ctx = at::globalContext();
  const bool deterministic = ctx.deterministicCuDNN() || ctx.deterministicAlgorithms();
  const bool allow_tf32 = ctx.allowTF32CuDNN(at::Float32Op::CONV);
  auto problem_for = [&](Role role, const Tensor& cx, const Tensor& cw, const Tensor& cy) {
    return make_problem(role, cx, cw, cy, padding.data(), stride.data(), dilation.data(), groups, format, allow_tf32,
                        deterministic);
  };

  Tensor grad_input, grad_weight, grad_bias;
  if (mask[0]) {
    grad_input = at::empty(x.sizes(), gy.options().memory_format(format));
    // Transposed: the input gradient is the mirror convolution's forward, from gy to grad_input.
    auto p = transposed ? problem_for(Role::forward, gy, w, grad_input)
                        : problem_for(Role::backward_data, grad_input, w, gy);
    if (!p || !run_problem(*selector, *p)) return native();
  }
  if (mask[1]) {
    grad_weight = at::empty(w.sizes(), w.options().memory_format(format));
    auto p = transposed ? problem_for(Role::backward_filter, gy, grad_weight, x)
                        : problem_for(Role::backward_filter, x, grad_weight, gy);
    if (!p || !run_problem(*selector, *p)) return native();
  }
  if (mask[2]) {
    std::vector<int64_t> reduce{0};
    for (int64_t d = 2; d < grad_output.dim(); ++d) reduce.push_back(d);
    grad_bias = grad_output.sum(reduce);
  }
  if (one_d) {
    if (grad_input.defined()) grad_input = grad_input.squeeze(2);
    if (grad_weight.defined()) grad_weight = grad_weight.squeeze(2);
  }
  return {grad_input, grad_weight, grad_bias};
}

// Registering over PyTorch's kernels makes the dispatcher warn "Overriding a previously
// registered kernel"; that is the intent here, so that one warning is dropped.
class DropOverrideWarning : public c10::WarningHandler {
 public:
  explicit DropOverrideWarning(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") == std::string::npos) next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

std::mutex& library_mutex() {
  static std::mutex mu;
  return mu;
}

std::unique_ptr<torch::Library>& library() {
  static std::unique_ptr<torch::Library> lib;
  return lib;
}

}  // namespace

void install_kernels() {
  std::lock_guard<std::mutex> lock(library_mutex());
  if (library()) return;
  DropOverrideWarning filter(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard guard(&filter);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  lib->impl("cudnn_convolution", TORCH_FN(conv_forward));
  lib->impl("cudnn_convolution_transpose", TORCH_FN(conv_transpose_forward));
  lib->impl("convolution_backward", TORCH_FN(conv_backward));
  library() = std::move(lib);
}

void uninstall_kernels() {
  std::lock_guard<std::mutex> lock(library_mutex());
  library().reset();  // the Library's registration handles deregister; PyTorch's kernels are back
}

bool kernels_installed() {
  std::lock_guard<std::mutex> lock(library_mutex());
  return library() != nullptr;
}

}  // namespace terra::profile::cuda
