// Storage of the TraceGraph: creating nodes, sub-graphs and edges while keeping the edge index,
// the same-key index and the topological order in step with the node table.
#include "trace/trace_graph.h"

namespace terra::trace {

TraceGraph::TraceGraph() { add_graph(kNoNode); }

NodeId TraceGraph::add_node(GraphId g, NodeKind kind, const OpKey& key, NodeId after) {
  const NodeId id = static_cast<NodeId>(nodes_.size());
  Node n;
  n.id = id;
  n.kind = kind;
  n.graph = g;
  n.key = key;
  nodes_.push_back(std::move(n));
  graphs_[g].nodes.push_back(id);
  mark_.push_back(0);
  if (kind == NodeKind::kEnd) {
    slot_of_.push_back(OrderList::kNone);
    return id;
  }
  // A new node has no successors yet, so any place after its first parent is topological; right
  // after it keeps the new node ahead of everything a branch could merge back into.
  const OrderList::Slot slot =
      after == kNoNode ? order_.push_back() : order_.insert_after(slot_of_[after]);
  slot_of_.push_back(slot);
  if (kind == NodeKind::kOp || kind == NodeKind::kLoop) {
    same_key_[GroupKey{g, MatchKey{kind, key}}].push_back(id);
  }
  return id;
}

GraphId TraceGraph::add_graph(NodeId loop) {
  const GraphId g = static_cast<GraphId>(graphs_.size());
  SubGraph sg;
  sg.id = g;
  sg.loop = loop;
  graphs_.push_back(std::move(sg));
  graphs_[g].start = add_node(g, NodeKind::kStart, OpKey{}, loop);
  graphs_[g].end = add_node(g, NodeKind::kEnd, OpKey{}, kNoNode);
  if (loop != kNoNode) nodes_[loop].body = g;
  return g;
}

void TraceGraph::add_edge(NodeId from, NodeId to) {
  nodes_[from].children.push_back(to);
  nodes_[to].parents.push_back(from);
  edges_.emplace(EdgeKey{from, nodes_[to].match_key()}, to);
}

NodeId TraceGraph::child(NodeId parent, const MatchKey& key) const {
  const auto it = edges_.find(EdgeKey{parent, key});
  return it == edges_.end() ? kNoNode : it->second;
}

void TraceGraph::record_trips(NodeId loop, uint32_t trace, uint32_t count) {
  Node& n = nodes_[loop];
  n.fixed_trips = n.trips.empty() || n.fixed_trips == count ? count : 0;
  n.trips.push_back(TripRecord{trace, count});
}

}  // namespace terra::trace
