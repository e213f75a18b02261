// The per-thread plan cache and source names; see plan_cache.h.
#include "profile/plan_cache.h"

namespace terra::profile {

std::string_view source_name(Source source) {
  switch (source) {
    case Source::plan_cache: return "plan_cache";
    case Source::record: return "record";
    case Source::profiled: return "profiled";
    case Source::heuristics: return "heuristics";
    case Source::reprofiled: return "reprofiled";
  }
  return "record";
}

PlanCache& thread_plan_cache() {
  thread_local PlanCache cache;
  return cache;
}

}  // namespace terra::profile
