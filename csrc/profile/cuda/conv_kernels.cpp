// Makes PyTorch's own cuDNN convolutions consult the profile record. While a record is enabled,
// terra's kernels replace aten::cudnn_convolution and aten::cudnn_convolution_transpose (where
// at::_convolution sends cuDNN forward work) and aten::convolution_backward (where autograd sends
// every convolution's backward) on the CUDA dispatch key. They are registered through a
// torch::Library created on enable and destroyed on disable, so PyTorch's kernels are back the
// moment the record is disabled. Anything they do not handle (no record, other backends, 64-bit
// sizes, a device the record does not describe, nothing ran) goes to PyTorch's own
// implementation, called directly (at::native::*, exported by libtorch_cuda / libtorch_cpu).
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

#include "profile/active.h"
#include "profile/cuda_hooks.h"
#include "profile/cudnn_problem.h"

namespace terra::profile::cuda {

namespace {

using at::Tensor;
using c10::SymIntArrayRef;

std::string dtype_name(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Double: return "float64";
    default: return {};
  }
}

std::string layout_name(at::MemoryFormat format, int64_t dim) {
  if (format == at::MemoryFormat::ChannelsLast) return "nhwc";
  if (format == at::MemoryFormat::ChannelsLast3d) return "ndhwc";
  return dim == 5 ? "ncdhw" : "nchw";
}

Dims dims_of(at::IntArrayRef a) { return Dims(a.begin(), a.end()); }

DeviceTensor device_tensor(const Tensor& t) { return {t.data_ptr(), dims_of(t.sizes()), dims_of(t.strides())}; }

// What the legacy cuDNN API can take: 2-d or 3-d convolutions of one floating type on one device,
// with sizes that fit its int descriptors (PyTorch splits larger batches; we leave those to it).
bool eligible(std::initializer_list<const Tensor*> tensors) {
  const Tensor& first = **tensors.begin();
  if (dtype_name(first.scalar_type()).empty()) return false;
  for (const Tensor* t : tensors) {
    if (!t->is_cuda() || t->device() != first.device() || t->scalar_type() != first.scalar_type()) return false;
    if (t->dim() != 4 && t->dim() != 5) return false;
    if (t->numel() == 0 || t->numel() > INT_MAX) return false;
  }
  return true;
}

// The record holds one device's timings; another kind of GPU in the same process uses PyTorch.
bool record_describes(const Selector& selector, c10::DeviceIndex device) {
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(device);
  RecordHeader h = selector.header();
  if (h.device_name == p->name && h.compute_capability == std::to_string(p->major) + "." + std::to_string(p->minor))
    return true;
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

ConvCall make_call(const Tensor& op_input, const Tensor& weight, const Tensor& op_output, at::IntArrayRef pad,
                   at::IntArrayRef stride, at::IntArrayRef dil, int64_t groups, bool transposed,
                   at::MemoryFormat format, bool allow_tf32, bool deterministic) {
  ConvCall call;
  call.input = dims_of(op_input.sizes());
  call.weight = dims_of(weight.sizes());
  call.output = dims_of(op_output.sizes());
  call.padding = dims_of(pad);
  call.stride = dims_of(stride);
  call.dilation = dims_of(dil);
  call.groups = groups;
  call.transposed = transposed;
  call.dtype = dtype_name(op_input.scalar_type());
  call.layout = layout_name(format, op_input.dim());
  call.allow_tf32 = allow_tf32;
  call.deterministic = deterministic;
  return call;
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
  std::shared_ptr<Selector> selector = active_selector();
  if (!selector || !eligible({&input, &weight}) || !record_describes(*selector, input.device().index()))
    return native();
  c10::cuda::CUDAGuard guard(input.device());
  const at::MemoryFormat format = at::native::cudnn_conv_suggest_memory_format(input, weight);
  Tensor x = input.contiguous(format), w = weight.contiguous(format);
  Tensor y = at::empty(conv_out_size(x, w, padding, stride, dilation), x.options().memory_format(format));
  if (!eligible({&y})) return native();
  ConvCall call = make_call(x, w, y, padding, stride, dilation, groups, false, format, allow_tf32, deterministic);
  CudnnProblem problem{make_key(call, Pass::forward), x.get_device(), device_tensor(x), device_tensor(w),
                       device_tensor(y)};
  return run_problem(*selector, problem) ? y : native();
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
  std::shared_ptr<Selector> selector = active_selector();
  if (!selector || !eligible({&input, &weight}) || !record_describes(*selector, input.device().index()))
    return native();
  c10::cuda::CUDAGuard guard(input.device());
  const at::MemoryFormat format = at::native::cudnn_conv_suggest_memory_format(input, weight);
  Tensor dy = input.contiguous(format), w = weight.contiguous(format);
  Tensor out = at::empty(conv_transpose_out_size(dy, w, padding, output_padding, stride, dilation, groups),
                         dy.options().memory_format(format));
  if (!eligible({&out})) return native();
  ConvCall call = make_call(dy, w, out, padding, stride, dilation, groups, true, format, allow_tf32, deterministic);
  CudnnProblem problem{make_key(call, Pass::forward), dy.get_device(), device_tensor(out), device_tensor(w),
                       device_tensor(dy)};
  return run_problem(*selector, problem) ? out : native();
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
  std::shared_ptr<Selector> selector = active_selector();
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
  ConvCall call = make_call(x, w, gy, padding, stride, dilation, groups, transposed, format, allow_tf32, deterministic);

  Tensor grad_input, grad_weight, grad_bias;
  if (mask[0]) {
    grad_input = at::empty(x.sizes(), gy.options().memory_format(format));
    // Transposed: the input gradient is the mirror convolution's forward, from gy to grad_input.
    CudnnProblem p{make_key(call, Pass::grad_input), x.get_device(),
                   device_tensor(transposed ? gy : grad_input), device_tensor(w),
                   device_tensor(transposed ? grad_input : gy)};
    if (!run_problem(*selector, p)) return native();
  }
  if (mask[1]) {
    grad_weight = at::empty(w.sizes(), w.options().memory_format(format));
    CudnnProblem p{make_key(call, Pass::grad_weight), x.get_device(), device_tensor(transposed ? gy : x),
                   device_tensor(grad_weight), device_tensor(transposed ? x : gy)};
    if (!run_problem(*selector, p)) return native();
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
