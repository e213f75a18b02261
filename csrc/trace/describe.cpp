// Op nodes print as "n<id>:<location>" because the location is what distinguishes ops in tests
// and in the paper's figures; operator and attribute ids add little to a reader.
#include "trace/describe.h"

#include <sstream>

namespace terra::trace {
namespace {

void name(std::ostringstream& os, const Node& n) {
  switch (n.kind) {
    case NodeKind::kStart: os << "start"; return;
    case NodeKind::kEnd: os << "end"; return;
    case NodeKind::kOp: os << 'n' << n.id << ':' << n.key.location; return;
    case NodeKind::kLoop: os << 'n' << n.id << ":loop" << n.loop_id(); return;
  }
}

void describe_prog(std::ostringstream& os, const Program& p, ProgId id, int depth) {
  const ProgNode& n = p.at(id);
  os << std::string(2 * depth, ' ');
  switch (n.kind) {
    case ProgKind::kSeq: os << "seq\n"; break;
    case ProgKind::kBlock:
      os << "block";
      for (const NodeId op : n.ops) os << " n" << op;
      os << '\n';
      return;
    case ProgKind::kSwitch:
      os << "switch site " << n.site << " cases";
      for (const NodeId e : n.case_entry) {
        if (e == kNoNode) os << " skip"; else os << " n" << e;
      }
      os << '\n';
      break;
    case ProgKind::kWhile: os << "while site " << n.site << " loop n" << n.loop << '\n'; break;
    case ProgKind::kUnrolled:
      os << "unrolled x" << n.trip_count << " loop n" << n.loop << '\n';
      break;
  }
  for (const ProgId c : n.children) describe_prog(os, p, c, depth + 1);
}

}  // namespace

std::string describe(const TraceGraph& graph) {
  std::ostringstream os;
  for (GraphId g = 0; g < graph.num_graphs(); ++g) {
    const SubGraph& sg = graph.graph(g);
    os << "graph " << g;
    if (sg.loop != kNoNode) os << " (body of n" << sg.loop << ')';
    os << '\n';
    for (const NodeId id : sg.nodes) {
      const Node& n = graph.node(id);
      if (n.kind == NodeKind::kEnd) continue;
      os << "  ";
      name(os, n);
      os << " ->";
      for (const NodeId c : n.children) {
        os << ' ';
        name(os, graph.node(c));
      }
      if (n.kind == NodeKind::kLoop) {
        os << "  [body " << n.body << ", trips";
        for (const TripRecord& t : n.trips) os << ' ' << t.count;
        os << ']';
      }
      os << '\n';
    }
  }
  return os.str();
}

std::string describe(const Program& program) {
  std::ostringstream os;
  describe_prog(os, program, program.root, 0);
  return os.str();
}

}  // namespace terra::trace
