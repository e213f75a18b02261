// The runtime's time helpers: elapsed nanoseconds for the stall and exec counters, and a wait
// deadline that a "wait forever" (nanoseconds::max()) does not overflow.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace terra::common {

using Clock = std::chrono::steady_clock;

inline int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

inline Clock::time_point deadline_after(std::chrono::nanoseconds max_wait) {
  constexpr auto kCap = std::chrono::hours(24 * 365);
  return Clock::now() + std::min<std::chrono::nanoseconds>(max_wait, kCap);
}

}  // namespace terra::common
