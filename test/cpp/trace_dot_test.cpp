// The DOT picture is how a user checks what terra_torch recorded (docs/OBSERVABILITY.md), so its
// structure is part of the contract: a switch where paths split, the case each edge selects, a
// merge where they join, loops as clusters with their trip counts, and byte-identical output for
// the same input. Checked here on hand-built traces, without torch or Graphviz.
//
//   line  1:     a = Op1(x)
//   line  2-3:   if flag: b = Op2(a)  else: b = Op3(a)
//   line  4:     c = Op4(b)
//   line 10-11:  for _ in range(n): c = Op5(c)       (loop id 10)
//   line 12:         if c_small: c = Op6(c)          (only in the second test)
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "trace/case_assignment.h"
#include "trace/describe.h"
#include "trace/dot.h"
#include "trace/trace_graph.h"
#include "trace/trace_recorder.h"

namespace terra::trace {
namespace {

constexpr uint64_t kLoop = 10;
OpKey op(uint64_t number, uint64_t line) { return OpKey{number, 0, line}; }

// `inner[i]`: whether iteration i runs the if-without-else inside the loop body.
Trace program(bool flag, int iterations, const std::vector<bool>& inner = {}) {
  TraceRecorder r;
  const uint32_t a = r.op(op(1, 1), {ValueRef::feed(0)});
  const uint32_t b = flag ? r.op(op(2, 2), {ValueRef::output_of(a)})
                          : r.op(op(3, 3), {ValueRef::output_of(a)});
  uint32_t c = r.op(op(4, 4), {ValueRef::output_of(b)});
  r.enter_loop(kLoop);
  for (int i = 0; i < iterations; ++i) {
    if (i > 0) r.next_iteration();
    c = r.op(op(5, 11), {ValueRef::output_of(c)});
    if (static_cast<size_t>(i) < inner.size() && inner[i]) c = r.op(op(6, 12), {ValueRef::output_of(c)});
  }
  r.exit_loop();
  r.fetch(c);
  return r.take();
}

bool has(const std::string& dot, const std::string& part) {
  return dot.find(part) != std::string::npos;
}

// The text of `subgraph cluster_loop_<loop> { ... }`, braces matched.
std::string cluster(const std::string& dot, NodeId loop) {
  const std::string head = "subgraph cluster_loop_" + std::to_string(loop) + " {";
  const size_t begin = dot.find(head);
  if (begin == std::string::npos) return "";
  int depth = 0;
  for (size_t i = begin; i < dot.size(); ++i) {
    if (dot[i] == '{') ++depth;
    if (dot[i] == '}' && --depth == 0) return dot.substr(begin, i + 1 - begin);
  }
  return "";
}

std::string n(NodeId id) { return "n" + std::to_string(id); }

struct Built {
  TraceGraph graph;
  Program program;
};

void build(Built& b, const std::vector<Trace>& traces) {
  for (const Trace& t : traces) b.graph.merge(t);
  b.program = assign_cases(b.graph);
}

DotNames names_by_line(const TraceGraph& g) {
  return {[&g](NodeId id) {
            return g.node(id).kind == NodeKind::kLoop ? std::string("for")
                                                      : "Op" + std::to_string(g.node(id).key.op);
          },
          [&g](NodeId id) {
            return g.node(id).kind == NodeKind::kLoop ? std::string()
                                                      : "prog.py:" + std::to_string(g.node(id).key.location);
          }};
}

TEST(TraceDot, BranchCasesMergeAndWhileLoop) {
  Built b;
  build(b, {program(true, 2), program(false, 3)});
  const TraceGraph& g = b.graph;
  const std::string dot = to_dot(g, b.program, names_by_line(g), {.title = "step"});
  SCOPED_TRACE(describe(g) + describe(b.program) + dot);

  // The recorded shape: Op1 branches to Op2 / Op3, which merge at Op4, then the loop.
  const NodeId op1 = g.node(g.graph(g.root()).start).children.at(0);
  ASSERT_EQ(g.node(op1).children.size(), 2u);
  const NodeId op2 = g.node(op1).children[0];
  const NodeId op3 = g.node(op1).children[1];
  const NodeId op4 = g.node(op2).children.at(0);
  const NodeId loop = g.node(op4).children.at(0);
  ASSERT_EQ(g.node(loop).kind, NodeKind::kLoop);
  const SubGraph& body = g.graph(g.node(loop).body);
  const NodeId op5 = g.node(body.start).children.at(0);

  EXPECT_TRUE(dot.starts_with("digraph terra {\n"));
  EXPECT_TRUE(dot.ends_with("}\n"));
  EXPECT_TRUE(has(dot, "label=\"step\""));
  // Op nodes carry the caller's names and sources.
  EXPECT_TRUE(has(dot, n(op2) + " [label=\"" + n(op2) + " Op2\\nprog.py:2\""));
  // The switch after Op1: a diamond naming its case-select site, one labelled edge per case.
  SiteId site = kNoSite;
  for (const ProgId item : b.program.at(b.program.root).children) {
    if (b.program.at(item).kind == ProgKind::kSwitch) site = b.program.at(item).site;
  }
  ASSERT_NE(site, kNoSite);
  EXPECT_TRUE(has(dot, "b" + std::to_string(op1) + " [shape=diamond"));
  EXPECT_TRUE(has(dot, "label=\"switch s" + std::to_string(site) + "\""));
  EXPECT_TRUE(has(dot, "  " + n(op1) + " -> b" + std::to_string(op1) + ";\n"));
  EXPECT_TRUE(has(dot, "  b" + std::to_string(op1) + " -> " + n(op2) + " [label=\"case 0\"];\n"));
  EXPECT_TRUE(has(dot, "  b" + std::to_string(op1) + " -> " + n(op3) + " [label=\"case 1\"];\n"));
  // The merge before Op4: both branches go into it, it goes into Op4.
  const std::string merge = "m" + std::to_string(op4);
  EXPECT_TRUE(has(dot, merge + " [shape=invtriangle"));
  EXPECT_TRUE(has(dot, "  " + n(op2) + " -> " + merge + ";\n"));
  EXPECT_TRUE(has(dot, "  " + n(op3) + " -> " + merge + ";\n"));
  EXPECT_TRUE(has(dot, "  " + merge + " -> " + n(op4) + ";\n"));
  // The loop: a cluster labelled with kind, site and trips, holding its body; entered at the
  // body start, left from the body end, with a dashed edge back.
  const std::string c = cluster(dot, loop);
  ASSERT_FALSE(c.empty());
  const SiteId loop_site = b.program.loops[loop].site;
  EXPECT_TRUE(has(c, "label=\"loop " + n(loop) + " for\\nwhile, loop_cond s" +
                         std::to_string(loop_site) + "\\ntrips 2, 3\""));
  EXPECT_TRUE(has(c, n(op5) + " [label=\"" + n(op5) + " Op5\\nprog.py:11\\nread by Python\""));
  EXPECT_TRUE(has(c, n(body.start) + " [shape=circle"));
  EXPECT_FALSE(has(c, n(op4) + " [label"));  // Op4 runs before the loop, outside the cluster
  EXPECT_TRUE(has(dot, "  " + n(op4) + " -> " + n(body.start) + ";\n"));
  EXPECT_TRUE(has(dot, "  " + n(body.end) + " -> " + n(g.graph(g.root()).end) + " [label=\"exit\"];\n"));
  EXPECT_TRUE(has(dot, "  " + n(body.end) + " -> " + n(body.start) + " [style=dashed"));
  EXPECT_TRUE(has(dot, "label=\"next iteration (s" + std::to_string(loop_site) + ")\""));
  // The loop node itself is drawn as the cluster, never as a box.
  EXPECT_FALSE(has(dot, n(loop) + " [label"));
}

TEST(TraceDot, SkipCaseInsideLoopBodyAndUnrolledLoop) {
  Built b;
  // Same trip count in both traces: unrolled; the if without else inside the body branches
  // from Op5 to Op6 or straight to the end of the iteration.
  build(b, {program(true, 2, {true, false}), program(true, 2, {false, true})});
  const TraceGraph& g = b.graph;
  const std::string dot = to_dot(g, b.program, names_by_line(g));
  SCOPED_TRACE(describe(g) + describe(b.program) + dot);

  const NodeId op1 = g.node(g.graph(g.root()).start).children.at(0);
  const NodeId op4 = g.node(g.node(op1).children.at(0)).children.at(0);
  const NodeId loop = g.node(op4).children.at(0);
  const SubGraph& body = g.graph(g.node(loop).body);
  const NodeId op5 = g.node(body.start).children.at(0);
  ASSERT_EQ(g.node(op5).children.size(), 2u);
  const NodeId op6 = g.node(op5).children[0];

  EXPECT_FALSE(has(dot, "b" + std::to_string(op1) + " ["));  // no branch at the top level this time
  const std::string c = cluster(dot, loop);
  ASSERT_FALSE(c.empty());
  EXPECT_TRUE(has(c, "\\nunrolled x2\\ntrips 2, 2 (fixed)\""));
  // The switch and the merge at the end of the iteration sit inside the cluster.
  EXPECT_TRUE(has(c, "b" + std::to_string(op5) + " [shape=diamond"));
  EXPECT_TRUE(has(c, "m" + std::to_string(body.end) + " [shape=invtriangle"));
  EXPECT_TRUE(has(dot, "  b" + std::to_string(op5) + " -> " + n(op6) + " [label=\"case 0\"];\n"));
  EXPECT_TRUE(has(dot, "  b" + std::to_string(op5) + " -> m" + std::to_string(body.end) +
                           " [label=\"skip\"];\n"));
  EXPECT_TRUE(has(dot, "  m" + std::to_string(body.end) + " -> " + n(body.end) + ";\n"));
  // Unrolled loops have no loop-cond site to name on the back edge, and no exit decision.
  EXPECT_TRUE(has(dot, "label=\"next iteration\""));
  EXPECT_TRUE(has(dot, "  " + n(body.end) + " -> " + n(g.graph(g.root()).end) + ";\n"));
}

TEST(TraceDot, OutputIsDeterministic) {
  Built a, b;
  build(a, {program(true, 2), program(false, 3), program(true, 1, {true})});
  build(b, {program(true, 2), program(false, 3), program(true, 1, {true})});
  const std::string first = to_dot(a.graph, a.program, names_by_line(a.graph));
  EXPECT_EQ(first, to_dot(a.graph, a.program, names_by_line(a.graph)));
  EXPECT_EQ(first, to_dot(b.graph, b.program, names_by_line(b.graph)));
}

TEST(TraceDot, FallsBackToKeysAndEscapesCallerText) {
  Built b;
  build(b, {program(true, 1)});
  const NodeId op1 = b.graph.node(b.graph.graph(b.graph.root()).start).children.at(0);
  // No callbacks: the key numbers say which op and location a node is.
  const std::string plain = to_dot(b.graph, b.program);
  EXPECT_TRUE(has(plain, n(op1) + " [label=\"" + n(op1) + " op 1\\nlocation 1\""));
  // Quotes, backslashes and newlines from the caller cannot break the DOT syntax.
  const DotNames odd{[](NodeId) { return std::string("a\"b\\c"); },
                     [](NodeId) { return std::string("x\ny"); }};
  const std::string dot = to_dot(b.graph, b.program, odd, {.title = "t\"q"});
  EXPECT_TRUE(has(dot, " a\\\"b\\\\c\\nx\\ny\""));
  EXPECT_TRUE(has(dot, "label=\"t\\\"q\""));
  // No branch, no merge in a single trace.
  EXPECT_FALSE(has(dot, "shape=diamond"));
  EXPECT_FALSE(has(dot, "shape=invtriangle"));
}

}  // namespace
}  // namespace terra::trace
