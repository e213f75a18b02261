// The identity of one convolution in the profile record: everything that decides which cuDNN
// algorithm is valid and fastest, *except the batch size*. Seed 001 (section 3.1) found that the
// batch size barely changes the choice, and PyTorch's own key (ConvolutionParams) includes it,
// which is why cudnn.benchmark re-profiles every new batch size (pytorch #4392, #88410).
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace terra::profile {

// The three cuDNN problems a convolution needs; transposed convolutions are mapped onto these
// (see conv_call.h), so a transposed layer and its mirror-image convolution share entries.
enum class Role { forward, backward_data, backward_filter };

std::string_view role_name(Role role);
std::optional<Role> parse_role(std::string_view name);

using Dims = std::vector<int64_t>;

struct ConvKey {
  Role role = Role::forward;
  Dims input;   // x without the batch dimension: channels, spatial...
  Dims filter;  // w: out channels, in channels / groups, spatial...
  Dims output;  // y without the batch dimension
  Dims padding;
  Dims stride;
  Dims dilation;
  int64_t groups = 1;
  std::string dtype = "float32";         // storage type of x, w and y
  std::string compute_type = "float32";  // accumulation type (float32 for float16/bfloat16)
  std::string layout = "nchw";           // "nchw" (contiguous) or "nhwc" (channels_last)
  std::string math_mode = "default";     // "default", "tensor_op" or "fma" (TF32 disallowed)
  bool deterministic = false;

  auto operator<=>(const ConvKey&) const = default;

  // One canonical line naming the key; the map key in memory and the sort order of the file.
  std::string id() const;

  // Empty when the key is self-consistent; otherwise why not (a record file is untrusted input).
  std::string invalid_reason() const;
};

}  // namespace terra::profile
