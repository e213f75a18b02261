// The worked example of the Terra paper (Figure 3): a branch taken true, then false, ops after
// it, then a loop. The TraceGraph must come out as the paper draws it, and the generated program
// must be the switch-case plus While the paper describes.
//
//   line  5-6:   if cond:  y = Op1(x); y = Op2(y)
//   line  8-9:   else:     y = Op2(x)
//   line 10:     z = Op3(y)
//   line 12-13:  for _ in range(n): z = Op4(z)
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "trace/case_assignment.h"
#include "trace/cursor.h"
#include "trace/describe.h"
#include "trace/replay.h"
#include "trace/trace_graph.h"
#include "trace/trace_recorder.h"

namespace terra::trace {
namespace {

constexpr uint64_t kLoop = 12;
OpKey op(uint64_t number, uint64_t line) { return OpKey{number, 0, line}; }

Trace figure3(bool cond, int iterations) {
  TraceRecorder r;
  uint32_t y = 0;
  if (cond) {
    y = r.op(op(1, 5), {ValueRef::feed(0)});
    y = r.op(op(2, 6), {ValueRef::output_of(y)});
  } else {
    y = r.op(op(2, 8), {ValueRef::feed(0)});
  }
  uint32_t z = r.op(op(3, 10), {ValueRef::output_of(y)});
  r.enter_loop(kLoop);
  for (int i = 0; i < iterations; ++i) {
    if (i > 0) r.next_iteration();
    z = r.op(op(4, 13), {ValueRef::output_of(z)});
  }
  r.exit_loop();
  r.fetch(z);
  return r.take();
}

NodeId only_child(const TraceGraph& g, NodeId n) {
  EXPECT_EQ(g.node(n).children.size(), 1u) << describe(g);
  return g.node(n).children.at(0);
}

TEST(TraceFigure3, BranchesMergeBackAtOp3AndLoopIterationsMerge) {
  TraceGraph g;
  const Trace first = figure3(true, 2);
  const Trace second = figure3(false, 1);
  const MergeResult r1 = g.merge(first);
  EXPECT_FALSE(g.covers(second));
  EXPECT_EQ(g.coverage(second).first_uncovered, 0u);  // Op2@8 matches neither Op1 nor Op2@6
  const MergeResult r2 = g.merge(second);
  SCOPED_TRACE(describe(g));

  const NodeId start = g.graph(g.root()).start;
  const Node& s = g.node(start);
  ASSERT_EQ(s.children.size(), 2u);
  const NodeId op1 = s.children[0];
  const NodeId op2_false = s.children[1];
  EXPECT_EQ(g.node(op1).key, op(1, 5));
  EXPECT_EQ(g.node(op2_false).key, op(2, 8));
  const NodeId op2_true = only_child(g, op1);
  EXPECT_EQ(g.node(op2_true).key, op(2, 6));
  EXPECT_NE(op2_true, op2_false);  // same operator, different locations: two nodes

  const NodeId op3 = only_child(g, op2_true);
  EXPECT_EQ(only_child(g, op2_false), op3);  // the false branch merges back at Op3
  EXPECT_EQ(g.node(op3).parents.size(), 2u);
  EXPECT_EQ(g.node(op3).visits, 2u);

  const NodeId loop = only_child(g, op3);
  const Node& l = g.node(loop);
  ASSERT_EQ(l.kind, NodeKind::kLoop);
  EXPECT_EQ(l.loop_id(), kLoop);
  EXPECT_EQ(g.node(only_child(g, loop)).kind, NodeKind::kEnd);
  ASSERT_EQ(l.trips.size(), 2u);
  EXPECT_EQ(l.trips[0].trace, 0u);
  EXPECT_EQ(l.trips[0].count, 2u);
  EXPECT_EQ(l.trips[1].trace, 1u);
  EXPECT_EQ(l.trips[1].count, 1u);
  EXPECT_EQ(g.fixed_trip_count(loop), 0u);

  // Loop 1: all three Op4 executions are one body node.
  const SubGraph& body = g.graph(l.body);
  const NodeId op4 = only_child(g, body.start);
  EXPECT_EQ(g.node(op4).key, op(4, 13));
  EXPECT_EQ(only_child(g, op4), body.end);
  EXPECT_EQ(g.node(op4).visits, 3u);
  EXPECT_EQ(r1.record_nodes, (std::vector<NodeId>{op1, op2_true, op3, op4, op4}));
  EXPECT_EQ(r2.record_nodes, (std::vector<NodeId>{op2_false, op3, op4}));
  // Op4 reads its own output of the previous iteration: a loop-carried input.
  const std::vector<Source>& in = g.node(op4).inputs.at(0);
  EXPECT_NE(std::find(in.begin(), in.end(), Source{Source::Kind::kNode, true, op4, 0}), in.end());
  // Python printed z after the loop.
  EXPECT_EQ(g.node(op4).fetches, (std::vector<FetchPoint>{{0, op4}}));

  EXPECT_TRUE(g.covers(first));
  EXPECT_TRUE(g.covers(second));
  EXPECT_TRUE(g.covers(figure3(true, 5)));  // trip counts differ: a While, any count is fine
  EXPECT_TRUE(g.order_is_topological());
}

TEST(TraceFigure3, ProgramIsSwitchCaseThenWhile) {
  TraceGraph g;
  g.merge(figure3(true, 2));
  g.merge(figure3(false, 1));
  const Program p = assign_cases(g);
  SCOPED_TRACE(describe(p));
  const ProgNode& root = p.at(p.root);
  ASSERT_EQ(root.children.size(), 3u);
  const ProgNode& sw = p.at(root.children[0]);
  ASSERT_EQ(sw.kind, ProgKind::kSwitch);
  EXPECT_EQ(sw.children.size(), 2u);  // one case per control edge out of the start node
  EXPECT_EQ(p.at(root.children[1]).kind, ProgKind::kBlock);  // Op3
  const ProgNode& loop = p.at(root.children[2]);
  EXPECT_EQ(loop.kind, ProgKind::kWhile);
  ASSERT_EQ(p.sites.size(), 2u);

  std::vector<Decision> d;
  ASSERT_TRUE(decisions_for(p, figure3(true, 2), d));
  EXPECT_EQ(d, (std::vector<Decision>{
                   {sw.site, 0}, {loop.site, kLoopContinue}, {loop.site, kLoopExit}}));
  ASSERT_TRUE(decisions_for(p, figure3(false, 3), d));
  EXPECT_EQ(d, (std::vector<Decision>{{sw.site, 1},
                                      {loop.site, kLoopContinue},
                                      {loop.site, kLoopContinue},
                                      {loop.site, kLoopExit}}));
  const ReplayResult replayed = replay(p, d);
  ASSERT_TRUE(replayed.ok) << replayed.error;
  EXPECT_EQ(replayed.ops.size(), 5u);  // Op2@8, Op3, Op4 x3
}

TEST(TraceFigure3, SameTripCountEverywhereIsUnrolled) {
  TraceGraph g;
  g.merge(figure3(true, 2));
  g.merge(figure3(false, 2));
  const Program p = assign_cases(g);
  const ProgNode& root = p.at(p.root);
  const ProgNode& loop = p.at(root.children.back());
  ASSERT_EQ(loop.kind, ProgKind::kUnrolled) << describe(p);
  EXPECT_EQ(loop.trip_count, 2u);
  // A third iteration has no graph: it is the first op of that iteration that is uncovered.
  const Trace three = figure3(true, 3);
  EXPECT_EQ(g.coverage(three).first_uncovered, 5u);
  Cursor c(p);
  for (size_t i = 0; i < 5; ++i) EXPECT_TRUE(c.step(three.ops[i]).matched) << i;
  EXPECT_FALSE(c.step(three.ops[5]).matched);
}

}  // namespace
}  // namespace terra::trace
