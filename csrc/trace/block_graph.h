// Basic blocks of the TraceGraph: maximal chains of nodes that always run together. Case
// assignment structures blocks instead of nodes, and the decision table is indexed by the edges
// that leave a block, so both share this one definition of a block.
#pragma once

#include <cstdint>
#include <vector>

#include "trace/program.h"
#include "trace/trace_graph.h"

namespace terra::trace {

inline constexpr uint32_t kNoBlock = UINT32_MAX;

struct Block {
  GraphId graph = kNoGraph;
  std::vector<NodeId> nodes;   // op and loop nodes, in execution order
  std::vector<uint32_t> succ;  // successor blocks
  std::vector<uint32_t> pred;
  bool exits = false;  // the last node has an edge to the end node
  uint32_t topo = 0;   // position in a topological order of its graph's blocks
  // Where case assignment put it: items [first_item, last_item] of the kSeq `seq`.
  ProgId seq = kNoProg;
  uint32_t first_item = 0;
  uint32_t last_item = 0;
};

struct BlockGraph {
  std::vector<Block> blocks;
  std::vector<uint32_t> block_of;  // per TraceGraph node; kNoBlock for start and end nodes

  explicit BlockGraph(const TraceGraph& g) : block_of(g.num_nodes(), kNoBlock) {}
  // Cuts one (sub)graph into blocks; returns them in a topological order.
  std::vector<uint32_t> add_graph(const TraceGraph& g, GraphId gid);
};

}  // namespace terra::trace
