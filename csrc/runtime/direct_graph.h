// Why this exists: a Dynamo backend hands terra static graphs (docs/DYNAMO_BACKEND.md, mode
// "graph"). Every call of such a graph feeds the same slots and reads the same fetches, so the
// channel and the GraphRunner's worker of co-execution only add hand-overs and copies; running
// the generated graph directly, with feeds as inputs and fetches as outputs, avoids both. The
// opt-in overlap mode needs the same graphs run later instead of now, which is what the deferred
// worker here is for (docs/DYNAMO_BACKEND.md, "Overlap"; docs/RUNTIME.md).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/executor.h"

namespace terra::runtime {

class FusedExecutor;

// A generated graph of one straight-line trace, rewritten so that its feeds are graph inputs
// and its fetches graph outputs, and run on the calling thread. Outputs leave by reference, so
// views and shared memory survive, where a fetch would publish a copy.
class DirectGraph {
 public:
  // `into_buffers`: fetches become copies into extra inputs (one buffer per fetch slot, after
  // the feeds) instead of outputs, so that a deferred run can write values Python already holds.
  // `fused`: run through a FusedExecutor (runtime/fused_executor.h) instead of the TorchScript
  // interpreter: with feeds and fetches lifted, a graph is one straight-line stretch, so it is
  // cut into as few segments as its random ops and aliases allow; `mode` is then unused.
  DirectGraph(const std::shared_ptr<torch::jit::Graph>& generated, TorchScriptMode mode, bool into_buffers,
              bool fused = false);
  ~DirectGraph();

  bool into_buffers() const { return into_buffers_; }
  // The FusedExecutor of a `fused` graph, for its compiler; else null.
  const std::shared_ptr<FusedExecutor>& fused() const { return fused_; }
  const std::vector<int64_t>& feed_slots() const { return feed_slots_; }
  const std::vector<int64_t>& fetch_slots() const { return fetch_slots_; }
  std::string text() const;

  // One value per feed slot (in feed_slots order; None for a feed_or_none slot that takes the
  // graph's own none), one result per fetch slot (fetch_slots order). Releases the GIL while
  // the graph runs, if the caller holds it.
  std::vector<std::optional<at::Tensor>> run(const std::vector<std::optional<at::Tensor>>& inputs);

  // For the deferred worker, which has no GIL and has converted the inputs (feeds, then buffers).
  void run_stack(std::vector<c10::IValue> stack);

 private:
  void lift_channel_ops();

  bool into_buffers_ = false;
  std::shared_ptr<torch::jit::Graph> graph_;
  std::shared_ptr<Executor> executor_;
  std::shared_ptr<FusedExecutor> fused_;  // executor_, when fused
  std::vector<int64_t> feed_slots_;
  std::vector<int64_t> fetch_slots_;
};

// ---- deferred runs (overlap mode) ----
// One process-wide worker runs launched graphs in launch order; the first op of any Python
// thread waits until every launched run has finished. The GIL must be held by the callers.

// Allocates the output buffers (shaped like `like`, one per fetch slot) and queues the run of
// a graph made with into_buffers; returns the buffers at once, filled when the run ends.
std::vector<at::Tensor> launch_direct(const std::shared_ptr<DirectGraph>& graph,
                                      const std::vector<std::optional<at::Tensor>>& inputs,
                                      const std::vector<at::Tensor>& like);
// Waits for every launched run; rethrows the first error since the last wait (once).
void wait_direct();
// A launched run failed and wait_direct has not rethrown it yet.
bool direct_failed();
// A launched run is in flight, or failed and wait_direct has not rethrown it yet.
bool direct_pending();

}  // namespace terra::runtime
