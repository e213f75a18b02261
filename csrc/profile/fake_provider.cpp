// Scripted provider for tests; see fake_provider.h.
#include "profile/fake_provider.h"

namespace terra::profile {

FakeProvider::FakeProvider(std::vector<FakeAlgo> default_script)
    : default_script_(default_script.empty() ? default_fake_script() : std::move(default_script)) {}

void FakeProvider::script(const std::string& key_id, std::vector<FakeAlgo> algos) {
  scripts_[key_id] = std::move(algos);
}

void FakeProvider::set_run_status(int algo, RunStatus status) {
  for (FakeAlgo& a : default_script_)
    if (a.algo == algo) a.run_status = status;
  for (auto& [id, algos] : scripts_)
    for (FakeAlgo& a : algos)
      if (a.algo == algo) a.run_status = status;
}

const std::vector<FakeAlgo>& FakeProvider::algos_for(const ConvKey& key) const {
  auto it = scripts_.find(key.id());
  return it == scripts_.end() ? default_script_ : it->second;
}

std::vector<AlgoPerf> FakeProvider::profile(const ConvKey& key, int64_t batch, WorkspaceCap cap) {
  ++profile_calls_;
  profiled_keys_.push_back(key.id());
  std::vector<AlgoPerf> out;
  for (const FakeAlgo& a : algos_for(key)) {
    uint64_t workspace = a.workspace_per_sample * static_cast<uint64_t>(batch);
    bool unsupported = a.unsupported_from_batch > 0 && batch >= a.unsupported_from_batch;
    // Like cudnnFind*Ex: what does not fit the workspace, or fails, is not in the result.
    if ((cap && workspace > *cap) || unsupported || a.run_status != RunStatus::ok) continue;
    out.push_back(AlgoPerf{a.algo, 0, a.name, a.time_ms_per_sample * static_cast<double>(batch), workspace});
  }
  return out;
}

RunStatus FakeProvider::run(const ConvKey& key, int64_t batch, const AlgoPerf& algo, WorkspaceCap cap) {
  ++run_calls_;
  attempted_.push_back(algo.algo);
  for (const FakeAlgo& a : algos_for(key)) {
    if (a.algo != algo.algo) continue;
    uint64_t workspace = a.workspace_per_sample * static_cast<uint64_t>(batch);
    RunStatus status = a.run_status;
    if (status == RunStatus::ok && a.unsupported_from_batch > 0 && batch >= a.unsupported_from_batch)
      status = RunStatus::not_supported;
    if (status == RunStatus::ok && cap && workspace > *cap) status = RunStatus::exceeds_cap;
    if (status == RunStatus::ok) {
      ++successful_runs_;
      return status;
    }
    last_error_ = "fake algorithm " + std::to_string(a.algo) + ": " + std::string(run_status_name(status));
    return status;
  }
  last_error_ = "fake provider has no algorithm " + std::to_string(algo.algo);
  return RunStatus::not_supported;
}

std::vector<FakeAlgo> default_fake_script() {
  return {
      FakeAlgo{0, "IMPLICIT_GEMM", 3.0, 0},
      FakeAlgo{1, "IMPLICIT_PRECOMP_GEMM", 2.0, 1 << 10},
      FakeAlgo{4, "FFT", 1.0, 1 << 20},
  };
}

}  // namespace terra::profile
