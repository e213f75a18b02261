// The cuDNN Provider: times and runs one convolution problem with cuDNN's legacy API
// (cudnnFind*AlgorithmEx, cudnnConvolutionForward / BackwardData / BackwardFilter). cuDNN 9 keeps
// that API but marks it deprecated; it is used because its perf structs carry exactly what the
// record stores (algorithm, math type, time, workspace bytes) and because Find*Ex takes the
// workspace from the caller, which is what lets a cap bound the profiling memory (the spike of
// pytorch #15872 comes from sizing that workspace for the hungriest algorithm).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cudnn/Handle.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "profile/cudnn_problem.h"

// The legacy convolution API is deprecated in cuDNN 9; using it is the point of this file.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace terra::profile::cuda {

namespace {

void check(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": " + cudnnGetErrorString(status));
}

// cuDNN 9 groups its status codes by thousands (cudnn_graph.h).
RunStatus run_status_of(cudnnStatus_t status) {
  const int code = static_cast<int>(status);
  if (code == CUDNN_STATUS_SUCCESS) return RunStatus::ok;
  if (code == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
      code == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)
    return RunStatus::out_of_memory;
  if ((code >= CUDNN_STATUS_BAD_PARAM && code < CUDNN_STATUS_BAD_PARAM + 1000) ||
      (code >= CUDNN_STATUS_NOT_SUPPORTED && code < CUDNN_STATUS_NOT_SUPPORTED + 1000))
    return RunStatus::not_supported;
  return RunStatus::failed;
}

cudnnDataType_t data_type(const std::string& name) {
  if (name == "float32") return CUDNN_DATA_FLOAT;
  if (name == "float16") return CUDNN_DATA_HALF;
  if (name == "bfloat16") return CUDNN_DATA_BFLOAT16;
  if (name == "float64") return CUDNN_DATA_DOUBLE;
  throw std::runtime_error("cuDNN convolutions do not take " + name);
}

cudnnMathType_t math_type_of(const std::string& mode) {
  if (mode == "tensor_op") return CUDNN_TENSOR_OP_MATH;
  if (mode == "fma") return CUDNN_FMA_MATH;
  return CUDNN_DEFAULT_MATH;
}

std::vector<int> as_ints(const Dims& dims) { return std::vector<int>(dims.begin(), dims.end()); }

bool channels_last(const std::string& layout) { return layout == "nhwc" || layout == "ndhwc"; }

// RAII over cuDNN's create/set/destroy descriptors; a failed set must still destroy.
class TensorDesc {
 public:
  TensorDesc(const DeviceTensor& t, cudnnDataType_t type) {
    check(cudnnCreateTensorDescriptor(&desc_), "cudnnCreateTensorDescriptor");
    std::vector<int> sizes = as_ints(t.sizes), strides = as_ints(t.strides);
    guard(cudnnSetTensorNdDescriptor(desc_, type, static_cast<int>(sizes.size()), sizes.data(), strides.data()),
          "cudnnSetTensorNdDescriptor");
  }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(desc_); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
  cudnnTensorDescriptor_t get() const { return desc_; }

 private:
  void guard(cudnnStatus_t status, const char* what) {
    if (status != CUDNN_STATUS_SUCCESS) cudnnDestroyTensorDescriptor(desc_);
    check(status, what);
  }
  cudnnTensorDescriptor_t desc_ = nullptr;
};

class FilterDesc {
 public:
  FilterDesc(const DeviceTensor& t, cudnnDataType_t type, const std::string& layout) {
    check(cudnnCreateFilterDescriptor(&desc_), "cudnnCreateFilterDescriptor");
    std::vector<int> sizes = as_ints(t.sizes);  // always K, C/groups, spatial; the format says the order in memory
    cudnnStatus_t st = cudnnSetFilterNdDescriptor(desc_, type, channels_last(layout) ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                                  static_cast<int>(sizes.size()), sizes.data());
    if (st != CUDNN_STATUS_SUCCESS) cudnnDestroyFilterDescriptor(desc_);
    check(st, "cudnnSetFilterNdDescriptor");
  }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(desc_); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
  cudnnFilterDescriptor_t get() const { return desc_; }

 private:
  cudnnFilterDescriptor_t desc_ = nullptr;
};

class ConvDesc {
 public:
  explicit ConvDesc(const ConvKey& key) {
    check(cudnnCreateConvolutionDescriptor(&desc_), "cudnnCreateConvolutionDescriptor");
    std::vector<int> pad = as_ints(key.padding), stride = as_ints(key.stride), dil = as_ints(key.dilation);
    cudnnStatus_t st = cudnnSetConvolutionNdDescriptor(desc_, static_cast<int>(pad.size()), pad.data(), stride.data(),
                                                       dil.data(), CUDNN_CROSS_CORRELATION, data_type(key.compute_type));
    if (st == CUDNN_STATUS_SUCCESS) st = cudnnSetConvolutionGroupCount(desc_, static_cast<int>(key.groups));
    if (st == CUDNN_STATUS_SUCCESS) st = cudnnSetConvolutionMathType(desc_, math_type_of(key.math_mode));
    if (st != CUDNN_STATUS_SUCCESS) cudnnDestroyConvolutionDescriptor(desc_);
    check(st, "cudnnSetConvolutionNdDescriptor");
  }
  ~ConvDesc() { cudnnDestroyConvolutionDescriptor(desc_); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
  cudnnConvolutionDescriptor_t get() const { return desc_; }

 private:
  cudnnConvolutionDescriptor_t desc_ = nullptr;
};

// Workspace from PyTorch's caching allocator, so it is accounted like every other allocation and
// returns to the cache afterwards.
struct Workspace {
  c10::DataPtr ptr;
  size_t bytes = 0;
  void* data() const { return ptr.get(); }
};

std::optional<Workspace> try_allocate(size_t bytes) {
  if (bytes == 0) return Workspace{};
  try {
    return Workspace{c10::cuda::CUDACachingAllocator::get()->allocate(bytes), bytes};
  } catch (const c10::OutOfMemoryError&) {
    return std::nullopt;
  }
}

const char* algo_name(Role role, int algo) {
  static const char* fwd[] = {"IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT",
                              "FFT", "FFT_TILING", "WINOGRAD", "WINOGRAD_NONFUSED"};
  static const char* bwd_data[] = {"ALGO_0", "ALGO_1", "FFT", "FFT_TILING", "WINOGRAD", "WINOGRAD_NONFUSED"};
  static const char* bwd_filter[] = {"ALGO_0", "ALGO_1", "FFT", "ALGO_3", "WINOGRAD", "WINOGRAD_NONFUSED", "FFT_TILING"};
  auto pick = [algo](const char* const* names, int count) { return algo >= 0 && algo < count ? names[algo] : "UNKNOWN"; };
  switch (role) {
    case Role::forward: return pick(fwd, 8);
    case Role::backward_data: return pick(bwd_data, 6);
    case Role::backward_filter: return pick(bwd_filter, 7);
  }
  return "UNKNOWN";
}

class CudnnProvider final : public Provider {
 public:
  explicit CudnnProvider(const CudnnProblem& p)
      : p_(p),
        key_(p.call.key),
        type_(data_type(key_.dtype)),
        handle_(at::native::getCudnnHandle()),
        x_(p.x, type_),
        y_(p.y, type_),
        w_(p.w, type_, key_.layout),
        conv_(key_) {
    // The handle is per device and thread; make it work on the stream PyTorch is using.
    check(cudnnSetStream(handle_, at::cuda::getCurrentCUDAStream().stream()), "cudnnSetStream");
  }

  std::vector<AlgoPerf> profile(const ConvKey&, int64_t, WorkspaceCap cap) override {
    size_t bytes = largest_workspace();
    if (cap) bytes = std::min<size_t>(bytes, *cap);
    // Without a cap this is cudnn.benchmark's sizing; halving on failure keeps it from failing
    // outright when the hungriest algorithm does not fit.
    std::optional<Workspace> ws;
    while (!(ws = try_allocate(bytes))) bytes /= 2;
    std::vector<AlgoPerf> out;
    switch (key_.role) {
      case Role::forward: find_forward(*ws, cap, out); break;
      case Role::backward_data: find_backward_data(*ws, cap, out); break;
      case Role::backward_filter: find_backward_filter(*ws, cap, out); break;
    }
    return out;
  }

  RunStatus run(const ConvKey&, int64_t, const AlgoPerf& algo, WorkspaceCap cap) override {
    cudnnStatus_t st = cudnnSetConvolutionMathType(conv_.get(), static_cast<cudnnMathType_t>(algo.math_type));
    if (st != CUDNN_STATUS_SUCCESS) return fail(st, "cudnnSetConvolutionMathType");
    size_t bytes = 0;
    st = workspace_size(algo.algo, bytes);
    if (st != CUDNN_STATUS_SUCCESS) return fail(st, "workspace size");
    if (cap && bytes > *cap) {
      last_error_ = "needs " + std::to_string(bytes) + " bytes of workspace";
      return RunStatus::exceeds_cap;
    }
    std::optional<Workspace> ws = try_allocate(bytes);
    if (!ws) {
      last_error_ = "cannot allocate " + std::to_string(bytes) + " bytes of workspace";
      return RunStatus::out_of_memory;
    }
    st = launch(algo.algo, *ws);
    return st == CUDNN_STATUS_SUCCESS ? RunStatus::ok : fail(st, "convolution");
  }

  std::string last_error() const override { return last_error_; }

 private:
  RunStatus fail(cudnnStatus_t st, const char* what) {
    last_error_ = std::string(what) + ": " + cudnnGetErrorString(st);
    return run_status_of(st);
  }

  cudnnStatus_t workspace_size(int algo, size_t& bytes) const {
    switch (key_.role) {
      case Role::forward:
        return cudnnGetConvolutionForwardWorkspaceSize(handle_, x_.get(), w_.get(), conv_.get(), y_.get(),
                                                       static_cast<cudnnConvolutionFwdAlgo_t>(algo), &bytes);
      case Role::backward_data:
        return cudnnGetConvolutionBackwardDataWorkspaceSize(handle_, w_.get(), y_.get(), conv_.get(), x_.get(),
                                                            static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), &bytes);
      case Role::backward_filter:
        return cudnnGetConvolutionBackwardFilterWorkspaceSize(handle_, x_.get(), y_.get(), conv_.get(), w_.get(),
                                                              static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), &bytes);
    }
    return CUDNN_STATUS_BAD_PARAM;
  }

  // The largest workspace any algorithm of the role asks for, ignoring sizes beyond the device's
  // memory (cuDNN reports absurd sizes for some unsupported combinations).
  size_t largest_workspace() const {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) total_bytes = SIZE_MAX;
    int count = key_.role == Role::forward         ? static_cast<int>(CUDNN_CONVOLUTION_FWD_ALGO_COUNT)
                : key_.role == Role::backward_data ? static_cast<int>(CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT)
                                                   : static_cast<int>(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT);
    size_t largest = 0;
    for (int algo = 0; algo < count; ++algo) {
      size_t bytes = 0;
      if (workspace_size(algo, bytes) == CUDNN_STATUS_SUCCESS && bytes <= total_bytes) largest = std::max(largest, bytes);
    }
    return largest;
  }

  template <typename Perf>
  void collect(const std::vector<Perf>& results, int returned, WorkspaceCap cap, std::vector<AlgoPerf>& out) const {
    for (int i = 0; i < returned; ++i) {
      const Perf& r = results[i];
      if (r.status != CUDNN_STATUS_SUCCESS) continue;  // did not fit the workspace, or failed
      if (key_.deterministic && r.determinism != CUDNN_DETERMINISTIC) continue;
      // float32 with TF32 disallowed: only FMA kernels give the precision the user asked for
      // (PyTorch asserts the same, ASSERT_CORRECT_PRECISION in Conv_v7.cpp).
      if (key_.math_mode == "fma" && r.mathType != CUDNN_FMA_MATH) continue;
      if (cap && r.memory > *cap) continue;
      int algo = static_cast<int>(r.algo);
      out.push_back(AlgoPerf{algo, static_cast<int>(r.mathType), algo_name(key_.role, algo),
                             static_cast<double>(r.time), static_cast<uint64_t>(r.memory)});
    }
  }

  void find_forward(const Workspace& ws, WorkspaceCap cap, std::vector<AlgoPerf>& out) {
    int max_count = 0, returned = 0;
    check(cudnnGetConvolutionForwardAlgorithmMaxCount(handle_, &max_count), "cudnnGetConvolutionForwardAlgorithmMaxCount");
    std::vector<cudnnConvolutionFwdAlgoPerf_t> results(max_count);
    check(cudnnFindConvolutionForwardAlgorithmEx(handle_, x_.get(), p_.x.data, w_.get(), p_.w.data, conv_.get(),
                                                 y_.get(), p_.y.data, max_count, &returned, results.data(),
                                                 ws.data(), ws.bytes),
          "cudnnFindConvolutionForwardAlgorithmEx");
    collect(results, returned, cap, out);
  }

  void find_backward_data(const Workspace& ws, WorkspaceCap cap, std::vector<AlgoPerf>& out) {
    int max_count = 0, returned = 0;
    check(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle_, &max_count),
          "cudnnGetConvolutionBackwardDataAlgorithmMaxCount");
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> results(max_count);
    check(cudnnFindConvolutionBackwardDataAlgorithmEx(handle_, w_.get(), p_.w.data, y_.get(), p_.y.data, conv_.get(),
                                                      x_.get(), p_.x.data, max_count, &returned, results.data(),
                                                      ws.data(), ws.bytes),
          "cudnnFindConvolutionBackwardDataAlgorithmEx");
    collect(results, returned, cap, out);
  }

  void find_backward_filter(const Workspace& ws, WorkspaceCap cap, std::vector<AlgoPerf>& out) {
    int max_count = 0, returned = 0;
    check(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle_, &max_count),
          "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount");
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> results(max_count);
    check(cudnnFindConvolutionBackwardFilterAlgorithmEx(handle_, x_.get(), p_.x.data, y_.get(), p_.y.data, conv_.get(),
                                                        w_.get(), p_.w.data, max_count, &returned, results.data(),
                                                        ws.data(), ws.bytes),
          "cudnnFindConvolutionBackwardFilterAlgorithmEx");
    collect(results, returned, cap, out);
  }

  cudnnStatus_t launch(int algo, const Workspace& ws) {
    // Scaling factors are double for double data and float otherwise (cuDNN's rule).
    const double one_d = 1.0, zero_d = 0.0;
    const float one_f = 1.0f, zero_f = 0.0f;
    const bool dbl = type_ == CUDNN_DATA_DOUBLE;
    const void* one = dbl ? static_cast<const void*>(&one_d) : static_cast<const void*>(&one_f);
    const void* zero = dbl ? static_cast<const void*>(&zero_d) : static_cast<const void*>(&zero_f);
    switch (key_.role) {
      case Role::forward:
        return cudnnConvolutionForward(handle_, one, x_.get(), p_.x.data, w_.get(), p_.w.data, conv_.get(),
                                       static_cast<cudnnConvolutionFwdAlgo_t>(algo), ws.data(), ws.bytes, zero,
                                       y_.get(), p_.y.data);
      case Role::backward_data:
        return cudnnConvolutionBackwardData(handle_, one, w_.get(), p_.w.data, y_.get(), p_.y.data, conv_.get(),
                                            static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), ws.data(), ws.bytes,
                                            zero, x_.get(), p_.x.data);
      case Role::backward_filter:
        return cudnnConvolutionBackwardFilter(handle_, one, x_.get(), p_.x.data, y_.get(), p_.y.data, conv_.get(),
                                              static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), ws.data(), ws.bytes,
                                              zero, w_.get(), p_.w.data);
    }
    return CUDNN_STATUS_BAD_PARAM;
  }

  const CudnnProblem& p_;
  const ConvKey& key_;
  cudnnDataType_t type_;
  cudnnHandle_t handle_;
  TensorDesc x_;
  TensorDesc y_;
  FilterDesc w_;
  ConvDesc conv_;
  std::string last_error_;
};

}  // namespace

Outcome run_cudnn(Selector& selector, const CudnnProblem& problem) {
  try {
    CudnnProvider provider(problem);
    return selector.run(problem.call.key, problem.call.batch, provider);
  } catch (const std::exception& e) {  // descriptor setup failed: PyTorch's own path takes over
    Outcome outcome;
    outcome.error = e.what();
    return outcome;
  }
}

}  // namespace terra::profile::cuda
