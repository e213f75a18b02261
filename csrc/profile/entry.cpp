// Ranking rules of record entries; see entry.h.
#include "profile/entry.h"

#include <algorithm>
#include <tuple>

namespace terra::profile {

std::string default_tag(int64_t engine, const std::vector<Knob>& knobs) {
  std::string tag = "eng" + std::to_string(engine);
  for (const Knob& k : knobs) tag += "_k" + std::to_string(k.type) + "=" + std::to_string(k.value);
  return tag;
}

void rank(std::vector<EngineConfig>& configs) {
  for (EngineConfig& c : configs) std::sort(c.knobs.begin(), c.knobs.end());
  std::stable_sort(configs.begin(), configs.end(), [](const EngineConfig& a, const EngineConfig& b) {
    return std::tie(a.time_ms, a.workspace_bytes, a.engine, a.knobs) <
           std::tie(b.time_ms, b.workspace_bytes, b.engine, b.knobs);
  });
  std::vector<EngineConfig> unique;
  for (EngineConfig& c : configs) {
    bool seen = std::any_of(unique.begin(), unique.end(), [&](const EngineConfig& u) { return u.same_config(c); });
    if (!seen) unique.push_back(std::move(c));
  }
  configs = std::move(unique);
}

std::optional<EngineConfig> least_memory(const std::vector<EngineConfig>& configs) {
  if (configs.empty()) return std::nullopt;
  return *std::min_element(configs.begin(), configs.end(), [](const EngineConfig& a, const EngineConfig& b) {
    return std::tie(a.workspace_bytes, a.time_ms, a.engine, a.knobs) <
           std::tie(b.workspace_bytes, b.time_ms, b.engine, b.knobs);
  });
}

std::optional<Entry> make_entry(ConvKey key, int64_t batch, std::vector<EngineConfig> configs) {
  rank(configs);
  auto smallest = least_memory(configs);
  if (!smallest) return std::nullopt;
  Entry entry;
  entry.key = std::move(key);
  entry.profiled_batch = batch;
  entry.configs = std::move(configs);
  entry.least_memory = std::move(*smallest);
  return entry;
}

}  // namespace terra::profile
