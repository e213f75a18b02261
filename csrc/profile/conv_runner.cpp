// The plan-cached per-call path and its fallback order; see conv_runner.h.
#include "profile/conv_runner.h"

#include <exception>
#include <sstream>

namespace terra::profile {

namespace {

bool already_failed(const Outcome& outcome, const EngineConfig& config) {
  for (const auto& [c, status] : outcome.failed)
    if (c.same_config(config)) return true;
  return false;
}

std::string describe_failures(const Outcome& outcome) {
  std::ostringstream out;
  for (size_t i = 0; i < outcome.failed.size(); ++i)
    out << (i ? ", " : "") << outcome.failed[i].first.tag << ": " << run_status_name(outcome.failed[i].second);
  return out.str();
}

// Builds and runs each configuration not yet failed in this call; the first that runs is cached.
bool try_configs(Selector& selector, const PlanKey& plan_key, const ConvKey& key, Provider& provider,
                 PlanCache& cache, const std::vector<EngineConfig>& configs, Source source, Outcome& outcome) {
  for (const EngineConfig& config : configs) {
    if (already_failed(outcome, config)) continue;
    selector.count_build();
    Built built = provider.build(key, plan_key.batch, config, selector.workspace_cap());
    if (built.status != RunStatus::ok || !built.plan) {
      outcome.failed.emplace_back(config, built.status != RunStatus::ok ? built.status : RunStatus::failed);
      continue;
    }
    RunStatus status = provider.execute(*built.plan);
    if (status != RunStatus::ok) {
      outcome.failed.emplace_back(config, status);
      continue;
    }
    auto shared = std::make_shared<const EngineConfig>(config);
    cache.put(plan_key, CachedPlan{std::move(built.plan), shared, source});
    outcome.ok = true;
    outcome.config = std::move(shared);
    outcome.source = source;
    outcome.fell_back = !outcome.failed.empty();
    if (outcome.fell_back) selector.count_fallback();
    return true;
  }
  return false;
}

}  // namespace

Outcome run_convolution(Selector& selector, const PlanKey& plan_key, Provider& provider, PlanCache& cache) {
  selector.count_call();
  cache.bind(selector.id(), selector.epoch());
  Outcome outcome;

  if (const CachedPlan* hit = cache.find(plan_key)) {
    RunStatus status = provider.execute(*hit->plan);
    if (status == RunStatus::ok) {
      selector.count_plan_hit();
      outcome.ok = true;
      outcome.config = hit->config;
      outcome.source = Source::plan_cache;
      return outcome;
    }
    outcome.failed.emplace_back(*hit->config, status);
    cache.erase(plan_key);
  }

  // Only a miss pays for the record key's strings and vectors.
  const ConvKey key = record_key(plan_key);
  const int64_t batch = plan_key.batch;

  // 1. The record (or a profile now).
  Candidates recorded = selector.candidates(key, batch, provider);
  if (try_configs(selector, plan_key, key, provider, cache, recorded.configs, recorded.source, outcome))
    return outcome;

  // 2. The backend's heuristics.
  std::vector<EngineConfig> heuristic;
  try {
    heuristic = provider.heuristics(key, batch, selector.workspace_cap());
  } catch (const std::exception& e) {
    selector.note(warning(std::string("heuristics failed for ") + key.id() + ": " + e.what()));
  }
  const size_t failed_before = outcome.failed.size();
  if (try_configs(selector, plan_key, key, provider, cache, heuristic, Source::heuristics, outcome)) {
    selector.count_heuristic_run();
    if (failed_before > 0)
      selector.note(info("no recorded configuration of " + key.id() + " runs at batch " + std::to_string(batch) +
                         " (" + describe_failures(outcome) + "); running cuDNN's heuristic choice " +
                         outcome.config->tag));
    return outcome;
  }

  // 3. A record entry that no longer runs here (another batch size, a changed library): profile
  //    it again at this batch. A profile made moments ago in this call is not repeated.
  if (recorded.source == Source::record) {
    Candidates again = selector.reprofile(key, batch, provider, describe_failures(outcome));
    if (try_configs(selector, plan_key, key, provider, cache, again.configs, Source::reprofiled, outcome))
      return outcome;
    if (again.configs.empty()) recorded.error = again.error;
  }

  selector.count_failure();
  outcome.source = recorded.source;
  if (!outcome.failed.empty()) {
    std::string detail = provider.last_error();
    outcome.error = "no engine configuration ran for " + key.id() + " at batch " + std::to_string(batch) + ": " +
                    describe_failures(outcome) + (detail.empty() ? "" : " (last error: " + detail + ")");
    selector.note(warning(outcome.error));
  } else {
    outcome.error = recorded.error.empty() ? "no engine configuration for " + key.id() : recorded.error;
  }
  return outcome;
}

}  // namespace terra::profile
