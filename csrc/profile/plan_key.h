// The key of an execution plan: one exact cuDNN problem as a call presents it. Unlike ConvKey
// (the record's key, batch-free, strings and vectors), it holds the batch size and the byte
// alignment of the three data pointers, because a cuDNN graph-API plan is finalized for exact
// shapes and alignments (PyTorch's plan cache key, ConvolutionParams in
// aten/src/ATen/native/cudnn/ConvShared.h, has both as well). It is plain old data with no padding
// bytes, so a call builds it on the stack from the tensors' sizes, hashes it word by word and
// compares it bytewise: no allocation and no string on the hot path.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string_view>
#include <type_traits>

#include "profile/conv_call.h"
#include "profile/conv_key.h"

namespace terra::profile {

inline constexpr int kMaxSpatial = 3;  // 2-d and 3-d convolutions (1-d ones run as 2-d)

enum class DType : uint8_t { float32, float16, bfloat16, float64 };
enum class Layout : uint8_t { nchw, nhwc, ncdhw, ndhwc };
enum class MathMode : uint8_t { default_math, tensor_op, fma };

std::optional<DType> parse_dtype(std::string_view name);
std::optional<Layout> parse_layout(std::string_view name);
std::optional<MathMode> parse_math_mode(std::string_view name);
std::string_view dtype_name(DType type);
std::string_view layout_name(Layout layout);
std::string_view math_mode_name(MathMode mode);
// The math mode and layout PyTorch's descriptors use (conv_call.h: default_math_mode; ATen's
// cudnn_conv_suggest_memory_format), as the kernels see them.
MathMode math_mode_for(DType type, bool allow_tf32);
Layout layout_for(bool channels_last, int spatial);
// Largest power of two, at most 16 (cuDNN's widest vector access), that divides the address.
uint8_t byte_alignment(const void* pointer);

struct PlanKey {
  uint8_t role = 0;  // Role
  uint8_t spatial = 0;
  uint8_t dtype = 0;
  uint8_t compute_dtype = 0;
  uint8_t layout = 0;
  uint8_t math_mode = 0;
  uint8_t deterministic = 0;
  uint8_t align_x = 16, align_w = 16, align_y = 16;
  int16_t device = 0;
  int32_t groups = 1;
  int32_t padding[kMaxSpatial] = {};
  int32_t stride[kMaxSpatial] = {};
  int32_t dilation[kMaxSpatial] = {};
  int32_t reserved = 0;  // keeps the size a multiple of 8 without a padding byte
  int64_t batch = 0;
  int64_t x[kMaxSpatial + 1] = {};  // channels, spatial (no batch); unused dimensions 0
  int64_t w[kMaxSpatial + 2] = {};
  int64_t y[kMaxSpatial + 1] = {};

  bool operator==(const PlanKey& other) const { return std::memcmp(this, &other, sizeof(PlanKey)) == 0; }
  uint64_t hash() const;
};
static_assert(std::has_unique_object_representations_v<PlanKey>,
              "PlanKey must have no padding: it is hashed and compared as bytes");

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const { return static_cast<size_t>(key.hash()); }
};

// The sizes and attributes of one cuDNN problem as the kernels see them: raw arrays, batch first,
// in cuDNN's roles (x the convolution's input, w its filter, y its output).
struct ProblemDims {
  Role role = Role::forward;
  int spatial = 2;
  const int64_t* x = nullptr;  // spatial + 2 values each
  const int64_t* w = nullptr;
  const int64_t* y = nullptr;
  const int64_t* padding = nullptr;  // spatial values each
  const int64_t* stride = nullptr;
  const int64_t* dilation = nullptr;
  int64_t groups = 1;
  DType dtype = DType::float32;
  Layout layout = Layout::nchw;
  MathMode math_mode = MathMode::default_math;
  bool deterministic = false;
  int device = 0;
  uint8_t align_x = 16, align_w = 16, align_y = 16;
};

// nullopt when the problem does not fit a PlanKey (rank, a value beyond int32 where cuDNN takes
// int32); such calls are left to PyTorch.
std::optional<PlanKey> make_plan_key(const ProblemDims& dims);

// From a record key and batch (the fake path, tests): the same PlanKey the kernels would build.
std::optional<PlanKey> make_plan_key(const ConvKey& key, int64_t batch, int device = 0, uint8_t align = 16);

// The record key of a plan key: what a cache miss looks up in the record. Only misses pay for
// its strings and vectors.
ConvKey record_key(const PlanKey& key);

}  // namespace terra::profile
