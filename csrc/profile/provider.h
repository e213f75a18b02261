// What the selection policy needs from a convolution backend, and nothing more: time the
// algorithms of one problem under a workspace cap, and run one chosen algorithm. The cuDNN
// implementation (cuda/cudnn_provider.cpp) is created per convolution call around its tensors;
// FakeProvider scripts the same behaviour for tests on machines without a GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "profile/conv_key.h"
#include "profile/entry.h"

namespace terra::profile {

enum class RunStatus {
  ok,
  not_supported,   // the algorithm cannot run this problem (e.g. at this batch size)
  out_of_memory,   // its workspace could not be allocated
  exceeds_cap,     // its workspace at this batch size is above the user's cap; not tried
  failed,          // any other backend error
};

std::string_view run_status_name(RunStatus status);

// No cap means "as much as the backend can get"; that is what cudnn.benchmark does, and what
// causes its start-up memory spike (pytorch #15872, seed 001 section 2.3).
using WorkspaceCap = std::optional<uint64_t>;

class Provider {
 public:
  virtual ~Provider() = default;

  // Times every algorithm that fits under the cap at this batch size. Algorithms that need more
  // workspace than the cap, or fail, are left out. May throw on backend errors.
  virtual std::vector<AlgoPerf> profile(const ConvKey& key, int64_t batch, WorkspaceCap cap) = 0;

  // Runs the convolution with `algo`; must not throw for the statuses above.
  virtual RunStatus run(const ConvKey& key, int64_t batch, const AlgoPerf& algo, WorkspaceCap cap) = 0;

  // Detail of the last failed run, for messages.
  virtual std::string last_error() const { return {}; }
};

}  // namespace terra::profile
