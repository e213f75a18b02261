// A scripted Provider for tests without a GPU. Each algorithm has a time and a workspace per
// sample (both scale linearly with the batch, as cuDNN workspaces roughly do), a run status, and
// optionally a batch size from which it stops being supported: the situations the selection policy
// must survive. Counters say how often it was asked to profile and to run.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "profile/provider.h"

namespace terra::profile {

struct FakeAlgo {
  int algo = 0;
  std::string name;
  double time_ms_per_sample = 1.0;
  uint64_t workspace_per_sample = 0;
  RunStatus run_status = RunStatus::ok;  // what running it returns (when it fits the cap)
  int64_t unsupported_from_batch = 0;    // > 0: not_supported at this batch size and above
};

class FakeProvider : public Provider {
 public:
  explicit FakeProvider(std::vector<FakeAlgo> default_script = {});

  // Algorithms for one key (by ConvKey::id()); other keys use the default script.
  void script(const std::string& key_id, std::vector<FakeAlgo> algos);
  // Changes the run status of one algorithm in every script (e.g. a driver update broke it).
  void set_run_status(int algo, RunStatus status);

  std::vector<AlgoPerf> profile(const ConvKey& key, int64_t batch, WorkspaceCap cap) override;
  RunStatus run(const ConvKey& key, int64_t batch, const AlgoPerf& algo, WorkspaceCap cap) override;
  std::string last_error() const override { return last_error_; }

  int profile_calls() const { return profile_calls_; }
  int run_calls() const { return run_calls_; }
  int successful_runs() const { return successful_runs_; }
  const std::vector<int>& attempted_algos() const { return attempted_; }  // every run, in order
  std::vector<std::string> profiled_keys() const { return profiled_keys_; }

 private:
  const std::vector<FakeAlgo>& algos_for(const ConvKey& key) const;

  std::vector<FakeAlgo> default_script_;
  std::map<std::string, std::vector<FakeAlgo>> scripts_;
  int profile_calls_ = 0;
  int run_calls_ = 0;
  int successful_runs_ = 0;
  std::vector<int> attempted_;
  std::vector<std::string> profiled_keys_;
  std::string last_error_;
};

// Three algorithms shaped like cuDNN's forward set: a slow one without workspace (implicit GEMM),
// a fast one with a large workspace (FFT-like) and one in between.
std::vector<FakeAlgo> default_fake_script();

}  // namespace terra::profile
