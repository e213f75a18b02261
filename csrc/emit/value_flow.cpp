// Builds the variables of value_flow.h: one per distinct set of producers feeding some slot.
#include "emit/value_flow.h"

#include <algorithm>
#include <map>
#include <utility>

namespace terra::emit {

namespace {
const std::vector<VarId> kNone;
}

const std::vector<VarId>& ValueFlow::assigned_by(trace::NodeId n, uint32_t output) const {
  if (n >= writes.size() || output >= writes[n].size()) return kNone;
  return writes[n][output];
}

ValueFlow analyze_value_flow(const trace::TraceGraph& graph) {
  using Producer = std::pair<trace::NodeId, uint32_t>;
  ValueFlow flow;
  const size_t n = graph.num_nodes();
  flow.slots.resize(n);
  flow.writes.resize(n);
  std::map<std::vector<Producer>, VarId> vars;
  std::vector<Producer> set;
  for (trace::NodeId id = 0; id < n; ++id) {
    const trace::Node& node = graph.node(id);
    if (node.kind != trace::NodeKind::kOp) continue;
    flow.slots[id].resize(node.inputs.size());
    for (size_t s = 0; s < node.inputs.size(); ++s) {
      SlotFlow& slot = flow.slots[id][s];
      set.clear();
      for (const trace::Source& src : node.inputs[s]) {
        if (src.kind == trace::Source::Kind::kFeed) {
          slot.feed = true;
        } else {
          set.emplace_back(src.id, src.output);  // loop-carried or not: the same producer
        }
      }
      if (set.empty()) continue;
      std::sort(set.begin(), set.end());
      set.erase(std::unique(set.begin(), set.end()), set.end());
      const auto [it, inserted] = vars.try_emplace(set, flow.num_vars);
      if (inserted) {
        ++flow.num_vars;
        for (const auto& [producer, output] : set) {
          auto& outs = flow.writes[producer];
          if (outs.size() <= output) outs.resize(output + 1);
          outs[output].push_back(it->second);
        }
      }
      slot.var = it->second;
    }
  }
  return flow;
}

}  // namespace terra::emit
