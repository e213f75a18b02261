// The switches that turn one mechanism off for an A/B comparison in one build: TERRA_<NAME>=0
// (TERRA_EARLY_BATCHES, TERRA_KNOWN_VALUES, TERRA_STAGED_CLAIMS, TERRA_CPP_META,
// TERRA_CLOSE_WAITS, TERRA_CODE_ON_WORKER; the benchmarks run the variants in interleaved
// processes), and the checks turned on with TERRA_<NAME>=1 (TERRA_LINT_GRAPHS: the test
// suite's). Read once by each caller, into a static.
#pragma once

#include <cstdlib>
#include <cstring>

namespace terra::common {

// Whether environment variable `name` is set to "0" (unset or any other value: on).
inline bool switched_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}

// Whether environment variable `name` is set to "1" (a check that is off unless asked for).
inline bool switched_on(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace terra::common
