// From a convolution as the framework calls it (batch included, maybe transposed) to the record's
// key and the batch size. Kept torch-free so that the CUDA kernels and the CPU fake path of
// `python -m terra_torch.warmup --fake-provider` derive exactly the same keys.
#pragma once

#include <cstdint>
#include <string>

#include "profile/conv_key.h"

namespace terra::profile {

// Which derivative of the user-level op is being computed.
enum class Pass { forward, grad_input, grad_weight };

struct ConvCall {
  Dims input;   // the op's input, batch first: N, C, spatial...
  Dims weight;  // as stored by the module (transposed: in channels, out channels / groups, ...)
  Dims output;  // the op's output, batch first
  Dims padding;
  Dims stride;
  Dims dilation;
  int64_t groups = 1;
  bool transposed = false;
  std::string dtype = "float32";
  std::string layout = "nchw";
  bool allow_tf32 = true;
  bool deterministic = false;
};

struct KeyedCall {
  ConvKey key;
  int64_t batch = 0;
};

// A transposed convolution is the data-gradient of the convolution that maps its output back to
// its input (that is how cuDNN runs it), so its forward is a backward_data problem and its
// grad_input a forward problem; input and output trade places, the filter stays as stored.
KeyedCall make_key(const ConvCall& call, Pass pass);

// What PyTorch's cuDNN descriptors use (ATen/cudnn/Descriptors.h, ConvolutionDescriptor::set):
// float16 and bfloat16 accumulate in float32; float16 runs on tensor ops; float32 without TF32
// is restricted to FMA math.
std::string default_compute_type(const std::string& dtype);
std::string default_math_mode(const std::string& dtype, bool allow_tf32);

}  // namespace terra::profile
