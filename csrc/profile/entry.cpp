// Ranking rules of record entries; see entry.h.
#include "profile/entry.h"

#include <algorithm>
#include <tuple>

namespace terra::profile {

void rank(std::vector<AlgoPerf>& algorithms) {
  std::stable_sort(algorithms.begin(), algorithms.end(), [](const AlgoPerf& a, const AlgoPerf& b) {
    return std::tie(a.time_ms, a.workspace_bytes, a.algo, a.math_type) <
           std::tie(b.time_ms, b.workspace_bytes, b.algo, b.math_type);
  });
  std::vector<AlgoPerf> unique;
  for (const AlgoPerf& perf : algorithms) {
    bool seen = std::any_of(unique.begin(), unique.end(),
                            [&](const AlgoPerf& u) { return u.same_algorithm(perf); });
    if (!seen) unique.push_back(perf);
  }
  algorithms = std::move(unique);
}

std::optional<AlgoPerf> least_memory(const std::vector<AlgoPerf>& algorithms) {
  if (algorithms.empty()) return std::nullopt;
  return *std::min_element(algorithms.begin(), algorithms.end(),
                           [](const AlgoPerf& a, const AlgoPerf& b) {
                             return std::tie(a.workspace_bytes, a.time_ms, a.algo, a.math_type) <
                                    std::tie(b.workspace_bytes, b.time_ms, b.algo, b.math_type);
                           });
}

std::optional<Entry> make_entry(ConvKey key, int64_t batch, std::vector<AlgoPerf> algorithms) {
  rank(algorithms);
  auto smallest = least_memory(algorithms);
  if (!smallest) return std::nullopt;
  Entry entry;
  entry.key = std::move(key);
  entry.profiled_batch = batch;
  entry.algorithms = std::move(algorithms);
  entry.least_memory = *smallest;
  return entry;
}

}  // namespace terra::profile
