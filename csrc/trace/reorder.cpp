// Keeping the node order topological when a branch merges back into a node that the order puts
// before the branch: the Pearce-Kelly dynamic topological sort. It searches only the nodes
// between the two ends of the new edge, finds a cycle if there is one (then the merge is refused
// and the branch gets a new node), and otherwise reorders just the nodes it visited.
#include <algorithm>

#include "trace/trace_graph.h"

namespace terra::trace {
namespace {
// A search that touches more nodes than this gives up (and refuses the merge): it would only
// happen when one key repeats far apart in a large graph.
constexpr size_t kReorderBudget = 4096;
}  // namespace

bool TraceGraph::reorder_for_edge(NodeId from, NodeId to) {
  const uint64_t lower = rank(to);
  const uint64_t upper = rank(from);
  if (lower > upper) return true;
  const uint32_t forward_mark = ++stamp_;
  const uint32_t backward_mark = ++stamp_;
  std::vector<NodeId> forward;   // reachable from `to`, ranked below `from`
  std::vector<NodeId> backward;  // reaching `from`, ranked above `to`
  std::vector<NodeId> stack{to};
  mark_[to] = forward_mark;
  while (!stack.empty()) {
    const NodeId n = stack.back();
    stack.pop_back();
    forward.push_back(n);
    for (const NodeId c : nodes_[n].children) {
      if (c == from) return false;  // the edge would close a cycle
      if (nodes_[c].kind == NodeKind::kEnd || mark_[c] == forward_mark || rank(c) > upper) continue;
      if (forward.size() + stack.size() >= kReorderBudget) return false;
      mark_[c] = forward_mark;
      stack.push_back(c);
    }
  }
  stack.push_back(from);
  mark_[from] = backward_mark;
  while (!stack.empty()) {
    const NodeId n = stack.back();
    stack.pop_back();
    backward.push_back(n);
    for (const NodeId p : nodes_[n].parents) {
      if (mark_[p] == backward_mark || rank(p) < lower) continue;
      if (forward.size() + backward.size() + stack.size() >= kReorderBudget) return false;
      mark_[p] = backward_mark;
      stack.push_back(p);
    }
  }
  const auto by_rank = [this](NodeId a, NodeId b) { return rank(a) < rank(b); };
  std::sort(forward.begin(), forward.end(), by_rank);
  std::sort(backward.begin(), backward.end(), by_rank);
  std::vector<OrderList::Slot> slots;
  slots.reserve(forward.size() + backward.size());
  for (const NodeId n : backward) slots.push_back(slot_of_[n]);
  for (const NodeId n : forward) slots.push_back(slot_of_[n]);
  std::sort(slots.begin(), slots.end(),
            [this](OrderList::Slot a, OrderList::Slot b) { return order_.before(a, b); });
  // Everything that must precede `from` takes the lowest of the freed places, in its old order.
  size_t i = 0;
  for (const NodeId n : backward) slot_of_[n] = slots[i++];
  for (const NodeId n : forward) slot_of_[n] = slots[i++];
  ++reorders_;
  return true;
}

bool TraceGraph::order_is_topological() const {
  for (const Node& n : nodes_) {
    if (n.kind == NodeKind::kEnd) continue;
    for (const NodeId c : n.children) {
      if (nodes_[c].kind != NodeKind::kEnd && !order_.before(slot_of_[n.id], slot_of_[c])) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace terra::trace
