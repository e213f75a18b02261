#include "common/version.h"

#include <cctype>

namespace terra {

namespace {
// Reads the digits at text[pos...]; advances pos. nullopt when there are none.
std::optional<int> read_number(std::string_view text, size_t& pos) {
  size_t start = pos;
  int value = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) {
    value = value * 10 + (text[pos] - '0');
    ++pos;
  }
  if (pos == start) return std::nullopt;
  return value;
}
}  // namespace

std::optional<Version> parse_version(std::string_view text) {
  size_t pos = 0;
  Version v;
  auto major = read_number(text, pos);
  if (!major || pos >= text.size() || text[pos] != '.') return std::nullopt;
  ++pos;
  auto minor = read_number(text, pos);
  if (!minor) return std::nullopt;
  v.major = *major;
  v.minor = *minor;
  if (pos < text.size() && text[pos] == '.') {
    ++pos;
    if (auto patch = read_number(text, pos)) v.patch = *patch;
  }
  return v;
}

bool same_minor_release(const Version& a, const Version& b) {
  return a.major == b.major && a.minor == b.minor;
}

std::string Version::str() const {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

}  // namespace terra
