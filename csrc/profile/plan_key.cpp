// Building, hashing and converting plan keys; see plan_key.h.
#include "profile/plan_key.h"

#include <array>
#include <limits>

namespace terra::profile {

namespace {

constexpr std::array<std::string_view, 4> kDTypes{"float32", "float16", "bfloat16", "float64"};
constexpr std::array<std::string_view, 4> kLayouts{"nchw", "nhwc", "ncdhw", "ndhwc"};
constexpr std::array<std::string_view, 3> kMathModes{"default", "tensor_op", "fma"};

template <typename E, size_t N>
std::optional<E> parse(const std::array<std::string_view, N>& names, std::string_view name) {
  for (size_t i = 0; i < N; ++i)
    if (names[i] == name) return static_cast<E>(i);
  return std::nullopt;
}

bool fits_int32(int64_t v) {
  return v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max();
}

DType compute_dtype_of(DType t) {
  // As PyTorch's descriptors: half and bfloat16 accumulate in float (conv_call.h).
  return t == DType::float16 || t == DType::bfloat16 ? DType::float32 : t;
}

}  // namespace

std::optional<DType> parse_dtype(std::string_view name) { return parse<DType>(kDTypes, name); }
std::optional<Layout> parse_layout(std::string_view name) { return parse<Layout>(kLayouts, name); }
std::optional<MathMode> parse_math_mode(std::string_view name) { return parse<MathMode>(kMathModes, name); }
std::string_view dtype_name(DType type) { return kDTypes[static_cast<size_t>(type)]; }
std::string_view layout_name(Layout layout) { return kLayouts[static_cast<size_t>(layout)]; }
std::string_view math_mode_name(MathMode mode) { return kMathModes[static_cast<size_t>(mode)]; }

MathMode math_mode_for(DType type, bool allow_tf32) {
  if (type == DType::float16) return MathMode::tensor_op;
  if (type == DType::float32 && !allow_tf32) return MathMode::fma;
  return MathMode::default_math;
}

Layout layout_for(bool channels_last, int spatial) {
  if (spatial == 3) return channels_last ? Layout::ndhwc : Layout::ncdhw;
  return channels_last ? Layout::nhwc : Layout::nchw;
}

uint8_t byte_alignment(const void* pointer) {
  auto address = reinterpret_cast<uintptr_t>(pointer);
  uint8_t align = 16;
  while (align > 1 && address % align != 0) align /= 2;
  return align;
}

uint64_t PlanKey::hash() const {
  // 8-byte words with a multiply-xorshift mix: ~25 multiplications for the whole key, fast enough
  // to run on every convolution call, and every byte (no padding, see the static_assert) counts.
  static_assert(sizeof(PlanKey) % sizeof(uint64_t) == 0);
  uint64_t words[sizeof(PlanKey) / sizeof(uint64_t)];
  std::memcpy(words, this, sizeof(PlanKey));
  uint64_t h = 0x243F6A8885A308D3ull;
  for (uint64_t w : words) {
    h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  }
  return h;
}

std::optional<PlanKey> make_plan_key(const ProblemDims& d) {
  if (d.spatial < 1 || d.spatial > kMaxSpatial || !fits_int32(d.groups) || d.device < 0 ||
      d.device > std::numeric_limits<int16_t>::max())
    return std::nullopt;
  PlanKey k;
  k.role = static_cast<uint8_t>(d.role);
  k.spatial = static_cast<uint8_t>(d.spatial);
  k.dtype = static_cast<uint8_t>(d.dtype);
  k.compute_dtype = static_cast<uint8_t>(compute_dtype_of(d.dtype));
  k.layout = static_cast<uint8_t>(d.layout);
  k.math_mode = static_cast<uint8_t>(d.math_mode);
  k.deterministic = d.deterministic ? 1 : 0;
  k.align_x = d.align_x, k.align_w = d.align_w, k.align_y = d.align_y;
  k.device = static_cast<int16_t>(d.device);
  k.groups = static_cast<int32_t>(d.groups);
  k.batch = d.x[0];
  for (int i = 0; i < d.spatial; ++i) {
    if (!fits_int32(d.padding[i]) || !fits_int32(d.stride[i]) || !fits_int32(d.dilation[i])) return std::nullopt;
    k.padding[i] = static_cast<int32_t>(d.padding[i]);
    k.stride[i] = static_cast<int32_t>(d.stride[i]);
    k.dilation[i] = static_cast<int32_t>(d.dilation[i]);
  }
  for (int i = 0; i < d.spatial + 1; ++i) {
    k.x[i] = d.x[i + 1];
    k.y[i] = d.y[i + 1];
  }
  for (int i = 0; i < d.spatial + 2; ++i) k.w[i] = d.w[i];
  return k;
}

std::optional<PlanKey> make_plan_key(const ConvKey& key, int64_t batch, int device, uint8_t align) {
  auto dtype = parse_dtype(key.dtype);
  auto layout = parse_layout(key.layout);
  auto math = parse_math_mode(key.math_mode);
  if (!dtype || !layout || !math || key.compute_type != dtype_name(compute_dtype_of(*dtype)) ||
      !key.invalid_reason().empty())
    return std::nullopt;
  const int spatial = static_cast<int>(key.input.size()) - 1;
  if (spatial < 1 || spatial > kMaxSpatial) return std::nullopt;
  int64_t x[kMaxSpatial + 2], y[kMaxSpatial + 2];
  x[0] = y[0] = batch;
  for (int i = 0; i <= spatial; ++i) x[i + 1] = key.input[i], y[i + 1] = key.output[i];
  ProblemDims d;
  d.role = key.role;
  d.spatial = spatial;
  d.x = x, d.y = y, d.w = key.filter.data();
  d.padding = key.padding.data(), d.stride = key.stride.data(), d.dilation = key.dilation.data();
  d.groups = key.groups;
  d.dtype = *dtype, d.layout = *layout, d.math_mode = *math;
  d.deterministic = key.deterministic;
  d.device = device;
  d.align_x = d.align_w = d.align_y = align;
  return make_plan_key(d);
}

ConvKey record_key(const PlanKey& k) {
  ConvKey key;
  key.role = static_cast<Role>(k.role);
  const int s = k.spatial;
  key.input.assign(k.x, k.x + s + 1);
  key.output.assign(k.y, k.y + s + 1);
  key.filter.assign(k.w, k.w + s + 2);
  key.padding.assign(k.padding, k.padding + s);
  key.stride.assign(k.stride, k.stride + s);
  key.dilation.assign(k.dilation, k.dilation + s);
  key.groups = k.groups;
  key.dtype = std::string(dtype_name(static_cast<DType>(k.dtype)));
  key.compute_type = std::string(dtype_name(static_cast<DType>(k.compute_dtype)));
  key.layout = std::string(layout_name(static_cast<Layout>(k.layout)));
  key.math_mode = std::string(math_mode_name(static_cast<MathMode>(k.math_mode)));
  key.deterministic = k.deterministic != 0;
  return key;
}

}  // namespace terra::profile
