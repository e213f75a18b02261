// The rule that ends the tracing phase: a trace is covered when it is a path of the TraceGraph
// at every loop level and every loop that ran the same number of iterations in all collected
// traces runs that number again (such loops are unrolled, so another count has no graph).
#include "trace/trace_graph.h"
#include "trace/walker.h"

namespace terra::trace {
namespace {

class MatchPolicy {
 public:
  explicit MatchPolicy(const TraceGraph& g) : g_(g) {}

  NodeId advance(NodeId at, const MatchKey& key) const { return g_.child(at, key); }
  bool reach_end(NodeId at) const { return g_.child(at, MatchKey::end()) != kNoNode; }
  NodeId body_start(NodeId loop) const { return g_.graph(g_.node(loop).body).start; }
  bool loop_continue(const WalkLevel& level) const {
    const uint32_t fixed = g_.fixed_trip_count(level.loop_node);
    return fixed == 0 || level.trips < fixed;
  }
  bool loop_exit(const WalkLevel& level) const {
    const uint32_t fixed = g_.fixed_trip_count(level.loop_node);
    return fixed == 0 || level.trips == fixed;
  }

 private:
  const TraceGraph& g_;
};

}  // namespace

Coverage TraceGraph::coverage(const Trace& trace) const {
  MatchPolicy policy(*this);
  FrameWalker<const MatchPolicy> walker(policy, graphs_[root()].start);
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    if (!walker.step(trace.ops[i].key, trace.ops[i].loops)) return Coverage{false, i};
  }
  return Coverage{walker.finish(), trace.ops.size()};
}

}  // namespace terra::trace
