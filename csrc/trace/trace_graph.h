// The TraceGraph (Terra, section "TraceGraph"): every trace collected in the tracing phase merged
// into one DAG of op nodes, with program loops folded into loop nodes whose bodies are
// sub-graphs. It answers the question that ends the tracing phase (does it cover a trace?) and is
// the input of case assignment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "trace/edge_key.h"
#include "trace/node.h"
#include "trace/op_record.h"
#include "trace/order_list.h"

namespace terra::trace {

struct Coverage {
  bool covered = false;
  // Index of the first op the graph does not accept; ops.size() when the trace is covered or
  // when it deviates only at its end (a loop left too early, a path that does not end there).
  size_t first_uncovered = 0;
};

struct MergeResult {
  uint32_t trace = 0;                // index of this trace among the merged ones
  std::vector<NodeId> record_nodes;  // the node each record was merged into
  size_t new_nodes = 0;
};

class TraceGraph {
 public:
  TraceGraph();

  // Merges one trace; throws std::invalid_argument (leaving the graph untouched) if the trace
  // refers to records that do not precede their use.
  MergeResult merge(const Trace& trace);

  // The tracing phase ends once the latest trace is covered. Linear in the trace length.
  Coverage coverage(const Trace& trace) const;
  bool covers(const Trace& trace) const { return coverage(trace).covered; }

  GraphId root() const { return 0; }
  size_t num_graphs() const { return graphs_.size(); }
  const SubGraph& graph(GraphId g) const { return graphs_[g]; }
  size_t num_nodes() const { return nodes_.size(); }
  const Node& node(NodeId n) const { return nodes_[n]; }
  uint32_t num_traces() const { return traces_; }

  // The child of `parent` that matches `key`, or kNoNode.
  NodeId child(NodeId parent, const MatchKey& key) const;
  // The trip count shared by every instance of this loop node so far; 0 if they differed.
  uint32_t fixed_trip_count(NodeId loop) const { return nodes_[loop].fixed_trips; }
  // True if the order the graph keeps is a topological order (a self-check for tests).
  bool order_is_topological() const;
  size_t reorders() const { return reorders_; }

 private:
  friend class MergePolicy;

  NodeId add_node(GraphId g, NodeKind kind, const OpKey& key, NodeId after);
  GraphId add_graph(NodeId loop);
  void add_edge(NodeId from, NodeId to);
  NodeId advance_or_create(NodeId at, const MatchKey& key, size_t& created);
  NodeId merge_target(NodeId at, const MatchKey& key);
  bool reorder_for_edge(NodeId from, NodeId to);
  void record_trips(NodeId loop, uint32_t trace, uint32_t count);
  void record_io(const Trace& trace, const std::vector<NodeId>& record_nodes);
  uint64_t rank(NodeId n) const { return order_.label(slot_of_[n]); }

  std::vector<Node> nodes_;
  std::vector<SubGraph> graphs_;
  std::unordered_map<EdgeKey, NodeId, EdgeKeyHash> edges_;
  std::unordered_map<GroupKey, std::vector<NodeId>, GroupKeyHash> same_key_;
  // A topological order of all op, loop and start nodes (end nodes have no slot: an edge into
  // an end node can never close a cycle).
  OrderList order_;
  std::vector<OrderList::Slot> slot_of_;
  uint32_t traces_ = 0;
  size_t reorders_ = 0;
  std::vector<uint32_t> mark_;
  uint32_t stamp_ = 0;
};

}  // namespace terra::trace
