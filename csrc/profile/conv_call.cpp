// Reduction of a framework convolution call to a record key; see conv_call.h.
#include "profile/conv_call.h"

namespace terra::profile {

namespace {

Dims without_batch(const Dims& dims) {
  return dims.empty() ? Dims{} : Dims(dims.begin() + 1, dims.end());
}

Role role_for(Pass pass, bool transposed) {
  switch (pass) {
    case Pass::forward: return transposed ? Role::backward_data : Role::forward;
    case Pass::grad_input: return transposed ? Role::forward : Role::backward_data;
    case Pass::grad_weight: return Role::backward_filter;
  }
  return Role::forward;
}

}  // namespace

KeyedCall make_key(const ConvCall& call, Pass pass) {
  KeyedCall out;
  ConvKey& key = out.key;
  key.role = role_for(pass, call.transposed);
  // In cuDNN's terms x is the convolution's input; for a transposed op that is the op's output.
  const Dims& x = call.transposed ? call.output : call.input;
  const Dims& y = call.transposed ? call.input : call.output;
  key.input = without_batch(x);
  key.output = without_batch(y);
  key.filter = call.weight;
  key.padding = call.padding;
  key.stride = call.stride;
  key.dilation = call.dilation;
  key.groups = call.groups;
  key.dtype = call.dtype;
  key.compute_type = default_compute_type(call.dtype);
  key.layout = call.layout;
  key.math_mode = default_math_mode(call.dtype, call.allow_tf32);
  key.deterministic = call.deterministic;
  out.batch = call.input.empty() ? 0 : call.input[0];
  return out;
}

std::string default_compute_type(const std::string& dtype) {
  if (dtype == "float16" || dtype == "bfloat16") return "float32";
  return dtype;
}

std::string default_math_mode(const std::string& dtype, bool allow_tf32) {
  if (dtype == "float16") return "tensor_op";
  if (dtype == "float32" && !allow_tf32) return "fma";
  return "default";
}

}  // namespace terra::profile
