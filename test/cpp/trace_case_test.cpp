// Case assignment on hand-made graph shapes: a line, a diamond, an if without else, unstructured
// merges, and the shapes (chains of optional ops, ladders) where duplicating shared code would
// blow up. Every shape is checked by replaying the Cursor's decisions.
#include <gtest/gtest.h>

#include <random>
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

Trace line(const std::vector<uint64_t>& locations) {
  TraceRecorder r;
  for (const uint64_t l : locations) r.op(at(l));
  return r.take();
}

size_t count(const Program& p, ProgKind kind) {
  size_t n = 0;
  for (const ProgNode& x : p.nodes) n += x.kind == kind;
  return n;
}

void expect_replays(const TraceGraph& g, const Program& p, const Trace& t) {
  std::vector<Decision> d;
  ASSERT_TRUE(decisions_for(p, t, d)) << describe(p);
  const ReplayResult r = replay(p, d);
  ASSERT_TRUE(r.ok) << r.error << '\n' << describe(p);
  ASSERT_EQ(r.ops.size(), t.ops.size());
  for (size_t i = 0; i < t.ops.size(); ++i) ASSERT_EQ(g.node(r.ops[i]).key, t.ops[i].key);
}

TEST(TraceCase, LineIsOneBlockWithoutDecisions) {
  TraceGraph g;
  g.merge(line({1, 2, 3}));
  const Program p = assign_cases(g);
  ASSERT_EQ(p.at(p.root).children.size(), 1u);
  EXPECT_EQ(p.at(p.at(p.root).children[0]).ops.size(), 3u);
  EXPECT_TRUE(p.sites.empty());
  Cursor c(p);
  for (const OpRecord& r : line({1, 2, 3}).ops) {
    const Match m = c.step(r);
    ASSERT_TRUE(m.matched);
    EXPECT_TRUE(m.decisions.empty());
    EXPECT_EQ(g.node(m.node).key, r.key);
  }
  EXPECT_TRUE(c.finish().matched);
}

TEST(TraceCase, DiamondIsTwoCaseSwitch) {
  TraceGraph g;
  g.merge(line({1, 2, 4}));
  g.merge(line({1, 3, 4}));
  const Program p = assign_cases(g);
  SCOPED_TRACE(describe(p));
  const ProgNode& root = p.at(p.root);
  ASSERT_EQ(root.children.size(), 3u);
  const ProgNode& sw = p.at(root.children[1]);
  ASSERT_EQ(sw.kind, ProgKind::kSwitch);
  ASSERT_EQ(sw.case_entry.size(), 2u);  // the two control edges out of op 1; no skip case
  EXPECT_EQ(g.node(sw.case_entry[0]).key, at(2));
  EXPECT_EQ(g.node(sw.case_entry[1]).key, at(3));
  // The decision is emitted with the op that reveals the path, not before.
  Cursor c(p);
  EXPECT_TRUE(c.step(at(1), {}).decisions.empty());
  const Match m = c.step(at(3), {});
  ASSERT_EQ(m.decisions.size(), 1u);
  EXPECT_EQ(m.decisions[0], (Decision{sw.site, 1}));
  EXPECT_TRUE(c.step(at(4), {}).decisions.empty());
  EXPECT_TRUE(c.finish().matched);
}

TEST(TraceCase, IfWithoutElseHasASkipCase) {
  TraceGraph g;
  g.merge(line({1, 2, 3}));
  g.merge(line({1, 3}));
  const Program p = assign_cases(g);
  const ProgNode& sw = p.at(p.at(p.root).children[1]);
  ASSERT_EQ(sw.kind, ProgKind::kSwitch);
  EXPECT_EQ(sw.case_entry.size(), 2u);
  EXPECT_EQ(sw.case_entry[1], kNoNode);
  EXPECT_TRUE(p.at(sw.children[1]).children.empty());
  expect_replays(g, p, line({1, 3}));
  expect_replays(g, p, line({1, 2, 3}));
}

TEST(TraceCase, PathsThatEndEarlySkipTheRest) {
  TraceGraph g;
  g.merge(line({1, 2, 3}));
  g.merge(line({1}));
  g.merge(Trace{});
  const Program p = assign_cases(g);
  SCOPED_TRACE(describe(p));
  for (const auto& t : {line({1, 2, 3}), line({1}), Trace{}}) expect_replays(g, p, t);
}

TEST(TraceCase, SequentialOptionalOpsStayLinear) {
  // if c1: op1; if c2: op2; ...; if c8: op8; op9  with every combination possible. Structuring
  // by duplication would need a case tree of 2^8 leaves; here each op is one switch.
  constexpr uint64_t kN = 8;
  TraceGraph g;
  for (uint64_t i = 1; i <= kN; ++i) {
    for (uint64_t j = i + 1; j <= kN; ++j) g.merge(line({i, j, kN + 1}));
    g.merge(line({i, kN + 1}));
  }
  g.merge(line({kN + 1}));
  const Program p = assign_cases(g);
  SCOPED_TRACE(describe(p));
  EXPECT_EQ(count(p, ProgKind::kSwitch), kN);
  EXPECT_EQ(p.nodes.size(), 4 * kN + 2);  // root, per op {switch, case, block, skip}, op 9
  for (uint32_t mask = 0; mask < (1u << kN); ++mask) {
    std::vector<uint64_t> ops;
    for (uint64_t i = 1; i <= kN; ++i) {
      if (mask & (1u << (i - 1))) ops.push_back(i);
    }
    ops.push_back(kN + 1);
    const Trace t = line(ops);
    ASSERT_TRUE(g.covers(t)) << mask;
    expect_replays(g, p, t);
  }
}

TEST(TraceCase, LadderOfCrossingBranchesStaysLinear) {
  // Level i has ops x_i and y_i; from either one the path may go to x_{i+1} or y_{i+1}.
  constexpr int kLevels = 12;
  const auto x = [](int i) { return static_cast<uint64_t>(2 * i + 1); };
  const auto y = [](int i) { return static_cast<uint64_t>(2 * i + 2); };
  TraceGraph g;
  std::mt19937 rng(3);
  std::vector<Trace> traces;
  for (int k = 0; k < 4 * kLevels; ++k) {
    std::vector<uint64_t> ops;
    for (int i = 0; i < kLevels; ++i) ops.push_back(rng() % 2 ? x(i) : y(i));
    traces.push_back(line(ops));
    g.merge(traces.back());
  }
  const Program p = assign_cases(g);
  SCOPED_TRACE(describe(p));
  EXPECT_LE(p.nodes.size(), 8u * kLevels);
  for (const Trace& t : traces) expect_replays(g, p, t);
}

TEST(TraceCase, UnstructuredMergesNeedNoDuplication) {
  TraceGraph g;
  const std::vector<Trace> traces{line({1, 3, 4}), line({2, 3}), line({2, 4}), line({1, 4}),
                                  line({1, 3, 5}), line({2, 5})};
  for (const Trace& t : traces) g.merge(t);
  const Program p = assign_cases(g);
  SCOPED_TRACE(describe(g) + describe(p));
  size_t ops = 0;
  for (const ProgNode& n : p.nodes) ops += n.ops.size();
  EXPECT_EQ(ops, 5u);
  for (const Trace& t : traces) expect_replays(g, p, t);
}

TEST(TraceCase, SitesAreNumberedOncePerConstruct) {
  TraceGraph g;
  TraceRecorder r;
  r.op(at(1));
  r.enter_loop(50);
  r.op(at(2));
  r.next_iteration();
  r.op(at(2));
  r.exit_loop();
  g.merge(r.take());
  r.op(at(3));
  r.enter_loop(50);
  r.op(at(2));
  r.exit_loop();
  g.merge(r.take());
  const Program p = assign_cases(g);
  SCOPED_TRACE(describe(p));
  // Both paths merge back at the loop node (trips 2 and 1: a While): one switch, one loop-cond.
  ASSERT_EQ(p.sites.size(), 2u);
  EXPECT_EQ(p.sites[1].kind, SiteKind::kLoopCond);
  for (SiteId s = 0; s < p.sites.size(); ++s) EXPECT_EQ(p.at(p.sites[s].prog).site, s);
  EXPECT_EQ(p.sites[0].kind, SiteKind::kCaseSelect);
}

}  // namespace
}  // namespace terra::trace
