// For an edge u -> v that leaves u's block, walk the program from just after u's block to v's
// block (or to the end of the level's program): every switch on the way either holds v in one
// of its cases (enter it) or not (take its skip case). Blocks are numbered in program order, so
// "does this case hold v" is an interval test.
#include "trace/decision_table.h"

#include <algorithm>
#include <stdexcept>
#include <utility>
#include <vector>

namespace terra::trace {
namespace {

constexpr uint32_t kNone = UINT32_MAX;

class DecisionTable {
 public:
  DecisionTable(const TraceGraph& g, const BlockGraph& b, Program& p) : g_(g), b_(b), p_(p) {}

  void build() {
    number_blocks();
    std::vector<Decision> scratch;
    p_.out_begin.assign(g_.num_nodes() + 1, 0);
    p_.out_edges.clear();
    for (NodeId u = 0; u < g_.num_nodes(); ++u) {
      p_.out_begin[u] = static_cast<uint32_t>(p_.out_edges.size());
      const Node& n = g_.node(u);
      if (n.kind == NodeKind::kEnd) continue;
      const bool leaves_block =
          n.kind == NodeKind::kStart || b_.blocks[b_.block_of[u]].nodes.back() == u;
      for (const NodeId v : n.children) {
        scratch.clear();
        if (leaves_block) walk(u, v, scratch);
        const Transition t{v, static_cast<uint32_t>(p_.decision_pool.size()),
                           static_cast<uint32_t>(scratch.size())};
        p_.decision_pool.insert(p_.decision_pool.end(), scratch.begin(), scratch.end());
        const MatchKey key = g_.node(v).match_key();
        p_.out_edges.push_back(OutEdge{hash_of(key), key, t});
      }
      // (Program::transition stops at the first larger hash)
      std::sort(p_.out_edges.begin() + p_.out_begin[u], p_.out_edges.end(),
                [](const OutEdge& a, const OutEdge& b) { return a.hash < b.hash; });
    }
    p_.out_begin[g_.num_nodes()] = static_cast<uint32_t>(p_.out_edges.size());
  }

 private:
  // Program-order numbers of blocks, and per program node the interval of numbers inside it.
  void number_blocks() {
    std::vector<uint32_t> item_block(p_.nodes.size(), kNone);
    for (uint32_t b = 0; b < b_.blocks.size(); ++b) {
      const Block& block = b_.blocks[b];
      item_block[p_.nodes[block.seq].children[block.first_item]] = b;
    }
    number_.assign(b_.blocks.size(), kNone);
    span_.assign(p_.nodes.size(), {0, 0});
    uint32_t counter = 0;
    std::vector<std::pair<ProgId, bool>> stack{{p_.root, false}};
    while (!stack.empty()) {
      const auto [p, done] = stack.back();
      stack.pop_back();
      if (done) {
        span_[p].second = counter;
        continue;
      }
      span_[p].first = counter;
      if (item_block[p] != kNone) number_[item_block[p]] = counter++;
      stack.push_back({p, true});
      const auto& kids = p_.nodes[p].children;
      for (auto it = kids.rbegin(); it != kids.rend(); ++it) stack.push_back({*it, false});
    }
  }

  void walk(NodeId from, NodeId to, std::vector<Decision>& out) const {
    const GraphId gid = g_.node(from).graph;
    ProgId seq = p_.graph_roots[gid];
    uint32_t idx = 0;
    if (g_.node(from).kind != NodeKind::kStart) {
      const Block& b = b_.blocks[b_.block_of[from]];
      seq = b.seq;
      idx = b.last_item + 1;
    }
    const bool to_end = g_.node(to).kind == NodeKind::kEnd;
    ProgId target_item = kNoProg;
    uint32_t target = kNone;
    if (!to_end) {
      const Block& tb = b_.blocks[b_.block_of[to]];
      target_item = p_.nodes[tb.seq].children[tb.first_item];
      target = number_[b_.block_of[to]];
    }
    for (;;) {
      const ProgNode& s = p_.nodes[seq];
      if (idx < s.children.size()) {
        const ProgId item = s.children[idx];
        if (item == target_item) return;
        const ProgNode& sw = p_.nodes[item];
        if (sw.kind != ProgKind::kSwitch) {
          throw std::logic_error("case assignment: an edge passes an unconditional construct");
        }
        uint32_t chosen = kNone;
        for (uint32_t k = 0; k < sw.children.size() && !to_end; ++k) {
          const auto [lo, hi] = span_[sw.children[k]];
          if (target >= lo && target < hi) chosen = k;
        }
        if (chosen != kNone) {
          out.push_back(Decision{sw.site, chosen});
          seq = sw.children[chosen];
          idx = 0;
          continue;
        }
        if (sw.case_entry.back() != kNoNode) {
          throw std::logic_error("case assignment: a switch without skip case is bypassed");
        }
        out.push_back(Decision{sw.site, static_cast<uint32_t>(sw.children.size() - 1)});
        ++idx;
        continue;
      }
      if (seq == p_.graph_roots[gid]) {
        if (to_end) return;
        throw std::logic_error("case assignment: an edge target is not after its source");
      }
      const ProgNode& sw = p_.nodes[s.parent];  // a case ends: continue after its switch
      seq = sw.parent;
      idx = sw.index_in_parent + 1;
    }
  }

  const TraceGraph& g_;
  const BlockGraph& b_;
  Program& p_;
  std::vector<uint32_t> number_;                     // per block
  std::vector<std::pair<uint32_t, uint32_t>> span_;  // per program node: [first, end) numbers
};

}  // namespace

void build_decision_table(const TraceGraph& graph, const BlockGraph& blocks, Program& program) {
  DecisionTable(graph, blocks, program).build();
}

}  // namespace terra::trace
