// Version strings of torch ("2.13.0+cpu", "2.14.0a0+git1234") as comparable numbers.
// Why torch-free: the extension checks at import that the torch it runs with is the one
// it was compiled against (C++ ABI), and the check deserves a GoogleTest of its own.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace terra {

struct Version {
  int major = 0;
  int minor = 0;
  int patch = 0;
  auto operator<=>(const Version&) const = default;
  std::string str() const;
};

// Parses "MAJOR.MINOR[.PATCH][anything]"; nullopt when MAJOR.MINOR is not there.
std::optional<Version> parse_version(std::string_view text);

// Same major and minor: the condition for a compiled extension to be ABI compatible.
bool same_minor_release(const Version& a, const Version& b);

}  // namespace terra
