// Canonical naming and validation of ConvKey; see conv_key.h for why the key looks as it does.
#include "profile/conv_key.h"

#include <sstream>

namespace terra::profile {

namespace {

void append_dims(std::ostringstream& out, const char* label, const Dims& dims) {
  out << ' ' << label << '=';
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? "," : "") << dims[i];
}

bool all_at_least(const Dims& dims, int64_t minimum) {
  for (int64_t d : dims)
    if (d < minimum) return false;
  return true;
}

}  // namespace

std::string_view role_name(Role role) {
  switch (role) {
    case Role::forward: return "forward";
    case Role::backward_data: return "backward_data";
    case Role::backward_filter: return "backward_filter";
  }
  return "forward";
}

std::optional<Role> parse_role(std::string_view name) {
  for (Role r : {Role::forward, Role::backward_data, Role::backward_filter})
    if (role_name(r) == name) return r;
  return std::nullopt;
}

std::string ConvKey::id() const {
  std::ostringstream out;
  out << role_name(role);
  append_dims(out, "x", input);
  append_dims(out, "w", filter);
  append_dims(out, "y", output);
  append_dims(out, "pad", padding);
  append_dims(out, "stride", stride);
  append_dims(out, "dil", dilation);
  out << " groups=" << groups << ' ' << dtype << '/' << compute_type << ' ' << layout << ' '
      << math_mode << ' ' << (deterministic ? "deterministic" : "nondeterministic");
  return out.str();
}

std::string ConvKey::invalid_reason() const {
  if (input.size() < 2) return "input needs channels and at least one spatial dimension";
  const size_t spatial = input.size() - 1;
  if (output.size() != input.size()) return "input and output ranks differ";
  if (filter.size() != input.size() + 1) return "filter rank must be input rank + 1";
  if (padding.size() != spatial || stride.size() != spatial || dilation.size() != spatial)
    return "padding, stride and dilation need one value per spatial dimension";
  if (!all_at_least(input, 1) || !all_at_least(output, 1) || !all_at_least(filter, 1))
    return "shapes must be positive";
  if (!all_at_least(padding, 0) || !all_at_least(stride, 1) || !all_at_least(dilation, 1))
    return "padding must be >= 0, stride and dilation >= 1";
  if (groups < 1 || input[0] % groups != 0 || filter[0] % groups != 0 ||
      filter[1] * groups != input[0])
    return "channels do not match groups";
  if (output[0] != filter[0]) return "output channels differ from the filter's";
  if (dtype.empty() || compute_type.empty() || layout.empty() || math_mode.empty())
    return "dtype, compute_type, layout and math_mode must be named";
  return {};
}

}  // namespace terra::profile
