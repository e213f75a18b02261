// Merging a trace into the TraceGraph (Terra, "TraceGraph"): follow a child with an equal key;
// otherwise merge back into an existing equal node of the same (sub)graph if the new edge keeps
// the graph acyclic; otherwise open a branch with a new node.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "trace/trace_graph.h"
#include "trace/walker.h"

namespace terra::trace {
namespace {
// Bounds that keep one merge step O(1) when a key repeats many times in one (sub)graph (a loop
// the capture layer did not recognise). Missing a merge only costs a larger graph.
constexpr size_t kMaxCandidatesScanned = 32;
constexpr size_t kMaxReorderTries = 4;

void validate(const Trace& t) {
  const size_t n = t.ops.size();
  for (size_t i = 0; i < n; ++i) {
    for (const ValueRef& in : t.ops[i].inputs) {
      if (in.kind != ValueRef::Kind::kOutput) continue;
      if (in.index >= i || in.output >= t.ops[in.index].num_outputs) {
        throw std::invalid_argument("trace record " + std::to_string(i) +
                                    " reads a value that no earlier record produced");
      }
    }
  }
  for (const FetchEvent& f : t.fetches) {
    if (f.after >= n || f.record > f.after || f.output >= t.ops[f.record].num_outputs) {
      throw std::invalid_argument("fetch of record " + std::to_string(f.record) +
                                  " is not positioned after a record that produced it");
    }
  }
}

// Did the producer run in an earlier iteration of a loop instance the consumer is still in?
bool is_loop_carried(const OpRecord& producer, const OpRecord& consumer) {
  const size_t depth = std::min(producer.loops.size(), consumer.loops.size());
  for (size_t d = 0; d < depth; ++d) {
    if (producer.loops[d].loop_id != consumer.loops[d].loop_id) return false;
    if (producer.loops[d].iteration != consumer.loops[d].iteration) {
      return producer.loops[d].iteration < consumer.loops[d].iteration;
    }
  }
  return false;
}

template <class T>
void add_unique(std::vector<T>& v, const T& x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}
}  // namespace

class MergePolicy {
 public:
  MergePolicy(TraceGraph& g, uint32_t trace) : g_(g), trace_(trace) {}

  NodeId advance(NodeId at, const MatchKey& key) { return g_.advance_or_create(at, key, created_); }
  bool reach_end(NodeId at) {
    const NodeId end = g_.graphs_[g_.nodes_[at].graph].end;
    if (g_.child(at, MatchKey::end()) == kNoNode) g_.add_edge(at, end);
    return true;
  }
  NodeId body_start(NodeId loop) { return g_.graphs_[g_.nodes_[loop].body].start; }
  bool loop_continue(const WalkLevel&) { return true; }
  bool loop_exit(const WalkLevel& level) {
    g_.record_trips(level.loop_node, trace_, level.trips);
    return true;
  }
  size_t created() const { return created_; }

 private:
  TraceGraph& g_;
  uint32_t trace_;
  size_t created_ = 0;
};

MergeResult TraceGraph::merge(const Trace& trace) {
  validate(trace);
  MergeResult result;
  result.trace = traces_;
  result.record_nodes.resize(trace.ops.size());
  MergePolicy policy(*this, traces_);
  FrameWalker<MergePolicy> walker(policy, graphs_[root()].start);
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    walker.step(trace.ops[i].key, trace.ops[i].loops);
    result.record_nodes[i] = walker.at();
  }
  walker.finish();
  record_io(trace, result.record_nodes);
  result.new_nodes = policy.created();
  ++traces_;
  return result;
}

NodeId TraceGraph::advance_or_create(NodeId at, const MatchKey& key, size_t& created) {
  NodeId next = child(at, key);
  if (next != kNoNode) return next;
  next = merge_target(at, key);
  if (next == kNoNode) {
    next = add_node(nodes_[at].graph, key.kind, key.key, at);
    if (key.kind == NodeKind::kLoop) add_graph(next);
    ++created;
  }
  add_edge(at, next);
  return next;
}

NodeId TraceGraph::merge_target(NodeId at, const MatchKey& key) {
  const auto it = same_key_.find(GroupKey{nodes_[at].graph, key});
  if (it == same_key_.end()) return kNoNode;
  const std::vector<NodeId>& candidates = it->second;
  const size_t scan = std::min(candidates.size(), kMaxCandidatesScanned);
  // Prefer the nearest candidate that already lies after `at` in the order: the edge is then
  // acyclic without any search. Newest candidates first: they are the likeliest to be near.
  NodeId best = kNoNode;
  for (size_t i = 0; i < scan; ++i) {
    const NodeId c = candidates[candidates.size() - 1 - i];
    if (rank(c) > rank(at) && (best == kNoNode || rank(c) < rank(best))) best = c;
  }
  if (best != kNoNode) return best;
  size_t tries = 0;
  for (size_t i = 0; i < scan && tries < kMaxReorderTries; ++i) {
    const NodeId c = candidates[candidates.size() - 1 - i];
    if (c == at) continue;
    ++tries;
    if (reorder_for_edge(at, c)) return c;
  }
  return kNoNode;
}

void TraceGraph::record_io(const Trace& trace, const std::vector<NodeId>& record_nodes) {
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    const OpRecord& op = trace.ops[i];
    Node& n = nodes_[record_nodes[i]];
    ++n.visits;
    n.num_outputs = std::max(n.num_outputs, op.num_outputs);
    if (n.inputs.size() < op.inputs.size()) n.inputs.resize(op.inputs.size());
    for (size_t slot = 0; slot < op.inputs.size(); ++slot) {
      const ValueRef& in = op.inputs[slot];
      Source s;
      s.output = in.output;
      if (in.kind == ValueRef::Kind::kFeed) {
        s.kind = Source::Kind::kFeed;
        s.id = in.index;
      } else {
        s.kind = Source::Kind::kNode;
        s.id = record_nodes[in.index];
        s.loop_carried = is_loop_carried(trace.ops[in.index], op);
      }
      add_unique(n.inputs[slot], s);
    }
  }
  for (const FetchEvent& f : trace.fetches) {
    add_unique(nodes_[record_nodes[f.record]].fetches, FetchPoint{f.output, record_nodes[f.after]});
  }
}

}  // namespace terra::trace
