// How long the TraceGraph core takes on iteration-sized traces, and that it scales linearly:
// merging must stay far below one training step (target: 10k ops in well under a second).
//
// Per trace length n, each column is the median of 5 runs on fresh objects:
//   merge    first trace, n distinct ops (every node is new)
//   branchy  a second trace that takes a different op every 100 ops and merges back after it
//   loop     a trace that is one loop of n/10 iterations of a 10-op body with an if inside
//   covers   the coverage check of the branchy trace
//   assign   case assignment of the two-trace graph
//   cursor   the runtime Cursor over the branchy trace (decisions included)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

#include "trace/case_assignment.h"
#include "trace/replay.h"
#include "trace/trace_graph.h"
#include "trace/trace_recorder.h"

using namespace terra::trace;

namespace {

OpKey key(uint64_t location) { return OpKey{location % 97, location % 13, location}; }

Trace straight(size_t n, bool branchy) {
  TraceRecorder r;
  for (size_t i = 0; i < n; ++i) {
    const bool other = branchy && i % 100 == 50;
    std::vector<ValueRef> in;
    if (i > 0) in.push_back(ValueRef::output_of(static_cast<uint32_t>(i - 1)));
    r.op(key(other ? 10'000'000 + i : i), std::move(in));
  }
  return r.take();
}

Trace looped(size_t n) {
  TraceRecorder r;
  r.enter_loop(1);
  for (size_t i = 0; i < n; ++i) {
    if (i > 0 && i % 10 == 0) r.next_iteration();
    const size_t body = i % 10;
    r.op(key(body == 5 && (i / 10) % 3 == 0 ? 100 : body));
  }
  r.exit_loop();
  return r.take();
}

double median_ms(const std::function<void()>& setup, const std::function<void()>& work) {
  std::vector<double> ms;
  for (int run = 0; run < 5; ++run) {
    setup();
    const auto t0 = std::chrono::steady_clock::now();
    work();
    const auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[2];
}

}  // namespace

int main() {
  std::printf("%8s %10s %10s %10s %10s %10s %10s\n", "ops", "merge ms", "branchy ms", "loop ms",
              "covers ms", "assign ms", "cursor ms");
  for (const size_t n : {size_t{1'000}, size_t{10'000}, size_t{100'000}}) {
    const Trace a = straight(n, false);
    const Trace b = straight(n, true);
    const Trace c = looped(n);
    TraceGraph* g = nullptr;
    std::vector<TraceGraph> keep;
    const auto fresh = [&] {
      keep.clear();
      keep.emplace_back();
      g = &keep.back();
    };
    const double merge = median_ms(fresh, [&] { g->merge(a); });
    const double branchy = median_ms([&] { fresh(); g->merge(a); }, [&] { g->merge(b); });
    const double loop = median_ms(fresh, [&] { g->merge(c); });
    fresh();
    g->merge(a);
    g->merge(b);
    bool covered = false;
    const double covers = median_ms([] {}, [&] { covered = g->covers(b); });
    Program p;
    const double assign = median_ms([] {}, [&] { p = assign_cases(*g); });
    std::vector<Decision> d;
    bool decided = false;
    const double cursor = median_ms([] {}, [&] { decided = decisions_for(p, b, d); });
    if (!covered || !decided) {
      std::fprintf(stderr, "benchmark trace not covered\n");
      return 1;
    }
    std::printf("%8zu %10.2f %10.2f %10.2f %10.2f %10.2f %10.2f\n", n, merge, branchy, loop, covers,
                assign, cursor);
  }
  return 0;
}
