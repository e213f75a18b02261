// A private copy of a small dense CPU tensor without the dispatcher: a known value or recipe
// argument (runtime/known_values.cpp) is a few bytes of CPU memory, and clone() through the
// dispatcher cost more than the op whose argument was being copied.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

#include <cstring>
#include <optional>

namespace terra::capture {

// The copy (contiguous, no autograd, not a wrapped number), or nothing when `t` is not dense CPU
// memory that memcpy can copy: the caller clones it then.
inline std::optional<at::Tensor> copy_dense_cpu(const at::Tensor& t) {
  // (A quantized tensor's bytes mean nothing without its quantizer, which empty_cpu does not set.)
  if (!t.is_cpu() || t.layout() != c10::kStrided || t.is_quantized() || !t.has_storage() || !t.is_contiguous() ||
      t.is_conj() || t.is_neg() || t.data_ptr() == nullptr)
    return std::nullopt;
  at::Tensor copy =
      at::detail::empty_cpu(t.sizes(), t.scalar_type(), std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  std::memcpy(copy.data_ptr(), t.data_ptr(), t.nbytes());
  return copy;
}

}  // namespace terra::capture
