// Scripted provider for tests; see fake_provider.h.
#include "profile/fake_provider.h"

namespace terra::profile {

namespace {

EngineConfig config_of(const FakeAlgo& a, double time_ms, uint64_t workspace) {
  EngineConfig c;
  c.engine = a.engine;
  c.knobs = a.knobs;
  c.tag = a.name.empty() ? default_tag(a.engine, a.knobs) : a.name;
  c.time_ms = time_ms;
  c.workspace_bytes = workspace;
  return c;
}

}  // namespace

FakeProvider::FakeProvider(std::vector<FakeAlgo> default_script)
    : default_script_(default_script.empty() ? default_fake_script() : std::move(default_script)) {}

void FakeProvider::script(const std::string& key_id, std::vector<FakeAlgo> algos) {
  scripts_[key_id] = std::move(algos);
}

void FakeProvider::set_run_status(int64_t engine, RunStatus status) {
  for (FakeAlgo& a : default_script_)
    if (a.engine == engine) a.run_status = status;
  for (auto& [id, algos] : scripts_)
    for (FakeAlgo& a : algos)
      if (a.engine == engine) a.run_status = status;
}

const std::vector<FakeAlgo>& FakeProvider::algos_for(const std::string& key_id) const {
  auto it = scripts_.find(key_id);
  return it == scripts_.end() ? default_script_ : it->second;
}

const FakeAlgo* FakeProvider::find(const std::string& key_id, int64_t engine) const {
  for (const FakeAlgo& a : algos_for(key_id))
    if (a.engine == engine) return &a;
  return nullptr;
}

std::vector<EngineConfig> FakeProvider::profile(const ConvKey& key, int64_t batch, WorkspaceCap cap) {
  ++profile_calls_;
  profiled_keys_.push_back(key.id());
  std::vector<EngineConfig> out;
  for (const FakeAlgo& a : algos_for(key.id())) {
    uint64_t workspace = a.workspace_per_sample * static_cast<uint64_t>(batch);
    bool unsupported = a.unsupported_from_batch > 0 && batch >= a.unsupported_from_batch;
    // Like the cuDNN provider: what does not fit the workspace cap, or fails, is not in the result.
    if (!a.in_profile || (cap && workspace > *cap) || unsupported || a.run_status != RunStatus::ok) continue;
    out.push_back(config_of(a, a.time_ms_per_sample * static_cast<double>(batch), workspace));
  }
  return out;
}

std::vector<EngineConfig> FakeProvider::heuristics(const ConvKey& key, int64_t batch, WorkspaceCap) {
  ++heuristics_calls_;
  std::vector<EngineConfig> out;
  for (const FakeAlgo& a : algos_for(key.id()))
    if (a.in_heuristics) out.push_back(config_of(a, 0.0, a.workspace_per_sample * static_cast<uint64_t>(batch)));
  return out;
}

Built FakeProvider::build(const ConvKey& key, int64_t batch, const EngineConfig& config, WorkspaceCap cap) {
  ++build_calls_;
  built_.push_back(config.engine);
  const std::string id = key.id();
  const FakeAlgo* a = find(id, config.engine);
  if (!a || a->knobs != config.knobs) {
    last_error_ = "fake provider has no engine " + std::to_string(config.engine) + " with these knobs";
    return {RunStatus::not_supported, nullptr};
  }
  if (a->unsupported_from_batch > 0 && batch >= a->unsupported_from_batch) {
    last_error_ = "fake engine " + std::to_string(a->engine) + " does not support batch " + std::to_string(batch);
    return {RunStatus::not_supported, nullptr};
  }
  uint64_t workspace = a->workspace_per_sample * static_cast<uint64_t>(batch);
  if (cap && workspace > *cap) {
    last_error_ = "fake engine " + std::to_string(a->engine) + " needs " + std::to_string(workspace) + " bytes";
    return {RunStatus::exceeds_cap, nullptr};
  }
  return {RunStatus::ok, std::make_shared<FakePlan>(a->engine, id, batch, workspace)};
}

RunStatus FakeProvider::execute(const Plan& plan) {
  ++execute_calls_;
  const auto* fake = dynamic_cast<const FakePlan*>(&plan);
  if (!fake) {
    last_error_ = "not a plan of the fake provider";
    return RunStatus::failed;
  }
  attempted_.push_back(fake->engine);
  const FakeAlgo* a = find(fake->key_id, fake->engine);
  RunStatus status = a ? a->run_status : RunStatus::not_supported;
  if (status == RunStatus::ok) {
    ++successful_runs_;
    return status;
  }
  last_error_ = "fake engine " + std::to_string(fake->engine) + ": " + std::string(run_status_name(status));
  return status;
}

std::vector<FakeAlgo> default_fake_script() {
  auto algo = [](int64_t engine, const char* name, double time, uint64_t workspace) {
    FakeAlgo a;
    a.engine = engine, a.name = name, a.time_ms_per_sample = time, a.workspace_per_sample = workspace;
    return a;
  };
  return {algo(0, "IMPLICIT_GEMM", 3.0, 0), algo(1, "IMPLICIT_PRECOMP_GEMM", 2.0, 1 << 10), algo(4, "FFT", 1.0, 1 << 20)};
}

}  // namespace terra::profile
