// OpCheckPlan: see op_check_plan.h.
#include "runtime/op_check_plan.h"

#include <algorithm>

namespace terra::runtime {

const OpCheckPlan::Node OpCheckPlan::kNone{};
const OpCheckPlan::Input OpCheckPlan::kNoInput{};

OpCheckPlan::OpCheckPlan(const emit::EmittedGraph& emitted) {
  // Every node the tables name, and per node the inputs they name (node, input keys: key()).
  size_t num_nodes = emitted.node_publishes.size();
  std::unordered_map<trace::NodeId, uint32_t> inputs_of;  // node -> highest input named + 1
  auto name_input = [&](uint64_t key) {
    const auto node = static_cast<trace::NodeId>(key >> 32);
    const auto input = static_cast<uint32_t>(key & 0xffffffffu);
    uint32_t& n = inputs_of[node];
    n = std::max(n, input + 1);
    num_nodes = std::max<size_t>(num_nodes, static_cast<size_t>(node) + 1);
  };
  for (const auto& [key, slot] : emitted.feed_index) name_input(key);
  for (const auto& [key, per_copy] : emitted.checked_reads) name_input(key);
  for (const auto& [key, per_copy] : emitted.selected_reads) name_input(key);
  auto name_node = [&](trace::NodeId n) { num_nodes = std::max<size_t>(num_nodes, static_cast<size_t>(n) + 1); };
  for (const auto& [n, why] : emitted.unsupported) name_node(n);
  for (const auto& [n, uses] : emitted.node_scalars) name_node(n);
  for (const auto& [n, generators] : emitted.node_generators) name_node(n);

  nodes_.resize(num_nodes);
  for (size_t n = 0; n < num_nodes; ++n) {
    Node& node = nodes_[n];
    node.emitted = n < emitted.node_publishes.size() && emitted.node_publishes[n] > 0;
    node.gated = n < emitted.node_gated.size() && emitted.node_gated[n] != 0;
    const auto named = inputs_of.find(static_cast<trace::NodeId>(n));
    if (named == inputs_of.end()) continue;
    node.first_input = static_cast<uint32_t>(inputs_.size());
    node.num_inputs = named->second;
    inputs_.resize(inputs_.size() + named->second);
  }
  for (const auto& [key, slot] : emitted.feed_index)
    inputs_[nodes_[key >> 32].first_input + (key & 0xffffffffu)].feed = slot;
  for (const auto& [key, per_copy] : emitted.checked_reads)
    inputs_[nodes_[key >> 32].first_input + (key & 0xffffffffu)].checked = flatten(per_copy, checked_copies_);
  for (const auto& [key, per_copy] : emitted.selected_reads)
    inputs_[nodes_[key >> 32].first_input + (key & 0xffffffffu)].selected = flatten(per_copy, selected_copies_);
  for (const auto& [n, why] : emitted.unsupported) nodes_[n].unsupported = &why;
  for (const auto& [n, uses] : emitted.node_scalars) nodes_[n].scalars = &uses;
  for (const auto& [n, generators] : emitted.node_generators) nodes_[n].generators = &generators;
}

}  // namespace terra::runtime
