// What the selection policy needs from a convolution backend, and nothing more. Shaped after
// cuDNN's graph API, where a kernel is an engine configuration and running it takes an
// *execution plan* finalized for one exact problem (PyTorch: aten/src/ATen/native/cudnn/Conv_v8.cpp):
//   profile     time the candidate configurations under a workspace cap (a cache miss only);
//   heuristics  the backend's own untimed ranking, the fallback when no recorded one builds;
//   build       finalize a plan for one configuration at this exact problem (once per PlanKey);
//   execute     run a built plan on this call's tensors (every call: nothing else is asked).
// The cuDNN implementation (cuda/cudnn_graph_provider.cpp) is created per convolution call around
// its tensors and holds only pointers until asked; FakeProvider scripts the same behaviour for
// tests on machines without a GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "profile/conv_key.h"
#include "profile/entry.h"

namespace terra::profile {

enum class RunStatus {
  ok,
  not_supported,   // the configuration cannot run this problem (e.g. at this batch size)
  out_of_memory,   // its workspace could not be allocated
  exceeds_cap,     // its workspace at this batch size is above the user's cap; not tried
  failed,          // any other backend error
};

std::string_view run_status_name(RunStatus status);

// No cap means "as much as the backend can get"; that is what cudnn.benchmark does, and what
// causes its start-up memory spike (pytorch #15872, seed 001 section 2.3).
using WorkspaceCap = std::optional<uint64_t>;

// A finalized execution plan, opaque to the policy. Plans are cached per thread (plan_cache.h):
// cuDNN plans belong to the handle they were built with, and PyTorch's handles are per thread.
class Plan {
 public:
  virtual ~Plan() = default;
  virtual uint64_t workspace_bytes() const = 0;
};

struct Built {
  RunStatus status = RunStatus::failed;
  std::shared_ptr<const Plan> plan;  // set when status == ok
};

class Provider {
 public:
  virtual ~Provider() = default;

  // Times candidate configurations at this batch size. Those needing more workspace than the cap,
  // or failing, are left out. May throw on backend errors.
  virtual std::vector<EngineConfig> profile(const ConvKey& key, int64_t batch, WorkspaceCap cap) = 0;

  // The backend's heuristic choices, best first, untimed (time_ms 0). May be empty.
  virtual std::vector<EngineConfig> heuristics(const ConvKey& key, int64_t batch, WorkspaceCap cap) = 0;

  // A plan for `config` at this problem; exceeds_cap when its workspace is above the cap. Must
  // not throw for the statuses above.
  virtual Built build(const ConvKey& key, int64_t batch, const EngineConfig& config, WorkspaceCap cap) = 0;

  // Runs `plan` (built by this kind of provider for this problem) on the call's tensors.
  virtual RunStatus execute(const Plan& plan) = 0;

  // Detail of the last failure, for messages.
  virtual std::string last_error() const { return {}; }
};

}  // namespace terra::profile
