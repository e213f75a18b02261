// Loop nodes: iterations fold into one body, nested loops nest bodies, trip counts are kept per
// trace and decide between While and unrolling, a loop that is skipped is a branch around its
// node, and a loop that starts over (iteration index going down) is a new instance.
#include <gtest/gtest.h>

#include <vector>

#include "trace/case_assignment.h"
#include "trace/cursor.h"
#include "trace/describe.h"
#include "trace/replay.h"
#include "trace/trace_graph.h"
#include "trace/trace_recorder.h"

namespace terra::trace {
namespace {

OpKey at(uint64_t location) { return OpKey{7, 0, location}; }

NodeId only_child(const TraceGraph& g, NodeId n) {
  EXPECT_EQ(g.node(n).children.size(), 1u) << describe(g);
  return g.node(n).children.at(0);
}

// for i in range(outer): A; for j in range(inner[i]): B; C
// then D
Trace nested(const std::vector<int>& inner) {
  TraceRecorder r;
  r.enter_loop(100);
  for (size_t i = 0; i < inner.size(); ++i) {
    if (i > 0) r.next_iteration();
    r.op(at(1));
    r.enter_loop(200);
    for (int j = 0; j < inner[i]; ++j) {
      if (j > 0) r.next_iteration();
      r.op(at(2));
    }
    r.exit_loop();
    r.op(at(3));
  }
  r.exit_loop();
  r.op(at(4));
  return r.take();
}

TEST(TraceLoop, NestedLoopsGetNestedBodies) {
  TraceGraph g;
  g.merge(nested({1, 2}));
  SCOPED_TRACE(describe(g));
  const NodeId outer = only_child(g, g.graph(g.root()).start);
  ASSERT_EQ(g.node(outer).kind, NodeKind::kLoop);
  EXPECT_EQ(g.node(outer).loop_id(), 100u);
  const NodeId d_node = only_child(g, outer);
  EXPECT_EQ(g.node(d_node).key, at(4));
  const SubGraph& ob = g.graph(g.node(outer).body);
  const NodeId a = only_child(g, ob.start);
  const NodeId inner = only_child(g, a);
  ASSERT_EQ(g.node(inner).kind, NodeKind::kLoop);
  EXPECT_EQ(g.node(inner).loop_id(), 200u);
  const NodeId c = only_child(g, inner);
  EXPECT_EQ(g.node(c).key, at(3));
  EXPECT_EQ(only_child(g, c), ob.end);
  const SubGraph& ib = g.graph(g.node(inner).body);
  const NodeId b = only_child(g, ib.start);
  EXPECT_EQ(g.node(b).visits, 3u);
  EXPECT_EQ(only_child(g, b), ib.end);
  // Trip counts: one instance of the outer loop, one inner instance per outer iteration.
  ASSERT_EQ(g.node(outer).trips.size(), 1u);
  EXPECT_EQ(g.node(outer).trips[0].count, 2u);
  ASSERT_EQ(g.node(inner).trips.size(), 2u);
  EXPECT_EQ(g.node(inner).trips[0].count, 1u);
  EXPECT_EQ(g.node(inner).trips[1].count, 2u);

  const Program p = assign_cases(g);
  SCOPED_TRACE(describe(p));
  const ProgNode& root = p.at(p.root);
  ASSERT_EQ(root.children.size(), 2u);
  const ProgNode& u = p.at(root.children[0]);
  ASSERT_EQ(u.kind, ProgKind::kUnrolled);
  EXPECT_EQ(u.trip_count, 2u);
  const ProgNode& body = p.at(u.children[0]);
  ASSERT_EQ(body.children.size(), 3u);
  const ProgNode& w = p.at(body.children[1]);
  EXPECT_EQ(w.kind, ProgKind::kWhile);

  std::vector<Decision> d;
  ASSERT_TRUE(decisions_for(p, nested({3, 1}), d));
  EXPECT_EQ(d, (std::vector<Decision>{{w.site, kLoopContinue},
                                      {w.site, kLoopContinue},
                                      {w.site, kLoopExit},
                                      {w.site, kLoopExit}}));
  const ReplayResult r = replay(p, d);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.ops, (std::vector<NodeId>{a, b, b, b, c, a, b, c, d_node}));
  // The outer loop is unrolled: a third outer iteration is uncovered at its first op.
  const Trace three = nested({1, 1, 1});
  EXPECT_EQ(g.coverage(three).first_uncovered, 6u);
  EXPECT_FALSE(decisions_for(p, three, d));
}

TEST(TraceLoop, OpsCanEnterSeveralLoopsAtOnce) {
  TraceRecorder r;
  r.enter_loop(1);
  r.enter_loop(2);
  r.op(at(5));
  r.next_iteration();
  r.op(at(5));
  r.exit_loop();
  r.exit_loop();
  const Trace t = r.take();
  TraceGraph g;
  g.merge(t);
  EXPECT_TRUE(g.covers(t));
  const NodeId l1 = only_child(g, g.graph(g.root()).start);
  const NodeId l2 = only_child(g, g.graph(g.node(l1).body).start);
  EXPECT_EQ(g.node(l2).loop_id(), 2u);
  EXPECT_EQ(g.fixed_trip_count(l2), 2u);
  std::vector<Decision> d;
  EXPECT_TRUE(decisions_for(assign_cases(g), t, d));
  EXPECT_TRUE(d.empty());  // both loops unrolled, no branches: nothing to decide
}

TEST(TraceLoop, UnrolledOnlyWhileEveryInstanceAgrees) {
  TraceGraph g;
  g.merge(nested({2, 2}));
  g.merge(nested({2, 2, 2}));
  const NodeId outer = only_child(g, g.graph(g.root()).start);
  const NodeId inner = only_child(g, only_child(g, g.graph(g.node(outer).body).start));
  EXPECT_EQ(g.fixed_trip_count(inner), 2u);
  EXPECT_EQ(g.fixed_trip_count(outer), 0u);  // 2 then 3
  // Fewer inner iterations than the fixed count: rejected at the op after the loop (C).
  EXPECT_EQ(g.coverage(nested({2, 1})).first_uncovered, 6u);
  // More: rejected at the first op of the extra iteration.
  EXPECT_EQ(g.coverage(nested({3, 2})).first_uncovered, 3u);
  EXPECT_TRUE(g.covers(nested({2, 2, 2, 2})));
  const Program p = assign_cases(g);
  Cursor c(p);
  const Trace more = nested({3, 2});
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(c.step(more.ops[i]).matched);
  EXPECT_FALSE(c.step(more.ops[3]).matched);
  EXPECT_TRUE(c.failed());
  EXPECT_FALSE(c.step(more.ops[4]).matched);  // stays failed until reset
  c.reset();
  EXPECT_TRUE(c.step(more.ops[0]).matched);
  // One different count anywhere turns the loop into a While.
  g.merge(nested({2, 3}));
  EXPECT_EQ(g.fixed_trip_count(inner), 0u);
  EXPECT_TRUE(g.covers(nested({5, 1})));
}

TEST(TraceLoop, SkippedLoopIsABranchAroundTheLoopNode) {
  const auto run = [](int trips) {
    TraceRecorder r;
    r.op(at(1));
    r.enter_loop(9);
    for (int i = 0; i < trips; ++i) {
      if (i > 0) r.next_iteration();
      r.op(at(2));
    }
    r.exit_loop();
    r.op(at(3));
    return r.take();
  };
  TraceGraph g;
  const MergeResult m = g.merge(run(2));
  g.merge(run(0));
  const Node& a = g.node(m.record_nodes[0]);
  ASSERT_EQ(a.children.size(), 2u);
  EXPECT_EQ(g.node(a.children[0]).kind, NodeKind::kLoop);
  EXPECT_EQ(a.children[1], m.record_nodes[3]);
  const Program p = assign_cases(g);
  SCOPED_TRACE(describe(p));
  const ProgNode& sw = p.at(p.at(p.root).children[1]);
  ASSERT_EQ(sw.kind, ProgKind::kSwitch);
  EXPECT_EQ(sw.case_entry.back(), kNoNode);
  std::vector<Decision> d;
  ASSERT_TRUE(decisions_for(p, run(0), d));
  EXPECT_EQ(d, (std::vector<Decision>{{sw.site, 1}}));
  ASSERT_TRUE(decisions_for(p, run(2), d));
  EXPECT_EQ(d, (std::vector<Decision>{{sw.site, 0}}));  // unrolled x2: no loop-cond
  EXPECT_FALSE(g.covers(run(1)));
}

TEST(TraceLoop, IterationPathsMergeInsideTheBody) {
  // for x in xs: if x > 0: X else if x < 0: Y;  Z
  const auto run = [](const std::vector<int>& xs) {
    TraceRecorder r;
    r.enter_loop(5);
    for (size_t i = 0; i < xs.size(); ++i) {
      if (i > 0) r.next_iteration();
      if (xs[i] > 0) r.op(at(10));
      if (xs[i] < 0) r.op(at(11));
      r.op(at(12));
    }
    r.exit_loop();
    return r.take();
  };
  TraceGraph g;
  g.merge(run({1, -1, 0}));
  g.merge(run({0}));
  SCOPED_TRACE(describe(g));
  EXPECT_EQ(g.num_graphs(), 2u);
  const SubGraph& body = g.graph(1);
  EXPECT_EQ(g.node(body.start).children.size(), 3u);
  EXPECT_TRUE(g.covers(run({-1, -1, 1, 0, 1})));
  const Program p = assign_cases(g);
  std::vector<Decision> d;
  const Trace t = run({-1, 1});
  ASSERT_TRUE(decisions_for(p, t, d));
  const ReplayResult r = replay(p, d);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(r.ops.size(), t.ops.size());
  for (size_t i = 0; i < r.ops.size(); ++i) EXPECT_EQ(g.node(r.ops[i]).key, t.ops[i].key);
}

TEST(TraceLoop, IterationIndexGoingDownStartsANewInstance) {
  TraceRecorder r;
  r.enter_loop(3);
  r.op(at(1));
  r.next_iteration();
  r.op(at(1));
  r.exit_loop();
  r.enter_loop(3);  // the same loop again, e.g. a helper called twice in a row
  r.op(at(1));
  r.exit_loop();
  const Trace t = r.take();
  TraceGraph g;
  g.merge(t);
  SCOPED_TRACE(describe(g));
  const NodeId first = only_child(g, g.graph(g.root()).start);
  const NodeId second = only_child(g, first);
  ASSERT_EQ(g.node(second).kind, NodeKind::kLoop);
  EXPECT_NE(first, second);
  EXPECT_EQ(g.fixed_trip_count(first), 2u);
  EXPECT_EQ(g.fixed_trip_count(second), 1u);
  EXPECT_TRUE(g.covers(t));
}

TEST(TraceLoop, IterationsWithoutOpsAreNotCounted) {
  // The capture layer only sees iterations that issue ops; an index jump is one more trip.
  TraceRecorder r;
  r.enter_loop(3);
  r.op(at(1));
  r.next_iteration();
  r.next_iteration();
  r.op(at(1));
  r.exit_loop();
  TraceGraph g;
  g.merge(r.take());
  EXPECT_EQ(g.fixed_trip_count(only_child(g, g.graph(g.root()).start)), 2u);
}

}  // namespace
}  // namespace terra::trace
