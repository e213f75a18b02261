// Data flow of a TraceGraph as the emitter needs it, without torch. The TraceGraph keeps, per
// input slot, every producer it saw (different paths and loop iterations read different ones);
// the generated graph must pick, at run time, the one that ran last on the path taken.
//
// That is a variable per distinct producer set: every producer in the set assigns it when it
// runs, the consumer reads it. The emitter turns variables into SSA values (prim::If outputs at
// merges, prim::Loop carried values in loops), so the choice costs nothing at run time. Slots that
// also saw external tensors are fed from Python: always (pure feed) or, when a producer in the
// graph may be the source instead, only on the occasions Python says so (feed_or_none).
#pragma once

#include <cstdint>
#include <vector>

#include "trace/trace_graph.h"

namespace terra::emit {

using VarId = uint32_t;
inline constexpr VarId kNoVar = UINT32_MAX;

struct SlotFlow {
  VarId var = kNoVar;  // variable the slot reads; kNoVar: only external tensors were seen
  bool feed = false;   // external tensors were seen here
};

struct ValueFlow {
  std::vector<std::vector<SlotFlow>> slots;             // [node][input slot]
  std::vector<std::vector<std::vector<VarId>>> writes;  // [node][output]: variables it assigns
  uint32_t num_vars = 0;

  const std::vector<VarId>& assigned_by(trace::NodeId n, uint32_t output) const;
};

// Linear in the total number of recorded sources.
ValueFlow analyze_value_flow(const trace::TraceGraph& graph);

}  // namespace terra::emit
