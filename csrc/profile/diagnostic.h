// A message for the user, returned instead of printed: the C++ core has no logger, and the Python
// front turns warnings into `warnings.warn` and the rest into the "terra_torch.profile" logger.
// Problems with a record file are always reported this way and never thrown: a bad cache must
// cost a re-profile, not a crashed training job.
#pragma once

#include <string>
#include <vector>

namespace terra::profile {

struct Diagnostic {
  enum class Level { debug, info, warning };
  Level level = Level::info;
  std::string message;
};

using Diagnostics = std::vector<Diagnostic>;

inline Diagnostic debug(std::string message) { return {Diagnostic::Level::debug, std::move(message)}; }
inline Diagnostic info(std::string message) { return {Diagnostic::Level::info, std::move(message)}; }
inline Diagnostic warning(std::string message) {
  return {Diagnostic::Level::warning, std::move(message)};
}

}  // namespace terra::profile
