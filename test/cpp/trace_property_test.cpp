// Property test: random structured programs (nested if/else, loops with fixed or varying trip
// counts, sequences), random executions of them. From some executions a TraceGraph is built;
// then every collected trace must be covered and, driven by the decisions the Cursor derives
// from it, the case-assigned program must replay exactly its ops. Uncollected executions and
// mutated traces must be rejected exactly at their first deviating op, which an independent
// oracle computes from the collected traces alone (valid when every op has its own location:
// then the TraceGraph has one node per location and loop per loop level).
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "trace/case_assignment.h"
#include "trace/cursor.h"
#include "trace/describe.h"
#include "trace/replay.h"
#include "trace/trace_graph.h"
#include "trace/trace_recorder.h"

namespace terra::trace {
namespace {

constexpr size_t kNotFound = SIZE_MAX;

// ---- random structured programs --------------------------------------------------------

struct Stmt {
  enum Kind { kOp, kIf, kLoop } kind = kOp;
  OpKey key;
  double p_then = 0.5;
  std::vector<Stmt> body;       // then-branch, or loop body
  std::vector<Stmt> else_body;
  uint64_t loop_id = 0;
  uint32_t min_trips = 0;
  uint32_t max_trips = 0;
};

class ProgramGen {
 public:
  ProgramGen(std::mt19937_64& rng, bool share_locations) : rng_(rng), share_(share_locations) {}

  std::vector<Stmt> block(int depth) {
    std::vector<Stmt> out;
    const int n = depth == 0 ? pick(3, 8) : pick(1, 4);
    for (int i = 0; i < n; ++i) {
      const double r = unit();
      Stmt s;
      if (depth < 4 && r < 0.22) {
        s.kind = Stmt::kIf;
        s.p_then = 0.2 + 0.6 * unit();
        s.body = block(depth + 1);
        if (unit() < 0.7) s.else_body = block(depth + 1);
      } else if (depth < 3 && r < 0.36) {
        s.kind = Stmt::kLoop;
        s.loop_id = next_loop_++;
        if (unit() < 0.5) {
          s.min_trips = s.max_trips = static_cast<uint32_t>(pick(1, 3));
        } else {
          s.min_trips = static_cast<uint32_t>(pick(0, 1));
          s.max_trips = static_cast<uint32_t>(pick(2, 4));
        }
        s.body = block(depth + 1);
      } else {
        s.kind = Stmt::kOp;
        if (share_ && !made_.empty() && unit() < 0.15) {
          s.key = made_[static_cast<size_t>(pick(0, static_cast<int>(made_.size()) - 1))];
        } else {
          s.key = OpKey{static_cast<uint64_t>(pick(0, 4)), static_cast<uint64_t>(pick(0, 2)),
                        next_location_++};
          made_.push_back(s.key);
        }
      }
      out.push_back(std::move(s));
    }
    return out;
  }

 private:
  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  double unit() { return std::uniform_real_distribution<double>(0, 1)(rng_); }

  std::mt19937_64& rng_;
  bool share_;
  uint64_t next_location_ = 1;
  uint64_t next_loop_ = 1000;
  std::vector<OpKey> made_;
};

class Executor {
 public:
  explicit Executor(std::mt19937_64& rng) : rng_(rng) {}

  Trace run(const std::vector<Stmt>& program) {
    exec(program);
    return r_.take();
  }

 private:
  void exec(const std::vector<Stmt>& b) {
    for (const Stmt& s : b) {
      if (r_.size() > 300) return;  // keep traces of deep loop nests small
      switch (s.kind) {
        case Stmt::kOp: {
          std::vector<ValueRef> in;
          if (r_.size() > 0 && coin(0.8)) {
            const size_t back = pick_size(0, std::min<size_t>(r_.size() - 1, 4));
            in.push_back(ValueRef::output_of(static_cast<uint32_t>(r_.size() - 1 - back)));
          } else {
            in.push_back(ValueRef::feed(static_cast<uint32_t>(pick(0, 2))));
          }
          const uint32_t rec = r_.op(s.key, std::move(in));
          if (coin(0.05)) r_.fetch(rec);
          break;
        }
        case Stmt::kIf:
          exec(coin(s.p_then) ? s.body : s.else_body);
          break;
        case Stmt::kLoop: {
          const int trips = pick(static_cast<int>(s.min_trips), static_cast<int>(s.max_trips));
          r_.enter_loop(s.loop_id);
          for (int t = 0; t < trips; ++t) {
            if (t > 0) r_.next_iteration();
            exec(s.body);
          }
          r_.exit_loop();
          break;
        }
      }
    }
  }
  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  size_t pick_size(size_t lo, size_t hi) {
    return std::uniform_int_distribution<size_t>(lo, hi)(rng_);
  }
  bool coin(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  std::mt19937_64& rng_;
  TraceRecorder r_;
};

// ---- the independent oracle --------------------------------------------------------------

// A trace parsed into its loop structure: at each level, a sequence of ops and loop instances.
struct Elem {
  bool loop = false;
  OpKey key;          // op
  uint64_t loop_id = 0;
  size_t first = 0;   // index of its first record
  size_t end = 0;     // index after its last record
  std::vector<std::vector<Elem>> iterations;
  std::vector<std::pair<size_t, size_t>> iteration_ranges;
};

std::vector<Elem> parse(const Trace& t, size_t b, size_t e, size_t depth) {
  std::vector<Elem> out;
  size_t i = b;
  while (i < e) {
    const OpRecord& r = t.ops[i];
    Elem el;
    el.first = i;
    if (r.loops.size() == depth) {
      el.key = r.key;
      el.end = ++i;
      out.push_back(std::move(el));
      continue;
    }
    el.loop = true;
    el.loop_id = r.loops[depth].loop_id;
    size_t j = i;
    uint32_t it = r.loops[depth].iteration;
    size_t iter_begin = i;
    while (j < e && t.ops[j].loops.size() > depth && t.ops[j].loops[depth].loop_id == el.loop_id &&
           t.ops[j].loops[depth].iteration >= it) {
      if (t.ops[j].loops[depth].iteration != it) {
        el.iteration_ranges.push_back({iter_begin, j});
        iter_begin = j;
        it = t.ops[j].loops[depth].iteration;
      }
      ++j;
    }
    el.iteration_ranges.push_back({iter_begin, j});
    for (const auto& [a, c] : el.iteration_ranges) {
      el.iterations.push_back(parse(t, a, c, depth + 1));
    }
    el.end = j;
    i = j;
    out.push_back(std::move(el));
  }
  return out;
}

class Oracle {
 public:
  void learn(const Trace& t) { learn_seq(parse(t, 0, t.ops.size(), 0), kRoot); }

  // Index of the first op that the TraceGraph of the learned traces must reject; t.ops.size()
  // for a deviation at the very end; kNotFound when the trace is accepted.
  size_t first_deviation(const Trace& t) const {
    return check_seq(parse(t, 0, t.ops.size(), 0), kRoot, t.ops.size());
  }

 private:
  using Id = std::tuple<int, uint64_t, uint64_t, uint64_t>;
  static constexpr uint64_t kRoot = UINT64_MAX;
  static Id start() { return {0, 0, 0, 0}; }
  static Id finish() { return {1, 0, 0, 0}; }
  static Id id(const Elem& e) {
    return e.loop ? Id{2, e.loop_id, 0, 0} : Id{3, e.key.op, e.key.attrs, e.key.location};
  }

  void learn_seq(const std::vector<Elem>& seq, uint64_t scope) {
    Id prev = start();
    for (const Elem& e : seq) {
      pairs_[scope].insert({prev, id(e)});
      if (e.loop) {
        trips_[e.loop_id].insert(e.iterations.size());
        for (const auto& it : e.iterations) learn_seq(it, e.loop_id);
      }
      prev = id(e);
    }
    pairs_[scope].insert({prev, finish()});
  }

  bool seen(uint64_t scope, const Id& a, const Id& b) const {
    const auto it = pairs_.find(scope);
    return it != pairs_.end() && it->second.count({a, b}) > 0;
  }

  // Checks run in the order of the indices they blame, so the first failure is the earliest.
  size_t check_seq(const std::vector<Elem>& seq, uint64_t scope, size_t seq_end) const {
    Id prev = start();
    for (const Elem& e : seq) {
      if (!seen(scope, prev, id(e))) return e.first;
      if (e.loop) {
        const auto tr = trips_.find(e.loop_id);
        const size_t fixed = tr != trips_.end() && tr->second.size() == 1 ? *tr->second.begin() : 0;
        for (size_t k = 0; k < e.iterations.size(); ++k) {
          if (fixed && k >= fixed) return e.iteration_ranges[k].first;
          const size_t bad = check_seq(e.iterations[k], e.loop_id, e.iteration_ranges[k].second);
          if (bad != kNotFound) return bad;
        }
        if (fixed && e.iterations.size() != fixed) return e.end;
      }
      prev = id(e);
    }
    return seen(scope, prev, finish()) ? kNotFound : seq_end;
  }

  std::map<uint64_t, std::set<std::pair<Id, Id>>> pairs_;
  std::map<uint64_t, std::set<size_t>> trips_;
};

// ---- the checks ----------------------------------------------------------------------------

// Where the Cursor rejects the trace: index of the failing step, ops.size() if only finish()
// fails, kNotFound if accepted.
size_t cursor_rejects_at(const Program& p, const Trace& t) {
  Cursor c(p);
  for (size_t i = 0; i < t.ops.size(); ++i) {
    if (!c.step(t.ops[i]).matched) return i;
  }
  return c.finish().matched ? kNotFound : t.ops.size();
}

size_t coverage_rejects_at(const TraceGraph& g, const Trace& t) {
  const Coverage cov = g.coverage(t);
  return cov.covered ? kNotFound : cov.first_uncovered;
}

void expect_replays(const TraceGraph& g, const Program& p, const Trace& t) {
  std::vector<Decision> d;
  ASSERT_TRUE(decisions_for(p, t, d));
  const ReplayResult r = replay(p, d);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(r.ops.size(), t.ops.size());
  for (size_t i = 0; i < t.ops.size(); ++i) {
    ASSERT_EQ(g.node(r.ops[i]).key, t.ops[i].key) << "op " << i;
  }
}

// Every op and loop node appears exactly once in the program.
void expect_each_node_once(const TraceGraph& g, const Program& p) {
  std::vector<int> seen(g.num_nodes(), 0);
  for (const ProgNode& n : p.nodes) {
    for (const NodeId op : n.ops) ++seen[op];
    if (n.kind == ProgKind::kWhile || n.kind == ProgKind::kUnrolled) ++seen[n.loop];
    if (n.kind == ProgKind::kSwitch) {
      EXPECT_GE(n.children.size(), 2u);
    }
  }
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    const NodeKind k = g.node(i).kind;
    EXPECT_EQ(seen[i], (k == NodeKind::kOp || k == NodeKind::kLoop) ? 1 : 0) << "node " << i;
  }
}

Trace mutate(const Trace& t, std::mt19937_64& rng, uint64_t fresh_location) {
  Trace m = t;
  m.fetches.clear();
  for (OpRecord& r : m.ops) r.inputs.clear();
  if (m.ops.empty()) {
    m.ops.push_back(OpRecord{OpKey{0, 0, fresh_location}, {}, {}, 1});
    return m;
  }
  const size_t i = std::uniform_int_distribution<size_t>(0, m.ops.size() - 1)(rng);
  switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
    case 0: {  // an op the program never issued
      OpRecord fresh = m.ops[i];
      fresh.key = OpKey{0, 0, fresh_location};
      m.ops.insert(m.ops.begin() + static_cast<long>(i), fresh);
      break;
    }
    case 1:
      m.ops.erase(m.ops.begin() + static_cast<long>(i));
      break;
    case 2:
      m.ops.insert(m.ops.begin() + static_cast<long>(i), m.ops[i]);
      break;
    default:
      if (i + 1 < m.ops.size()) std::swap(m.ops[i], m.ops[i + 1]);
      break;
  }
  return m;
}

struct Stats {
  size_t ops = 0, max_ops = 0, nodes = 0;
  size_t programs = 0, collected = 0, probes = 0, rejected = 0, unrolled = 0, whiles = 0,
         switches = 0;
};

void run_program(uint64_t seed, bool share_locations, Stats& stats) {
  SCOPED_TRACE("seed " + std::to_string(seed) + (share_locations ? " shared" : " unique"));
  std::mt19937_64 rng(seed);
  ProgramGen gen(rng, share_locations);
  const std::vector<Stmt> program = gen.block(0);
  Executor exec(rng);

  TraceGraph g;
  Oracle oracle;
  std::vector<Trace> collected;
  const int n = std::uniform_int_distribution<int>(1, 6)(rng);
  for (int i = 0; i < n; ++i) {
    collected.push_back(exec.run(program));
    g.merge(collected.back());
    oracle.learn(collected.back());
  }
  ASSERT_TRUE(g.order_is_topological());
  const Program p = assign_cases(g);
  SCOPED_TRACE(describe(g) + describe(p));
  expect_each_node_once(g, p);
  for (const ProgNode& pn : p.nodes) {
    stats.unrolled += pn.kind == ProgKind::kUnrolled;
    stats.whiles += pn.kind == ProgKind::kWhile;
    stats.switches += pn.kind == ProgKind::kSwitch;
  }
  for (const Trace& t : collected) {
    ASSERT_TRUE(g.covers(t));
    ASSERT_EQ(cursor_rejects_at(p, t), kNotFound);
    if (!share_locations) ASSERT_EQ(oracle.first_deviation(t), kNotFound);
    expect_replays(g, p, t);
    ++stats.collected;
    stats.ops += t.ops.size();
    stats.max_ops = std::max(stats.max_ops, t.ops.size());
  }
  std::vector<Trace> probes;
  for (int i = 0; i < 4; ++i) probes.push_back(exec.run(program));
  for (size_t i = 0; i < 4; ++i) {
    probes.push_back(mutate(collected[i % collected.size()], rng, 999999));
  }
  for (const Trace& t : probes) {
    const size_t by_cursor = cursor_rejects_at(p, t);
    ASSERT_EQ(coverage_rejects_at(g, t), by_cursor);
    if (!share_locations) ASSERT_EQ(oracle.first_deviation(t), by_cursor);
    if (by_cursor == kNotFound) {
      expect_replays(g, p, t);
    } else {
      ++stats.rejected;
    }
    ++stats.probes;
  }
  ++stats.programs;
  stats.nodes += g.num_nodes();
}

TEST(TraceProperty, RandomProgramsUniqueLocations) {
  Stats stats;
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    run_program(seed, false, stats);
    if (HasFatalFailure()) return;
  }
  // The generator must actually exercise what the test is about.
  EXPECT_GT(stats.rejected, stats.probes / 4);
  EXPECT_GT(stats.unrolled, 20u);
  EXPECT_GT(stats.whiles, 20u);
  EXPECT_GT(stats.switches, 50u);
  std::cout << "programs " << stats.programs << ", collected traces " << stats.collected
            << ", probes " << stats.probes << " (rejected " << stats.rejected << "), switches "
            << stats.switches << ", whiles " << stats.whiles << ", unrolled " << stats.unrolled
            << ", ops per trace " << stats.ops / stats.collected << " (max " << stats.max_ops
            << "), nodes per graph " << stats.nodes / stats.programs << '\n';
}

TEST(TraceProperty, RandomProgramsSharedLocations) {
  Stats stats;
  for (uint64_t seed = 1001; seed <= 1150; ++seed) {
    run_program(seed, true, stats);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(stats.rejected, 0u);
}

}  // namespace
}  // namespace terra::trace
