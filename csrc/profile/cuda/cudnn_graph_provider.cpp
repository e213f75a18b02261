// The cuDNN Provider on the graph (v8 backend) API: the operation graphs PyTorch builds for its
// own convolutions (aten/src/ATen/native/cudnn/Conv_v8.cpp), the same candidate engine
// configurations and filters, timed under a workspace cap, and executed as cached plans.
//
// Read from PyTorch's approach, written against cuDNN's backend C API directly (cudnn_graph.h,
// shipped by the cuDNN wheel the CUDA torch depends on), not cudnn-frontend: the record needs a
// configuration as plain integers (engine global index, knob choices) and back, which the backend
// API exposes as attributes; it adds no dependency and no large header to a TU that torch's
// headers already make slow (docs/PROFILE_RECORD.md, "Graph-API provider").
//
//   graph       one convolution operation (forward, backward-data or backward-filter) over the
//               call's real shapes; strides recomputed for the layout (PyTorch's
//               fixSizeOneDimStride: a size-1 dimension's stride is arbitrary in torch, not in
//               cuDNN), the pointers' byte alignment, float compute for half and bfloat16.
//   candidates  heuristic mode A, then the fallback list (mode FALLBACK), without duplicates, less
//               those PyTorch filters out: DOWN_CONVERT_INPUTS always; TENSOR_CORE for float32
//               without TF32 (math mode "fma"); NONDETERMINISTIC when determinism is asked for.
//   profile     builds every candidate's plan, keeps those whose workspace fits
//               min(user cap, largest free block of the caching allocator), allocates the largest
//               (halving on OOM, as PyTorch), and times up to torch.backends.cudnn.benchmark_limit
//               plans with CUDA events: one warm-up, then the median of kTimedRuns.
//   execute     workspace from PyTorch's caching allocator, a variant pack, cudnnBackendExecute.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cudnn/Handle.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "profile/conv_runner.h"
#include "profile/cuda/backend_descriptor.h"
#include "profile/cudnn_problem.h"

// The graph and plan handle attributes are marked deprecated in recent cuDNN 9 headers but are
// still required by the releases torch ships with (9.x); setting them is deliberate.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace terra::profile::cuda {

namespace {

constexpr int64_t kUidX = 'x', kUidY = 'y', kUidW = 'w';  // PyTorch's uids, for familiarity
constexpr int kTimedRuns = 5;

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

cudnnDataType_t data_type(DType type) {
  switch (type) {
    case DType::float32: return CUDNN_DATA_FLOAT;
    case DType::float16: return CUDNN_DATA_HALF;
    case DType::bfloat16: return CUDNN_DATA_BFLOAT16;
    case DType::float64: return CUDNN_DATA_DOUBLE;
  }
  return CUDNN_DATA_FLOAT;
}

bool channels_last(const PlanKey& key) {
  auto layout = static_cast<Layout>(key.layout);
  return layout == Layout::nhwc || layout == Layout::ndhwc;
}

// Dense strides of a tensor in its layout: NC(D)HW, or channels innermost then the spatial
// dimensions then the batch.
std::vector<int64_t> dense_strides(const DeviceTensor& t, bool last) {
  const int n = t.dim;
  std::vector<int64_t> order;  // dimensions from innermost to outermost
  if (last) {
    order.push_back(1);
    for (int d = n - 1; d >= 2; --d) order.push_back(d);
    order.push_back(0);
  } else {
    for (int d = n - 1; d >= 0; --d) order.push_back(d);
  }
  std::vector<int64_t> strides(static_cast<size_t>(n));
  int64_t step = 1;
  for (int64_t d : order) {
    strides[static_cast<size_t>(d)] = step;
    step *= std::max<int64_t>(t.sizes[d], 1);
  }
  return strides;
}

Descriptor tensor_desc(const DeviceTensor& t, int64_t uid, uint8_t align, cudnnDataType_t type, bool last) {
  std::vector<int64_t> sizes(t.sizes, t.sizes + t.dim);
  std::vector<int64_t> strides = dense_strides(t, last);
  int64_t alignment = align;
  Descriptor d(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  d.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, type, "tensor data type")
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, sizes.data(), t.dim, "tensor dimensions")
      .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), t.dim, "tensor strides")
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, uid, "tensor uid")
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, alignment, "tensor alignment")
      .finalize("tensor descriptor");
  return d;
}

Descriptor conv_desc(const PlanKey& key) {
  const int64_t spatial = key.spatial;
  std::vector<int64_t> pad(key.padding, key.padding + spatial), stride(key.stride, key.stride + spatial),
      dilation(key.dilation, key.dilation + spatial);
  const cudnnDataType_t compute = data_type(static_cast<DType>(key.compute_dtype));
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  Descriptor d(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  d.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, compute, "convolution compute type")
      .set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, mode, "convolution mode")
      .set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, spatial, "convolution spatial dims")
      .set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, dilation.data(), spatial, "convolution dilations")
      .set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, stride.data(), spatial, "convolution strides")
      .set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, pad.data(), spatial, "convolution pre-padding")
      .set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, pad.data(), spatial, "convolution post-padding")
      .finalize("convolution descriptor");
  return d;
}

// One finalized operation graph and everything it refers to, kept alive as long as a plan built
// on it (cuDNN descriptors do not own what they point to).
struct Graph {
  Descriptor x, y, w, conv, op, graph;
};

std::shared_ptr<const Graph> build_graph(cudnnHandle_t handle, const CudnnProblem& p) {
  const PlanKey& k = p.key;
  const cudnnDataType_t type = data_type(static_cast<DType>(k.dtype));
  const bool last = channels_last(k);
  auto g = std::make_shared<Graph>();
  g->x = tensor_desc(p.x, kUidX, k.align_x, type, last);
  g->y = tensor_desc(p.y, kUidY, k.align_y, type, last);
  g->w = tensor_desc(p.w, kUidW, k.align_w, type, last);
  g->conv = conv_desc(k);
  // Scaling factors: double for double compute, float otherwise (cuDNN's rule).
  const bool dbl = static_cast<DType>(k.compute_dtype) == DType::float64;
  const double alpha_d = 1.0, beta_d = 0.0;
  const float alpha_f = 1.0f, beta_f = 0.0f;
  const cudnnBackendAttributeType_t scale_type = dbl ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT;
  const void* alpha = dbl ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = dbl ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
  switch (static_cast<Role>(k.role)) {
    case Role::forward:
      g->op = Descriptor(CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR);
      g->op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, g->x, "forward x")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, g->w, "forward w")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, g->y, "forward y")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, g->conv, "forward conv")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, scale_type, alpha, 1, "forward alpha")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, scale_type, beta, 1, "forward beta");
      break;
    case Role::backward_data:
      g->op = Descriptor(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR);
      g->op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, g->x, "backward-data dx")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, g->w, "backward-data w")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, g->y, "backward-data dy")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, g->conv, "backward-data conv")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, scale_type, alpha, 1, "backward-data alpha")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA, scale_type, beta, 1, "backward-data beta");
      break;
    case Role::backward_filter:
      g->op = Descriptor(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR);
      g->op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, g->x, "backward-filter x")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, g->w, "backward-filter dw")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, g->y, "backward-filter dy")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, g->conv, "backward-filter conv")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, scale_type, alpha, 1, "backward-filter alpha")
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, scale_type, beta, 1, "backward-filter beta");
      break;
  }
  g->op.finalize("convolution operation");
  cudnnBackendDescriptor_t ops[] = {g->op.get()};
  g->graph = Descriptor(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  g->graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle, "graph handle")
      .set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops, 1, "graph ops")
      .finalize("operation graph");
  return g;
}

const char* note_name(cudnnBackendNumericalNote_t note) {
  switch (static_cast<int>(note)) {
    case 0: return "TENSOR_CORE";
    case 1: return "DOWN_CONVERT_INPUTS";
    case 2: return "REDUCED_PRECISION_REDUCTION";
    case 3: return "FFT";
    case 4: return "NONDETERMINISTIC";
    case 5: return "WINOGRAD";
    case 6: return "WINOGRAD_TILE_4x4";
    case 7: return "WINOGRAD_TILE_6x6";
    case 8: return "WINOGRAD_TILE_13x13";
    case 9: return "STRICT_NAN_PROP";
  }
  return "UNKNOWN";
}

bool has_note(const EngineConfig& c, const char* name) {
  return std::find(c.numerical_notes.begin(), c.numerical_notes.end(), name) != c.numerical_notes.end();
}

// PyTorch's filterEngineConfigs (Conv_v8.cpp), in the record key's terms.
bool accepted(const EngineConfig& c, const PlanKey& key) {
  if (has_note(c, "DOWN_CONVERT_INPUTS")) return false;
  if (key.deterministic && has_note(c, "NONDETERMINISTIC")) return false;
  if (static_cast<MathMode>(key.math_mode) == MathMode::fma && has_note(c, "TENSOR_CORE")) return false;
  return true;
}

// Engine index, knobs and notes of one engine configuration cuDNN returned.
EngineConfig describe(const Descriptor& cfg) {
  EngineConfig out;
  std::vector<Descriptor> engine =
      get_descriptors(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_BACKEND_ENGINE_DESCRIPTOR, 1, "engine of a config");
  if (engine.empty()) throw CudnnError(CUDNN_STATUS_BAD_PARAM, "engine config without an engine");
  out.engine = engine[0].get_scalar<int64_t>(CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, "engine index");
  for (cudnnBackendNumericalNote_t note : engine[0].get_array<cudnnBackendNumericalNote_t>(
           CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE, CUDNN_NUMERICAL_NOTE_TYPE_COUNT, "engine notes"))
    out.numerical_notes.push_back(note_name(note));
  const int64_t knob_count =
      element_count(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, "knob count");
  for (const Descriptor& choice : get_descriptors(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
                                                  CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, knob_count, "knob choices")) {
    Knob k;
    k.type = static_cast<int64_t>(
        choice.get_scalar<cudnnBackendKnobType_t>(CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, "knob type"));
    k.value = choice.get_scalar<int64_t>(CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, "knob value");
    out.knobs.push_back(k);
  }
  std::sort(out.knobs.begin(), out.knobs.end());
  out.tag = default_tag(out.engine, out.knobs);
  return out;
}

std::vector<EngineConfig> heuristic_configs(const Graph& g, cudnnBackendHeurMode_t mode) {
  Descriptor heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, g.graph, "heuristics graph")
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, mode, "heuristics mode")
      .finalize("engine heuristics");
  const int64_t count = element_count(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, "heuristic count");
  std::vector<EngineConfig> out;
  for (const Descriptor& cfg :
       get_descriptors(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, count, "heuristic results")) {
    try {
      out.push_back(describe(cfg));
    } catch (const CudnnError&) {
      // A result cuDNN cannot describe cannot be recorded either; the others still count.
    }
  }
  return out;
}

// A finalized execution plan with the descriptors it was built from.
class CudnnPlan final : public Plan {
 public:
  uint64_t workspace_bytes() const override { return workspace; }
  std::shared_ptr<const Graph> graph;
  Descriptor engine;
  std::vector<Descriptor> knobs;
  Descriptor config;
  Descriptor plan;
  uint64_t workspace = 0;
};

struct BuiltPlan {
  cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
  std::shared_ptr<CudnnPlan> plan;
  std::string error;
};

BuiltPlan build_plan(cudnnHandle_t handle, const std::shared_ptr<const Graph>& graph, const EngineConfig& c) {
  BuiltPlan out;
  auto plan = std::make_shared<CudnnPlan>();
  plan->graph = graph;
  try {
    plan->engine = Descriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    plan->engine.set(CUDNN_ATTR_ENGINE_OPERATION_GRAPH, graph->graph, "engine graph")
        .set(CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, c.engine, "engine index");
    if ((out.status = plan->engine.try_finalize()) != CUDNN_STATUS_SUCCESS) {
      out.error = "engine " + std::to_string(c.engine) + " does not take this problem";
      return out;
    }
    std::vector<cudnnBackendDescriptor_t> raw;
    for (const Knob& k : c.knobs) {
      Descriptor choice(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR);
      const auto type = static_cast<cudnnBackendKnobType_t>(k.type);
      choice.set(CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, type, "knob type")
          .set(CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, k.value, "knob value")
          .finalize("knob choice");
      raw.push_back(choice.get());
      plan->knobs.push_back(std::move(choice));
    }
    plan->config = Descriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    plan->config.set(CUDNN_ATTR_ENGINECFG_ENGINE, plan->engine, "config engine");
    if (!raw.empty())
      plan->config.set(CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, raw.data(),
                       static_cast<int64_t>(raw.size()), "config knobs");
    if ((out.status = plan->config.try_finalize()) != CUDNN_STATUS_SUCCESS) {
      out.error = c.tag + ": knob choices rejected";
      return out;
    }
    plan->plan = Descriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    plan->plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle, "plan handle")
        .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, plan->config, "plan config");
    if ((out.status = plan->plan.try_finalize()) != CUDNN_STATUS_SUCCESS) {
      out.error = c.tag + ": no execution plan for this problem";
      return out;
    }
    plan->workspace = static_cast<uint64_t>(std::max<int64_t>(
        0, plan->plan.get_scalar<int64_t>(CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, "plan workspace")));
  } catch (const CudnnError& e) {
    out.status = e.status;
    out.error = e.what();
    return out;
  }
  out.plan = std::move(plan);
  return out;
}

// What one execute needs besides the plan: the variant pack binding the call's pointers.
Descriptor variant_pack(const CudnnProblem& p, void* workspace) {
  void* pointers[] = {p.x.data, p.y.data, p.w.data};
  const int64_t uids[] = {kUidX, kUidY, kUidW};
  Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids, 3, "variant pack uids")
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, pointers, 3, "variant pack pointers")
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, workspace, "variant pack workspace")
      .finalize("variant pack");
  return pack;
}

std::optional<c10::DataPtr> try_allocate(size_t bytes) {
  try {
    return c10::cuda::CUDACachingAllocator::get()->allocate(bytes);
  } catch (const c10::OutOfMemoryError&) {
    (void)cudaGetLastError();  // as PyTorch: clear the CUDA error an OOM may leave
    return std::nullopt;
  }
}

// The largest block the caching allocator can hand out now (PyTorch's get_available_workspace;
// with nothing cached it guesses from cudaMemGetInfo).
uint64_t largest_free_block(int device) {
  size_t largest = 0;
  c10::cuda::CUDACachingAllocator::cacheInfo(static_cast<c10::DeviceIndex>(device), &largest);
  return largest;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (static_cast<double>(v[n / 2 - 1]) + v[n / 2]);
}

class CudaEvent {
 public:
  CudaEvent() {
    if (cudaEventCreate(&event_) != cudaSuccess) throw std::runtime_error("cudaEventCreate failed");
  }
  ~CudaEvent() { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class CudnnGraphProvider final : public Provider {
 public:
  explicit CudnnGraphProvider(const CudnnProblem& p) : p_(p), handle_(at::native::getCudnnHandle()) {}

  std::vector<EngineConfig> heuristics(const ConvKey&, int64_t, WorkspaceCap) override { return candidates(); }

  std::vector<EngineConfig> profile(const ConvKey&, int64_t, WorkspaceCap cap) override {
    const std::shared_ptr<const Graph>& g = graph();
    // Timings must not overlap with the caller's queued work, and must not be taken inside a
    // CUDA graph capture (docs/PROFILE_RECORD.md, caveats).
    cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    uint64_t limit = largest_free_block(p_.key.device);
    if (cap) limit = std::min<uint64_t>(limit, *cap);
    std::vector<std::pair<EngineConfig, std::shared_ptr<CudnnPlan>>> plans;
    uint64_t largest = 0;
    for (EngineConfig& c : candidates()) {
      BuiltPlan built = build_plan(handle_, g, c);
      if (!built.plan || built.plan->workspace > limit) continue;
      largest = std::max(largest, built.plan->workspace);
      plans.emplace_back(std::move(c), std::move(built.plan));
    }
    std::optional<c10::DataPtr> workspace;
    while (!(workspace = try_allocate(largest))) largest /= 2;  // 0 bytes always succeeds
    const int benchmark_limit = at::globalContext().benchmarkLimitCuDNN();
    const size_t timed_limit = benchmark_limit > 0 ? static_cast<size_t>(benchmark_limit) : plans.size();
    std::vector<EngineConfig> out;
    CudaEvent start, stop;
    for (auto& [config, plan] : plans) {
      if (out.size() >= timed_limit) break;
      if (plan->workspace > largest) continue;  // dropped by the halving above
      Descriptor pack = variant_pack(p_, workspace->get());
      if (cudnnBackendExecute(handle_, plan->plan.get(), pack.get()) != CUDNN_STATUS_SUCCESS) continue;  // warm-up
      std::vector<float> times;
      for (int run = 0; run < kTimedRuns; ++run) {
        cudaEventRecord(start.get(), stream);
        cudnnStatus_t st = cudnnBackendExecute(handle_, plan->plan.get(), pack.get());
        cudaEventRecord(stop.get(), stream);
        if (st != CUDNN_STATUS_SUCCESS) break;
        float ms = 0;
        if (cudaEventSynchronize(stop.get()) != cudaSuccess || cudaEventElapsedTime(&ms, start.get(), stop.get()) != cudaSuccess)
          break;
        times.push_back(ms);
      }
      if (times.size() != static_cast<size_t>(kTimedRuns)) continue;
      config.time_ms = median(times);
      config.workspace_bytes = plan->workspace;
      prebuilt_[config.tag] = plan;
      out.push_back(config);
    }
    (void)cudaGetLastError();
    return out;
  }

  Built build(const ConvKey&, int64_t, const EngineConfig& config, WorkspaceCap cap) override {
    std::shared_ptr<CudnnPlan> plan;
    if (auto it = prebuilt_.find(config.tag); it != prebuilt_.end() && it->second) plan = it->second;
    if (!plan) {
      BuiltPlan built;
      try {
        built = build_plan(handle_, graph(), config);
      } catch (const std::exception& e) {
        last_error_ = e.what();
        return {RunStatus::failed, nullptr};
      }
      if (!built.plan) {
        last_error_ = built.error;
        return {run_status_of(built.status), nullptr};
      }
      plan = std::move(built.plan);
    }
    if (cap && plan->workspace > *cap) {
      last_error_ = config.tag + " needs " + std::to_string(plan->workspace) + " bytes of workspace";
      return {RunStatus::exceeds_cap, nullptr};
    }
    return {RunStatus::ok, std::move(plan)};
  }

  RunStatus execute(const Plan& generic) override {
    const auto* plan = dynamic_cast<const CudnnPlan*>(&generic);
    if (!plan) {
      last_error_ = "not a cuDNN graph plan";
      return RunStatus::failed;
    }
    std::optional<c10::DataPtr> workspace = try_allocate(plan->workspace);
    if (!workspace) {
      last_error_ = "cannot allocate " + std::to_string(plan->workspace) + " bytes of workspace";
      return RunStatus::out_of_memory;
    }
    try {
      Descriptor pack = variant_pack(p_, plan->workspace ? workspace->get() : nullptr);
      cudnnStatus_t st = cudnnBackendExecute(handle_, plan->plan.get(), pack.get());
      if (st != CUDNN_STATUS_SUCCESS) {
        last_error_ = std::string("cudnnBackendExecute: ") + cudnnGetErrorString(st);
        return run_status_of(st);
      }
    } catch (const CudnnError& e) {
      last_error_ = e.what();
      return run_status_of(e.status);
    }
    return RunStatus::ok;
  }

  std::string last_error() const override { return last_error_; }

 private:
  const std::shared_ptr<const Graph>& graph() {
    if (!graph_) graph_ = build_graph(handle_, p_);
    return graph_;
  }

  // Heuristic mode A, then the fallback list, filtered as PyTorch filters, without repeats.
  std::vector<EngineConfig> candidates() {
    std::vector<EngineConfig> out;
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      std::vector<EngineConfig> found;
      try {
        found = heuristic_configs(*graph(), mode);
      } catch (const CudnnError& e) {
        if (mode == CUDNN_HEUR_MODE_A) throw;  // no heuristics at all: the caller reports it
        continue;                               // no fallback list for this problem
      }
      for (EngineConfig& c : found) {
        if (!accepted(c, p_.key)) continue;
        bool seen = std::any_of(out.begin(), out.end(), [&](const EngineConfig& o) { return o.same_config(c); });
        if (!seen) out.push_back(std::move(c));
      }
    }
    return out;
  }

  const CudnnProblem& p_;
  cudnnHandle_t handle_;
  std::shared_ptr<const Graph> graph_;
  std::map<std::string, std::shared_ptr<CudnnPlan>> prebuilt_;  // by tag: plans profile() built
  std::string last_error_;
};

}  // namespace

Outcome run_cudnn(Selector& selector, const CudnnProblem& problem) {
  CudnnGraphProvider provider(problem);
  return run_convolution(selector, problem.key, provider, thread_plan_cache());
}

}  // namespace terra::profile::cuda
