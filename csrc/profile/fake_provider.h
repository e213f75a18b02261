// A scripted Provider for tests without a GPU. Each engine has a time and a workspace per
// sample (both scale linearly with the batch, as cuDNN workspaces roughly do), a run status, and
// optionally a batch size from which it stops being supported: the situations the selection policy
// must survive. Counters say how often it was asked to profile, build plans and execute them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "profile/provider.h"

namespace terra::profile {

struct FakeAlgo {
  int64_t engine = 0;
  std::string name;
  double time_ms_per_sample = 1.0;
  uint64_t workspace_per_sample = 0;
  RunStatus run_status = RunStatus::ok;  // what executing its plan returns
  int64_t unsupported_from_batch = 0;    // > 0: no plan builds at this batch size and above
  bool in_heuristics = true;             // listed by heuristics()
  bool in_profile = true;                // timed by profile() (cuDNN times only a bounded list)
  std::vector<Knob> knobs;
};

// What FakeProvider builds: enough to check that a cached plan is the one for its problem.
class FakePlan final : public Plan {
 public:
  FakePlan(int64_t engine, std::string key_id, int64_t batch, uint64_t workspace)
      : engine(engine), key_id(std::move(key_id)), batch(batch), workspace(workspace) {}
  uint64_t workspace_bytes() const override { return workspace; }
  const int64_t engine;
  const std::string key_id;
  const int64_t batch;
  const uint64_t workspace;
};

class FakeProvider : public Provider {
 public:
  explicit FakeProvider(std::vector<FakeAlgo> default_script = {});

  // Engines for one key (by ConvKey::id()); other keys use the default script.
  void script(const std::string& key_id, std::vector<FakeAlgo> algos);
  // Changes the run status of one engine in every script (e.g. a driver update broke it).
  void set_run_status(int64_t engine, RunStatus status);

  std::vector<EngineConfig> profile(const ConvKey& key, int64_t batch, WorkspaceCap cap) override;
  std::vector<EngineConfig> heuristics(const ConvKey& key, int64_t batch, WorkspaceCap cap) override;
  Built build(const ConvKey& key, int64_t batch, const EngineConfig& config, WorkspaceCap cap) override;
  RunStatus execute(const Plan& plan) override;
  std::string last_error() const override { return last_error_; }

  int profile_calls() const { return profile_calls_; }
  int heuristics_calls() const { return heuristics_calls_; }
  int build_calls() const { return build_calls_; }
  int execute_calls() const { return execute_calls_; }
  int successful_runs() const { return successful_runs_; }
  // Every execute, in order: the engine of the plan it ran (or tried to).
  const std::vector<int64_t>& attempted() const { return attempted_; }
  // Every build, in order.
  const std::vector<int64_t>& built() const { return built_; }
  std::vector<std::string> profiled_keys() const { return profiled_keys_; }

 private:
  const std::vector<FakeAlgo>& algos_for(const std::string& key_id) const;
  const FakeAlgo* find(const std::string& key_id, int64_t engine) const;

  std::vector<FakeAlgo> default_script_;
  std::map<std::string, std::vector<FakeAlgo>> scripts_;
  int profile_calls_ = 0;
  int heuristics_calls_ = 0;
  int build_calls_ = 0;
  int execute_calls_ = 0;
  int successful_runs_ = 0;
  std::vector<int64_t> attempted_;
  std::vector<int64_t> built_;
  std::vector<std::string> profiled_keys_;
  std::string last_error_;
};

// Three engines shaped like cuDNN's forward set: a slow one without workspace (implicit GEMM),
// a fast one with a large workspace (FFT-like) and one in between.
std::vector<FakeAlgo> default_fake_script();

}  // namespace terra::profile
