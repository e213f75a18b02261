// One cuDNN convolution problem handed from the ATen kernels (cuda/conv_kernels.cpp) to the cuDNN
// graph-API provider (cuda/cudnn_graph_provider.cpp) as raw device pointers, shapes and strides.
// Torch-free on purpose: the two CUDA files share no torch-typed interface. The arrays point into
// the tensors' own size and stride storage, so handing a problem over copies and allocates nothing.
#pragma once

#include <cstdint>

#include "profile/plan_key.h"
#include "profile/selector.h"

namespace terra::profile::cuda {

struct DeviceTensor {
  void* data = nullptr;
  int dim = 0;                     // spatial + 2
  const int64_t* sizes = nullptr;  // batch first
  const int64_t* strides = nullptr;  // in elements (the provider recomputes those of size-1 dims)
};

// Tensors in cuDNN's roles for the key's role: x is the convolution's input, w its filter, y its
// output. forward writes y; backward_data reads y (dy) and w and writes x (dx); backward_filter
// reads x and y (dy) and writes w (dw). The written tensor must be allocated; it is overwritten.
struct CudnnProblem {
  PlanKey key;  // built by the kernel from the same tensors (make_plan_key)
  DeviceTensor x;
  DeviceTensor w;
  DeviceTensor y;
};

// Runs the problem on the current CUDA stream through `selector` (plan cache, record, profile;
// conv_runner.h). On !ok nothing usable was written and the caller falls back to PyTorch.
Outcome run_cudnn(Selector& selector, const CudnnProblem& problem);

}  // namespace terra::profile::cuda
