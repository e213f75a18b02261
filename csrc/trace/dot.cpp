// The picture draws the TraceGraph's own edges rather than the Program tree: the graph is what
// was recorded, and every edge maps to the decisions it implies (Program::transition), so the
// switches and their cases can be labelled on the edges without re-deriving the structure. Loop
// nodes are replaced by clusters because a loop "node" with a hidden body is the part a reader
// most wants to open.
#include "trace/dot.h"

#include <algorithm>
#include <sstream>
#include <vector>

namespace terra::trace {
namespace {

// DOT double-quoted strings: a backslash starts an escape (\n, \l, \N...), so user text (paths,
// operator names) must have its backslashes and quotes escaped; newlines become \n breaks.
std::string escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '"': out += "\\\""; break;
      case '\n': out += "\\n"; break;
      case '\r': break;
      default: out += c;
    }
  }
  return out;
}

// Lines already escaped, joined with DOT's centred line break.
std::string lines(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) {
    if (p.empty()) continue;
    if (!out.empty()) out += "\\n";
    out += p;
  }
  return out;
}

// Long trip lists (a loop nested in a loop has one record per outer iteration) would make the
// cluster label unreadable; past a few entries a range says what matters.
std::string trips_text(const Node& loop) {
  if (loop.trips.empty()) return "no trips recorded";
  constexpr size_t kListed = 8;
  std::ostringstream os;
  if (loop.trips.size() <= kListed) {
    os << "trips";
    for (size_t i = 0; i < loop.trips.size(); ++i) os << (i ? ", " : " ") << loop.trips[i].count;
  } else {
    const auto [lo, hi] = std::minmax_element(
        loop.trips.begin(), loop.trips.end(),
        [](const TripRecord& a, const TripRecord& b) { return a.count < b.count; });
    os << "trips " << lo->count;
    if (hi->count != lo->count) os << ".." << hi->count;
    os << " in " << loop.trips.size() << " runs";
  }
  if (loop.fixed_trips != 0) os << " (fixed)";
  return os.str();
}

// prefix + number. (Written out because GCC 12 -O3 warns falsely (-Wrestrict) on
// "literal" + std::to_string(n).)
std::string tag(const char* prefix, uint64_t n) {
  std::string s(prefix);
  s += std::to_string(n);
  return s;
}

class DotWriter {
 public:
  DotWriter(const TraceGraph& g, const Program& p, const DotNames& names)
      : g_(g), p_(p), names_(names) {}

  std::string write(const DotOptions& options) {
    out_ << "digraph terra {\n";
    out_ << "  graph [rankdir=TB, fontname=\"Helvetica\", fontsize=11, newrank=true";
    if (!options.title.empty()) out_ << ", label=\"" << escape(options.title) << "\", labelloc=t";
    out_ << "];\n";
    out_ << "  node [shape=box, style=\"rounded,filled\", fillcolor=\"#ffffff\", "
            "fontname=\"Helvetica\", fontsize=10];\n";
    out_ << "  edge [fontname=\"Helvetica\", fontsize=9];\n";
    declare_graph(g_.root(), 1);
    for (GraphId gid = 0; gid < g_.num_graphs(); ++gid) edges_of(gid);
    out_ << "}\n";
    return out_.str();
  }

 private:
  static std::string id(NodeId n) { return tag("n", n); }

  // Where edges into / out of a node attach: a loop is entered at its body's start and left
  // from its body's end, which sit inside the loop's cluster.
  std::string in_port(NodeId n) const {
    const Node& node = g_.node(n);
    return node.kind == NodeKind::kLoop ? id(g_.graph(node.body).start) : id(n);
  }
  std::string out_port(NodeId n) const {
    const Node& node = g_.node(n);
    return node.kind == NodeKind::kLoop ? id(g_.graph(node.body).end) : id(n);
  }
  bool branches(NodeId n) const { return g_.node(n).children.size() > 1; }
  bool merges(NodeId n) const { return g_.node(n).parents.size() > 1; }

  std::string callback(const std::function<std::string(NodeId)>& f, NodeId n) const {
    return f ? f(n) : std::string();
  }

  void indent(int depth) { out_ << std::string(2 * depth, ' '); }

  void declare_graph(GraphId gid, int depth) {
    const SubGraph& sg = g_.graph(gid);
    for (const NodeId n : sg.nodes) {
      const Node& node = g_.node(n);
      switch (node.kind) {
        case NodeKind::kStart:
        case NodeKind::kEnd: declare_terminal(sg, node, depth); break;
        case NodeKind::kOp: declare_op(node, depth); break;
        case NodeKind::kLoop: declare_loop(node, depth); break;
      }
      // Junctions live at the node's own level (for a loop: outside its cluster), since they
      // are about how the surrounding paths reach or leave it.
      if (node.kind != NodeKind::kEnd && branches(n)) {
        indent(depth);
        out_ << 'b' << n << " [shape=diamond, style=filled, fillcolor=\"#ffe08a\", label=\""
             << escape(switch_label(n)) << "\"];\n";
      }
      if (merges(n)) {
        indent(depth);
        out_ << 'm' << n
             << " [shape=invtriangle, style=filled, fillcolor=\"#b9e4c9\", label=\"merge\"];\n";
      }
    }
  }

  void declare_terminal(const SubGraph& sg, const Node& node, int depth) {
    const bool top = sg.loop == kNoNode;
    const bool start = node.kind == NodeKind::kStart;
    indent(depth);
    out_ << id(node.id) << " [shape=" << (start ? "circle" : "doublecircle")
         << ", style=filled, fillcolor=\"" << (top ? "#dddddd" : "#eeeeee") << "\", fontsize=8, label=\""
         << (top ? (start ? "start" : "end") : (start ? "iter" : "iter end")) << "\"];\n";
  }

  void declare_op(const Node& node, int depth) {
    std::string label = callback(names_.label, node.id);
    if (label.empty()) label = tag("op ", node.key.op);
    std::string source = callback(names_.source, node.id);
    if (source.empty()) source = tag("location ", node.key.location);
    const bool read = !node.fetches.empty();
    indent(depth);
    out_ << id(node.id) << " [label=\""
         << lines({escape(id(node.id) + " " + label), escape(source), read ? "read by Python" : ""})
         << "\", tooltip=\"visits " << node.visits << '"';
    if (read) out_ << ", fillcolor=\"#dbe9ff\"";
    out_ << "];\n";
  }

  void declare_loop(const Node& node, int depth) {
    const LoopInfo* info = loop_info(node);
    std::string kind = "loop";
    if (info != nullptr) {
      kind = info->unrolled != 0 ? tag("unrolled x", info->unrolled)
                                 : tag("while, loop_cond s", info->site);
    }
    const std::string label = callback(names_.label, node.id);
    indent(depth);
    out_ << "subgraph cluster_loop_" << node.id << " {\n";
    indent(depth + 1);
    out_ << "label=\""
         << lines({escape("loop " + id(node.id) + (label.empty() ? "" : " " + label)), escape(kind),
                   escape(trips_text(node)), escape(callback(names_.source, node.id))})
         << "\"; style=\"rounded,filled\"; fillcolor=\"#eef3fb\"; color=\"#6c8ebf\";\n";
    declare_graph(node.body, depth + 1);
    indent(depth);
    out_ << "}\n";
  }

  // The sites the out-edges of a branching node decide, in order of first use.
  std::vector<SiteId> sites_after(NodeId n) const {
    std::vector<SiteId> sites;
    for (const NodeId c : g_.node(n).children) {
      const Transition* t = p_.transition(n, g_.node(c).match_key());
      if (t == nullptr) continue;
      for (const Decision& d : p_.decisions(*t)) {
        if (std::find(sites.begin(), sites.end(), d.site) == sites.end()) sites.push_back(d.site);
      }
    }
    return sites;
  }

  std::string switch_label(NodeId n) const {
    const std::vector<SiteId> sites = sites_after(n);
    if (sites.empty()) return "branch";
    std::string s = "switch";
    for (size_t i = 0; i < sites.size(); ++i) s += tag(i ? ", s" : " s", sites[i]);
    return s;
  }

  // "case 1", or "s0: case 1, s2: skip" when the edge passes several switches (unstructured
  // merges) or comes from a node that does not branch itself.
  std::string edge_label(NodeId from, NodeId to) const {
    const Transition* t = p_.transition(from, g_.node(to).match_key());
    if (t == nullptr || t->count == 0) return "";
    const auto ds = p_.decisions(*t);
    const bool bare = ds.size() == 1 && branches(from) && sites_after(from).size() == 1;
    std::string s;
    for (const Decision& d : ds) {
      if (!s.empty()) s += ", ";
      if (!bare) s += tag("s", d.site) + ": ";
      const Site& site = p_.sites[d.site];
      const ProgNode& sw = p_.at(site.prog);
      const bool skip = site.kind == SiteKind::kCaseSelect && d.value < sw.case_entry.size() &&
                        sw.case_entry[d.value] == kNoNode;
      s += skip ? "skip" : tag("case ", d.value);
    }
    return s;
  }

  void edge(const std::string& from, const std::string& to, const std::string& attrs) {
    out_ << "  " << from << " -> " << to;
    if (!attrs.empty()) out_ << " [" << attrs << ']';
    out_ << ";\n";
  }

  void edges_of(GraphId gid) {
    const SubGraph& sg = g_.graph(gid);
    for (const NodeId u : sg.nodes) {
      const Node& node = g_.node(u);
      if (node.kind == NodeKind::kLoop) back_edge(node);
      if (merges(u)) edge(tag("m", u), in_port(u), "");
      if (node.kind == NodeKind::kEnd) continue;
      // Leaving a while loop is a loop-cond decision too; say so where the path leaves.
      const std::string exit = is_while(node) ? "exit" : "";
      const std::string from = branches(u) ? tag("b", u) : out_port(u);
      if (branches(u)) edge(out_port(u), from, label_attr(exit));
      for (const NodeId v : node.children) {
        const std::string to = merges(v) ? tag("m", v) : in_port(v);
        std::string label = edge_label(u, v);
        if (!branches(u) && !exit.empty()) label = label.empty() ? exit : exit + ", " + label;
        edge(from, to, label_attr(label));
      }
    }
  }

  static std::string label_attr(const std::string& label) {
    return label.empty() ? "" : "label=\"" + escape(label) + "\"";
  }

  const LoopInfo* loop_info(const Node& loop) const {
    if (loop.kind != NodeKind::kLoop || loop.id >= p_.loops.size()) return nullptr;
    const LoopInfo& info = p_.loops[loop.id];
    return info.prog == kNoProg ? nullptr : &info;
  }
  bool is_while(const Node& n) const {
    const LoopInfo* info = loop_info(n);
    return info != nullptr && info->unrolled == 0;
  }

  void back_edge(const Node& loop) {
    const SubGraph& body = g_.graph(loop.body);
    std::string label = "next iteration";
    if (is_while(loop)) label += tag(" (s", loop_info(loop)->site) + ")";
    edge(id(body.end), id(body.start),
         "style=dashed, color=\"#6c8ebf\", constraint=false, label=\"" + escape(label) + "\"");
  }

  const TraceGraph& g_;
  const Program& p_;
  const DotNames& names_;
  std::ostringstream out_;
};

}  // namespace

std::string to_dot(const TraceGraph& graph, const Program& program, const DotNames& names,
                   const DotOptions& options) {
  return DotWriter(graph, program, names).write(options);
}

}  // namespace terra::trace
