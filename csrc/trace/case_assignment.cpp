// Structuring works on basic blocks of one (sub)graph at a time, in the manner of the Relooper
// for acyclic graphs. A set of pending entry blocks either is one block that the path must reach
// (emit it, continue with its successors), or becomes a switch: each entry that alone reaches
// some blocks "owns" them and gets a case holding them; the rest (shared blocks, entries reached
// from other entries) follow the switch, which then also has an empty skip case. No block is
// ever duplicated, so the program is linear in the graph, and the PythonRunner can always tell
// which case to pick: the one holding the block it goes to next.
#include "trace/case_assignment.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "trace/block_graph.h"
#include "trace/decision_table.h"

namespace terra::trace {
namespace {

constexpr uint32_t kNone = UINT32_MAX;
constexpr uint32_t kMany = UINT32_MAX - 1;

class CaseAssigner {
 public:
  CaseAssigner(const TraceGraph& g, Program& p) : g_(g), p_(p), b_(g) {}

  void run() {
    p_.loops.assign(g_.num_nodes(), LoopInfo{});
    p_.graph_roots.assign(g_.num_graphs(), kNoProg);
    p_.start = g_.graph(g_.root()).start;
    p_.root = build_graph(g_.root(), kNoProg);
    build_decision_table(g_, b_, p_);
  }

 private:
  Block& block(uint32_t b) { return b_.blocks[b]; }

  ProgId new_prog(ProgKind kind, GraphId gid, ProgId parent) {
    const ProgId id = static_cast<ProgId>(p_.nodes.size());
    ProgNode n;
    n.kind = kind;
    n.graph = gid;
    n.parent = parent;
    if (parent != kNoProg) {
      n.index_in_parent = static_cast<uint32_t>(p_.nodes[parent].children.size());
    }
    p_.nodes.push_back(std::move(n));
    if (parent != kNoProg) p_.nodes[parent].children.push_back(id);
    return id;
  }

  void new_site(SiteKind kind, ProgId prog) {
    p_.nodes[prog].site = static_cast<SiteId>(p_.sites.size());
    p_.sites.push_back(Site{kind, prog});
  }

  ProgId build_graph(GraphId gid, ProgId parent) {
    std::vector<uint32_t> blocks = b_.add_graph(g_, gid);
    const ProgId root = new_prog(ProgKind::kSeq, gid, parent);
    p_.graph_roots[gid] = root;
    std::vector<uint32_t> entries;
    bool can_exit = false;
    for (const NodeId c : g_.node(g_.graph(gid).start).children) {
      if (g_.node(c).kind == NodeKind::kEnd) {
        can_exit = true;
      } else {
        entries.push_back(b_.block_of[c]);
      }
    }
    reloop(std::move(entries), std::move(blocks), can_exit, root);
    return root;
  }

  void emit_loop(NodeId loop, ProgId seq) {
    const Node& n = g_.node(loop);
    const uint32_t fixed = g_.fixed_trip_count(loop);
    const ProgId prog = new_prog(fixed ? ProgKind::kUnrolled : ProgKind::kWhile, n.graph, seq);
    p_.nodes[prog].loop = loop;
    p_.nodes[prog].trip_count = fixed;
    if (!fixed) new_site(SiteKind::kLoopCond, prog);
    LoopInfo& info = p_.loops[loop];
    info.prog = prog;
    info.body_start = g_.graph(n.body).start;
    info.body_end = g_.graph(n.body).end;
    info.site = p_.nodes[prog].site;
    info.unrolled = fixed;
    build_graph(n.body, prog);
  }

  void emit_block(uint32_t b, ProgId seq) {
    block(b).seq = seq;
    block(b).first_item = static_cast<uint32_t>(p_.nodes[seq].children.size());
    ProgId run = kNoProg;
    const std::vector<NodeId> nodes = block(b).nodes;  // emit_loop may grow the block table
    for (const NodeId n : nodes) {
      if (g_.node(n).kind == NodeKind::kLoop) {
        run = kNoProg;
        emit_loop(n, seq);
        continue;
      }
      if (run == kNoProg) run = new_prog(ProgKind::kBlock, block(b).graph, seq);
      p_.nodes[run].ops.push_back(n);
    }
    block(b).last_item = static_cast<uint32_t>(p_.nodes[seq].children.size()) - 1;
  }

  // Emits into `seq` the program for `region` (blocks in topological order) entered at one of
  // `entries`; `can_exit`: the path may also leave the region without entering any of them.
  void reloop(std::vector<uint32_t> entries, std::vector<uint32_t> region, bool can_exit,
              ProgId seq) {
    const uint32_t tag = ++next_tag_;
    region_.resize(b_.blocks.size(), 0);
    owner_.resize(b_.blocks.size(), kNone);
    for (const uint32_t b : region) region_[b] = tag;
    const auto inside = [&](uint32_t b) { return region_[b] == tag; };
    const auto by_topo = [&](uint32_t a, uint32_t b) { return block(a).topo < block(b).topo; };
    while (!entries.empty()) {
      std::sort(entries.begin(), entries.end(), by_topo);
      entries.erase(std::unique(entries.begin(), entries.end()), entries.end());
      if (entries.size() == 1 && !can_exit) {
        const uint32_t b = entries[0];
        region_[b] = 0;
        emit_block(b, seq);
        entries.clear();
        can_exit = block(b).exits;
        for (const uint32_t s : block(b).succ) {
          if (inside(s)) {
            entries.push_back(s);
          } else {
            can_exit = true;
          }
        }
        continue;
      }
      const auto outside = [&](uint32_t b) { return !inside(b); };
      region.erase(std::remove_if(region.begin(), region.end(), outside), region.end());
      // owner_[b]: the one entry that reaches b, kMany if several do, kNone if none does.
      for (const uint32_t b : region) owner_[b] = kNone;
      for (const uint32_t e : entries) owner_[e] = e;
      for (const uint32_t b : region) {
        uint32_t o = owner_[b];
        for (const uint32_t pr : block(b).pred) {
          if (!inside(pr) || owner_[pr] == kNone) continue;
          o = o == kNone ? owner_[pr] : (o == owner_[pr] ? o : kMany);
        }
        owner_[b] = o;
      }
      std::vector<uint32_t> handled;
      std::vector<uint32_t> next_entries;
      for (const uint32_t e : entries) (owner_[e] == e ? handled : next_entries).push_back(e);
      const bool need_skip = !next_entries.empty() || can_exit;
      std::vector<std::vector<uint32_t>> groups(handled.size());
      for (const uint32_t b : region) {
        const auto h = std::find(handled.begin(), handled.end(), owner_[b]);
        if (h != handled.end()) groups[h - handled.begin()].push_back(b);
      }
      for (size_t i = 0; i < handled.size(); ++i) {
        for (const uint32_t b : groups[i]) {
          can_exit = can_exit || block(b).exits;
          for (const uint32_t s : block(b).succ) {
            if (!inside(s)) {
              can_exit = true;
            } else if (owner_[s] != handled[i]) {
              next_entries.push_back(s);
            }
          }
        }
      }
      const GraphId gid = block(handled[0]).graph;
      const ProgId sw = new_prog(ProgKind::kSwitch, gid, seq);
      new_site(SiteKind::kCaseSelect, sw);
      for (size_t i = 0; i < handled.size(); ++i) {
        const ProgId c = new_prog(ProgKind::kSeq, gid, sw);
        p_.nodes[sw].case_entry.push_back(block(handled[i]).nodes.front());
        reloop({handled[i]}, std::move(groups[i]), false, c);
      }
      if (need_skip) {
        new_prog(ProgKind::kSeq, gid, sw);
        p_.nodes[sw].case_entry.push_back(kNoNode);
      }
      entries = std::move(next_entries);
    }
  }

  const TraceGraph& g_;
  Program& p_;
  BlockGraph b_;
  std::vector<uint32_t> region_;  // per block: tag of the reloop call whose region holds it
  std::vector<uint32_t> owner_;
  uint32_t next_tag_ = 0;
};

}  // namespace

Program assign_cases(const TraceGraph& graph) {
  Program p;
  CaseAssigner(graph, p).run();
  return p;
}

}  // namespace terra::trace
