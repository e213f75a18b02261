// Unit tests of the merge rule: equal ops share nodes, branches merge back at the first later op
// that has a node, a merge that would close a cycle opens a new node instead, the kept order
// stays topological, and feed and fetch points land on the right nodes.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "trace/describe.h"
#include "trace/trace_graph.h"
#include "trace/trace_recorder.h"

namespace terra::trace {
namespace {

OpKey at(uint64_t location) { return OpKey{7, 0, location}; }

// A top-level trace of ops at the given locations, each reading the previous one.
Trace line(std::vector<uint64_t> locations) {
  TraceRecorder r;
  for (size_t i = 0; i < locations.size(); ++i) {
    std::vector<ValueRef> in;
    if (i > 0) in.push_back(ValueRef::output_of(static_cast<uint32_t>(i - 1)));
    r.op(at(locations[i]), std::move(in));
  }
  return r.take();
}

size_t op_nodes(const TraceGraph& g) {
  size_t n = 0;
  for (NodeId i = 0; i < g.num_nodes(); ++i) n += g.node(i).kind == NodeKind::kOp;
  return n;
}

TEST(TraceMerge, IdenticalTracesShareEveryNode) {
  TraceGraph g;
  EXPECT_EQ(g.merge(line({1, 2, 3})).new_nodes, 3u);
  const MergeResult again = g.merge(line({1, 2, 3}));
  EXPECT_EQ(again.new_nodes, 0u);
  EXPECT_EQ(op_nodes(g), 3u);
  EXPECT_EQ(g.node(again.record_nodes[1]).visits, 2u);
  EXPECT_EQ(g.num_traces(), 2u);
}

TEST(TraceMerge, AttributesAndOperatorAreCompared) {
  TraceGraph g;
  g.merge(line({1}));
  Trace other_attrs = line({1});
  other_attrs.ops[0].key.attrs = 5;
  EXPECT_FALSE(g.covers(other_attrs));
  Trace other_op = line({1});
  other_op.ops[0].key.op = 8;
  EXPECT_FALSE(g.covers(other_op));
}

TEST(TraceMerge, BranchMergesBackAtFirstEqualLaterOp) {
  TraceGraph g;
  const MergeResult a = g.merge(line({1, 2, 3, 4}));
  const MergeResult b = g.merge(line({1, 9, 8, 3, 4}));
  SCOPED_TRACE(describe(g));
  EXPECT_EQ(b.new_nodes, 2u);
  EXPECT_EQ(b.record_nodes[3], a.record_nodes[2]);  // back at op 3
  EXPECT_EQ(b.record_nodes[4], a.record_nodes[3]);
  EXPECT_EQ(g.node(a.record_nodes[0]).children.size(), 2u);
  EXPECT_TRUE(g.order_is_topological());
  EXPECT_EQ(g.reorders(), 0u);  // new nodes sit right after the branch point: no reordering
  // A branch that skips ops merges into the later node directly.
  const MergeResult c = g.merge(line({1, 4}));
  EXPECT_EQ(c.new_nodes, 0u);
  EXPECT_TRUE(g.covers(line({1, 4})));
  EXPECT_EQ(g.coverage(line({1, 3})).first_uncovered, 1u);     // 1 -> 3 was never seen
  EXPECT_EQ(g.coverage(line({1, 2, 3})).first_uncovered, 3u);  // 3 never ended an iteration
  EXPECT_FALSE(g.covers(line({1, 2, 3})));
}

TEST(TraceMerge, MergeThatWouldCloseACycleOpensANewNode) {
  TraceGraph g;
  const MergeResult ab = g.merge(line({1, 2}));
  const MergeResult ba = g.merge(line({2, 1}));
  SCOPED_TRACE(describe(g));
  EXPECT_EQ(ba.record_nodes[0], ab.record_nodes[1]);  // start -> 2 merges into the existing 2
  EXPECT_NE(ba.record_nodes[1], ab.record_nodes[0]);  // 2 -> 1 would make 1 -> 2 -> 1 a cycle
  EXPECT_EQ(op_nodes(g), 3u);
  EXPECT_TRUE(g.order_is_topological());
  EXPECT_TRUE(g.covers(line({1, 2})));
  EXPECT_TRUE(g.covers(line({2, 1})));
  // Merging generalises: 1 -> 2 and 2 -> 1' combine into a path no trace took.
  EXPECT_TRUE(g.covers(line({1, 2, 1})));
  EXPECT_EQ(g.coverage(line({2, 1, 2})).first_uncovered, 2u);
}

TEST(TraceMerge, MergeAgainstTheOrderReordersInsteadOfDuplicating) {
  TraceGraph g;
  g.merge(line({1}));
  g.merge(line({2}));  // 2 is inserted right after start, before 1
  const MergeResult r = g.merge(line({1, 2}));
  EXPECT_EQ(r.new_nodes, 0u);  // 1 -> 2 is acyclic although the order had 2 first
  EXPECT_EQ(g.reorders(), 1u);
  EXPECT_TRUE(g.order_is_topological());
  const MergeResult back = g.merge(line({2, 1}));
  EXPECT_EQ(back.new_nodes, 1u);  // now 2 -> 1 would be a cycle
  EXPECT_TRUE(g.order_is_topological());
  for (const auto& t : {line({1}), line({2}), line({1, 2}), line({2, 1})}) EXPECT_TRUE(g.covers(t));
}

TEST(TraceMerge, RepeatedKeyWithoutLoopInformationStaysAcyclicAndFast) {
  // A loop the capture layer did not recognise: the same op 3000 times at top level. Each merge
  // back would close a cycle, so the graph is a chain, and the bounded search keeps it linear.
  std::vector<uint64_t> locations(3000, 42);
  const Trace t = line(locations);
  TraceGraph g;
  g.merge(t);
  EXPECT_EQ(op_nodes(g), 3000u);
  EXPECT_TRUE(g.order_is_topological());
  EXPECT_TRUE(g.covers(t));
  EXPECT_EQ(g.merge(t).new_nodes, 0u);
}

TEST(TraceMerge, FeedAndFetchPointsAreRecordedPerNode) {
  TraceRecorder r;
  const uint32_t a = r.op(at(1), {ValueRef::feed(3)});                            // x = feed
  const uint32_t b = r.op(at(2), {ValueRef::output_of(a), ValueRef::feed(4)}, 2);  // two outputs
  r.fetch(b, 1);  // Python reads b's second output before op 3 runs
  const uint32_t c = r.op(at(3), {ValueRef::output_of(b, 1)});
  r.fetch(a);
  (void)c;
  TraceGraph g;
  const MergeResult m = g.merge(r.take());
  const Node& na = g.node(m.record_nodes[a]);
  const Node& nb = g.node(m.record_nodes[b]);
  const Node& nc = g.node(m.record_nodes[c]);
  ASSERT_EQ(na.inputs.size(), 1u);
  EXPECT_EQ(na.inputs[0], (std::vector<Source>{{Source::Kind::kFeed, false, 3, 0}}));
  ASSERT_EQ(nb.inputs.size(), 2u);
  EXPECT_EQ(nb.inputs[0], (std::vector<Source>{{Source::Kind::kNode, false, na.id, 0}}));
  EXPECT_EQ(nb.inputs[1], (std::vector<Source>{{Source::Kind::kFeed, false, 4, 0}}));
  EXPECT_EQ(nb.num_outputs, 2u);
  EXPECT_EQ(nc.inputs[0], (std::vector<Source>{{Source::Kind::kNode, false, nb.id, 1}}));
  EXPECT_EQ(nb.fetches, (std::vector<FetchPoint>{{1, nb.id}}));
  EXPECT_EQ(na.fetches, (std::vector<FetchPoint>{{0, nc.id}}));
  EXPECT_TRUE(nc.fetches.empty());
}

TEST(TraceMerge, InputSlotsCollectEveryProducerSeen) {
  // z = Op3(y) where y came from different ops on the two paths (Figure 3's Op3).
  TraceGraph g;
  const MergeResult p = g.merge(line({1, 3}));
  const MergeResult q = g.merge(line({2, 3}));
  const Node& op3 = g.node(p.record_nodes[1]);
  EXPECT_EQ(q.record_nodes[1], op3.id);
  const std::vector<Source> both{{Source::Kind::kNode, false, p.record_nodes[0], 0},
                                 {Source::Kind::kNode, false, q.record_nodes[0], 0}};
  EXPECT_EQ(op3.inputs[0], both);
}

TEST(TraceMerge, MalformedTraceIsRejectedAndLeavesTheGraphAlone) {
  TraceGraph g;
  g.merge(line({1, 2}));
  const size_t nodes = g.num_nodes();
  Trace forward = line({1, 5});
  forward.ops[0].inputs.push_back(ValueRef::output_of(1));  // reads a later record
  EXPECT_THROW(g.merge(forward), std::invalid_argument);
  Trace bad_fetch = line({1, 5});
  bad_fetch.fetches.push_back(FetchEvent{0, 1, 0});  // read before it was produced
  EXPECT_THROW(g.merge(bad_fetch), std::invalid_argument);
  Trace bad_output = line({1, 5});
  bad_output.ops[1].inputs[0].output = 3;  // record 0 has one output
  EXPECT_THROW(g.merge(bad_output), std::invalid_argument);
  EXPECT_EQ(g.num_nodes(), nodes);
  EXPECT_EQ(g.num_traces(), 1u);
}

TEST(TraceMerge, EmptyIterationIsAPathFromStartToEnd) {
  TraceGraph g;
  EXPECT_FALSE(g.covers(Trace{}));
  g.merge(Trace{});
  EXPECT_TRUE(g.covers(Trace{}));
  EXPECT_FALSE(g.covers(line({1})));
  g.merge(line({1}));
  EXPECT_TRUE(g.covers(Trace{}));
  EXPECT_TRUE(g.covers(line({1})));
}

}  // namespace
}  // namespace terra::trace
