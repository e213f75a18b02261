// The structured program that case assignment makes of a TraceGraph: a tree of sequences, basic
// blocks, switch-cases and loops that a graph emitter walks to build prim::If / prim::Loop, plus
// the tables the runtime cursor needs to tell the graph which way each switch and loop goes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "trace/edge_key.h"
#include "trace/node.h"

namespace terra::trace {

using ProgId = uint32_t;
using SiteId = uint32_t;
inline constexpr ProgId kNoProg = UINT32_MAX;
inline constexpr SiteId kNoSite = UINT32_MAX;
inline constexpr uint32_t kLoopExit = 0;
inline constexpr uint32_t kLoopContinue = 1;

enum class ProgKind : uint8_t {
  kSeq,       // children run in order
  kBlock,     // ops: TraceGraph op nodes, run in order
  kSwitch,    // children are cases (each a kSeq); a case-select decision picks one
  kWhile,     // child 0 is the body (kSeq); after each iteration a loop-cond decision says
              // continue (kLoopContinue) or exit (kLoopExit); the body runs at least once
  kUnrolled,  // child 0 is the body, run exactly trip_count times, no decisions of its own
};

struct ProgNode {
  ProgKind kind = ProgKind::kSeq;
  GraphId graph = kNoGraph;  // the TraceGraph (sub)graph this construct belongs to
  ProgId parent = kNoProg;
  uint32_t index_in_parent = 0;
  std::vector<ProgId> children;
  std::vector<NodeId> ops;         // kBlock
  std::vector<NodeId> case_entry;  // kSwitch: first TraceGraph node of each case; kNoNode for
                                   // the skip case (an empty case: go on after the switch)
  SiteId site = kNoSite;           // kSwitch: case-select site; kWhile: loop-cond site
  NodeId loop = kNoNode;           // kWhile, kUnrolled: the loop node
  uint32_t trip_count = 0;         // kUnrolled
};

// A decision the PythonRunner sends: case index at a case-select site, or kLoopContinue /
// kLoopExit at a loop-cond site. Decisions are consumed in program order.
struct Decision {
  SiteId site = kNoSite;
  uint32_t value = 0;
  friend bool operator==(const Decision&, const Decision&) = default;
};

enum class SiteKind : uint8_t { kCaseSelect, kLoopCond };

struct Site {
  SiteKind kind = SiteKind::kCaseSelect;
  ProgId prog = kNoProg;
};

// How the runtime enters and leaves one loop node.
struct LoopInfo {
  ProgId prog = kNoProg;  // the kWhile or kUnrolled construct
  NodeId body_start = kNoNode;
  NodeId body_end = kNoNode;
  SiteId site = kNoSite;      // loop-cond site (kWhile)
  uint32_t unrolled = 0;      // trip count if unrolled, else 0
};

// One control edge of the TraceGraph and the decisions that taking it implies.
struct Transition {
  NodeId to = kNoNode;
  uint32_t first = 0;  // into Program::decision_pool
  uint32_t count = 0;
};

// A control edge as the cursor looks it up: the child's key (and its hash, compared first) and
// the transition. Program::out_edges holds each node's edges contiguously.
struct OutEdge {
  uint64_t hash = 0;  // hash_of(key)
  MatchKey key;
  Transition transition;
};

struct Program {
  std::vector<ProgNode> nodes;
  ProgId root = kNoProg;
  NodeId start = kNoNode;            // start node of the top-level TraceGraph
  std::vector<ProgId> graph_roots;   // per TraceGraph (sub)graph: its kSeq
  std::vector<Site> sites;
  std::vector<LoopInfo> loops;       // indexed by NodeId; meaningful for loop nodes only
  // The control edges by source node: node u's are out_edges[out_begin[u] .. out_begin[u + 1]),
  // sorted by hash. The cursor looks one up per op it validates. Most nodes have one or two
  // children, so a scan of a few adjacent entries replaces the hash table this used to be, whose
  // node-per-entry buckets cost a cache miss or two per op (Cursor::Policy::advance was 1.7% of
  // the Python thread's samples in a co-executed Adam MLP step); a node with many children (one
  // path per input shape) is searched by bisection.
  std::vector<uint32_t> out_begin;
  std::vector<OutEdge> out_edges;
  std::vector<Decision> decision_pool;

  const ProgNode& at(ProgId p) const { return nodes[p]; }
  const Transition* transition(NodeId from, const MatchKey& key) const {
    if (static_cast<size_t>(from) + 1 >= out_begin.size()) return nullptr;
    const OutEdge* first = out_edges.data() + out_begin[from];
    const OutEdge* const last = out_edges.data() + out_begin[from + 1];
    const uint64_t h = hash_of(key);
    if (last - first > 8)  // many children: bisect to the run of equal hashes
      first = std::lower_bound(first, last, h, [](const OutEdge& e, uint64_t v) { return e.hash < v; });
    for (; first != last && first->hash <= h; ++first)
      if (first->hash == h && first->key == key) return &first->transition;
    return nullptr;
  }
  std::span<const Decision> decisions(const Transition& t) const {
    return {decision_pool.data() + t.first, t.count};
  }
};

}  // namespace terra::trace
