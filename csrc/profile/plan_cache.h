// Execution plans already built, per thread, by PlanKey. This is what makes a steady-state call
// cheap: a hash of a POD key, one lookup, and the plan runs (issue 17 measured ~0.24 ms of host
// work per call when every call re-created descriptors and formatted a string key).
//
// Why per thread and not shared: cuDNN plans are finalized against a cuDNN handle and PyTorch's
// handles are per thread and device (aten/src/ATen/cudnn/Handle.cpp), which is also why PyTorch's
// own plan cache is thread-local (BenchmarkCache in Conv_v8.cpp). Forward runs on the Python
// thread and backward on autograd's device thread: each builds its plans once. No lock is taken.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "profile/entry.h"
#include "profile/plan_key.h"
#include "profile/provider.h"

namespace terra::profile {

// Where the configuration that ran was found.
enum class Source { plan_cache, record, profiled, heuristics, reprofiled };
std::string_view source_name(Source source);

struct CachedPlan {
  std::shared_ptr<const Plan> plan;
  std::shared_ptr<const EngineConfig> config;
  Source source = Source::record;  // how it was chosen when it was built
};

class PlanCache {
 public:
  // PyTorch bounds its plan cache too (TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT, 10000 plans of roughly
  // 200 KiB). Varying shapes would otherwise grow it without end; when full it starts over,
  // which costs one plan build per problem still in use, never a profile (the record keeps those).
  explicit PlanCache(size_t max_plans = 10000) : max_plans_(max_plans) {}

  // Plans are only valid for the selector (and reload) they were chosen under; a cache bound to
  // another one forgets everything. Two integer compares on every call.
  void bind(uint64_t selector_id, uint64_t epoch) {
    if (selector_id == selector_id_ && epoch == epoch_) return;
    plans_.clear();
    selector_id_ = selector_id;
    epoch_ = epoch;
  }

  const CachedPlan* find(const PlanKey& key) const {
    auto it = plans_.find(key);
    return it == plans_.end() ? nullptr : &it->second;
  }
  void put(const PlanKey& key, CachedPlan plan) {
    if (plans_.size() >= max_plans_ && !plans_.count(key)) plans_.clear();
    plans_[key] = std::move(plan);
  }
  void erase(const PlanKey& key) { plans_.erase(key); }
  void clear() { plans_.clear(); }
  size_t size() const { return plans_.size(); }

 private:
  size_t max_plans_;
  uint64_t selector_id_ = 0;
  uint64_t epoch_ = 0;
  std::unordered_map<PlanKey, CachedPlan, PlanKeyHash> plans_;
};

// The calling thread's cache.
PlanCache& thread_plan_cache();

}  // namespace terra::profile
