// A node continues its parent's block iff it is the parent's only child and the parent is its
// only parent; so control can enter a block only at its head and leave it only at its tail.
#include "trace/block_graph.h"

#include <stdexcept>

namespace terra::trace {
namespace {

bool is_real(const TraceGraph& g, NodeId n) {
  return g.node(n).kind == NodeKind::kOp || g.node(n).kind == NodeKind::kLoop;
}

bool is_head(const TraceGraph& g, NodeId n) {
  const Node& x = g.node(n);
  if (x.parents.size() != 1) return true;
  const Node& parent = g.node(x.parents[0]);
  return parent.kind == NodeKind::kStart || parent.children.size() != 1;
}

}  // namespace

std::vector<uint32_t> BlockGraph::add_graph(const TraceGraph& g, GraphId gid) {
  const uint32_t base = static_cast<uint32_t>(blocks.size());
  for (const NodeId head : g.graph(gid).nodes) {
    if (!is_real(g, head) || !is_head(g, head)) continue;
    Block b;
    b.graph = gid;
    for (NodeId cur = head;;) {
      b.nodes.push_back(cur);
      block_of[cur] = static_cast<uint32_t>(blocks.size());
      const Node& c = g.node(cur);
      if (c.children.size() != 1 || !is_real(g, c.children[0]) || is_head(g, c.children[0])) break;
      cur = c.children[0];
    }
    blocks.push_back(std::move(b));
  }
  const uint32_t count = static_cast<uint32_t>(blocks.size()) - base;
  for (uint32_t b = base; b < base + count; ++b) {
    for (const NodeId c : g.node(blocks[b].nodes.back()).children) {
      if (g.node(c).kind == NodeKind::kEnd) {
        blocks[b].exits = true;
      } else {
        blocks[b].succ.push_back(block_of[c]);
        blocks[block_of[c]].pred.push_back(b);
      }
    }
  }
  // Kahn's algorithm; the TraceGraph is acyclic, so every block gets a place.
  std::vector<uint32_t> order;
  std::vector<uint32_t> indegree(count);
  for (uint32_t i = 0; i < count; ++i) {
    indegree[i] = static_cast<uint32_t>(blocks[base + i].pred.size());
    if (indegree[i] == 0) order.push_back(base + i);
  }
  for (size_t i = 0; i < order.size(); ++i) {
    blocks[order[i]].topo = static_cast<uint32_t>(i);
    for (const uint32_t s : blocks[order[i]].succ) {
      if (--indegree[s - base] == 0) order.push_back(s);
    }
  }
  if (order.size() != count) throw std::logic_error("case assignment: TraceGraph has a cycle");
  return order;
}

}  // namespace terra::trace
