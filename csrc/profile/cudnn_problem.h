// One cuDNN convolution problem handed from the ATen kernels (cuda/conv_kernels.cpp) to the cuDNN
// provider (cuda/cudnn_provider.cpp) as raw device pointers, shapes and strides. Torch-free on
// purpose: the two CUDA files share no torch-typed interface, and the provider is testable in
// isolation on a GPU machine.
#pragma once

#include <cstdint>

#include "profile/conv_call.h"
#include "profile/selector.h"

namespace terra::profile::cuda {

struct DeviceTensor {
  void* data = nullptr;
  Dims sizes;    // batch included
  Dims strides;  // in elements
};

// Tensors in cuDNN's roles for key.role: x is the convolution's input, w its filter, y its output.
// forward writes y; backward_data reads y (dy) and w and writes x (dx); backward_filter reads x and
// y (dy) and writes w (dw). The written tensor must be allocated, its contents are overwritten.
struct CudnnProblem {
  KeyedCall call;
  int device = 0;
  DeviceTensor x;
  DeviceTensor w;
  DeviceTensor y;
};

// Picks the algorithm through `selector` (record, else profile) and runs the problem on the
// current CUDA stream. On !ok nothing usable was written; the caller falls back to PyTorch.
Outcome run_cudnn(Selector& selector, const CudnnProblem& problem);

}  // namespace terra::profile::cuda
