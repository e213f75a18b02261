// ScriptedChannel and the script of a recorded trace.
#include "emit/scripted_channel.h"

#include <cstring>

#include <algorithm>
#include <stdexcept>

#include "emit/value_flow.h"
#include "trace/replay.h"

namespace terra::emit {

uint32_t ScriptedChannel::take(int64_t site, const char* what) {
  TORCH_CHECK(!decisions_.empty(), "terra_torch: scripted channel ran out of decisions at ", what, " site ", site);
  const trace::Decision d = decisions_.front();
  TORCH_CHECK(static_cast<int64_t>(d.site) == site, "terra_torch: graph asked ", what, " site ", site,
              " but the script's next decision is for site ", d.site);
  decisions_.pop_front();
  return d.value;
}

int64_t ScriptedChannel::case_select(int64_t site) {
  if (site < kSelectSiteBase) return take(site, "case_select");
  auto& q = selections_[site];
  TORCH_CHECK(!q.empty(), "terra_torch: scripted channel has no choice for selected read site ", site);
  const int64_t v = q.front();
  q.pop_front();
  return v;
}

bool ScriptedChannel::loop_cond(int64_t site) { return take(site, "loop_cond") == trace::kLoopContinue; }

at::Tensor ScriptedChannel::feed(int64_t slot) {
  auto it = feeds_.find(slot);
  TORCH_CHECK(it != feeds_.end() && !it->second.empty(), "terra_torch: scripted channel has no tensor for feed slot ",
              slot);
  at::Tensor t = std::move(it->second.front());
  it->second.pop_front();
  return t;
}

void ScriptedChannel::fetch(int64_t slot, const at::Tensor& value) { fetched_.emplace_back(slot, value.clone()); }

std::string ScriptedChannel::leftovers() const {
  std::string out;
  if (!decisions_.empty()) out += std::to_string(decisions_.size()) + " decisions; ";
  for (const auto& [site, q] : selections_)
    if (!q.empty()) out += std::to_string(q.size()) + " choices of selected read site " + std::to_string(site) + "; ";
  for (const auto& [slot, q] : feeds_)
    if (!q.empty()) out += std::to_string(q.size()) + " feeds of slot " + std::to_string(slot) + "; ";
  return out;
}

int64_t ScriptedChannel::feed_int(int64_t slot) {
  auto& q = scalars_[slot];
  if (q.empty()) throw std::runtime_error("terra_torch: scripted channel has no value for scalar slot " + std::to_string(slot));
  const int64_t v = q.front();
  q.pop_front();
  return v;
}

double ScriptedChannel::feed_scalar(int64_t slot) {
  const int64_t bits = feed_int(slot);
  double v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

std::vector<std::pair<int64_t, int64_t>> selections_for_trace(const CapturedProgram& program, uint32_t index,
                                                              const trace::Program& structured,
                                                              const EmittedGraph& emitted) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (emitted.selected_reads.empty()) return out;
  const trace::Trace& t = program.trace(index);
  const auto& nodes = program.record_nodes(index);
  const std::vector<CopyIndex> copies = record_copies(program.graph(), structured, t, nodes);
  for (size_t r = 0; r < t.ops.size(); ++r) {
    for (uint32_t s = 0; s < t.ops[r].inputs.size(); ++s) {
      const auto sel = emitted.selected_reads.find(EmittedGraph::key(nodes[r], s));
      if (sel == emitted.selected_reads.end()) continue;
      const auto choice = sel->second.find(EmittedGraph::copy_hash(copies[r]));
      if (choice == sel->second.end()) continue;
      const trace::ValueRef& in = t.ops[r].inputs[s];
      int64_t j = 0;  // a feed: the graph takes the fed tensor whatever it picks
      if (in.kind == trace::ValueRef::Kind::kOutput) {
        j = choice->second.index_of(nodes[in.index], in.output, EmittedGraph::copy_hash(copies[in.index]));
        if (j < 0)
          throw std::logic_error("terra_torch: record " + std::to_string(r) + " reads a producer its selected read lacks");
      }
      out.emplace_back(choice->second.site, j);
    }
  }
  return out;
}

void append_scalar_posts(const EmittedGraph& emitted, trace::NodeId node, const capture::OpRecord& record,
                         std::vector<std::pair<int64_t, int64_t>>& out) {
  const auto uses = emitted.node_scalars.find(node);
  if (uses == emitted.node_scalars.end()) return;
  std::vector<int64_t> bits;
  for (const auto& use : uses->second) {
    if (use.slot < 0) continue;  // baked in
    bits.clear();
    if (!scalar_bits(record.attributes.at(use.attribute), use.kind, bits))
      throw std::runtime_error("terra_torch: " + record.op.operator_name().name +
                               " passes another kind of scalar than the graph feeds");
    if (EmittedGraph::is_list(use.kind)) out.emplace_back(use.slot, static_cast<int64_t>(bits.size()));
    for (const int64_t b : bits) out.emplace_back(use.slot, b);
  }
}

ScriptedChannel script_for_trace(const CapturedProgram& program, uint32_t index, const trace::Program& structured,
                                 const EmittedGraph& emitted, const capture::Trace& captured,
                                 std::span<const at::Tensor> externals) {
  ScriptedChannel script;
  std::vector<trace::Decision> decisions;
  if (!trace::decisions_for(structured, program.trace(index), decisions))
    throw std::runtime_error("terra_torch: the generated program does not accept trace " + std::to_string(index));
  for (const trace::Decision& d : decisions) script.push_decision(d);

  const auto& nodes = program.record_nodes(index);
  if (captured.ops.size() != nodes.size())
    throw std::invalid_argument("terra_torch: capture trace does not match trace " + std::to_string(index));
  for (const auto& [site, choice] : selections_for_trace(program, index, structured, emitted))
    script.push_selection(site, choice);
  std::vector<std::pair<int64_t, int64_t>> scalars;
  for (size_t i = 0; i < captured.ops.size(); ++i) {
    scalars.clear();
    append_scalar_posts(emitted, nodes[i], captured.ops[i], scalars);
    for (const auto& [slot, value] : scalars) script.push_scalar_bits(slot, value);
    uint32_t s = 0;  // slot numbering skips inputs that stand for None, as the translation does
    for (const capture::OpInput& input : captured.ops[i].inputs) {
      if (is_none_input(captured, input)) continue;
      const int64_t slot = emitted.feed_slot(nodes[i], s++);
      const capture::ValueRef& v = input.value;
      if (slot < 0) {
        if (v.is_external())
          throw std::logic_error("terra_torch: record " + std::to_string(i) + " reads an external tensor at input " +
                                 std::to_string(s - 1) + " but the graph has no feed there");
        continue;
      }
      if (!v.is_external()) {
        script.push_feed(slot, at::Tensor());
      } else {
        if (static_cast<size_t>(v.external) >= externals.size())
          throw std::invalid_argument("terra_torch: external " + std::to_string(v.external) + " was not supplied");
        script.push_feed(slot, externals[v.external]);
      }
    }
  }
  return script;
}

}  // namespace terra::emit
