// A ChannelSource that replays one recorded iteration: the decisions a Cursor derives from the
// trace and the external tensors the trace read, slot by slot. It lets tests (and tools) run a
// generated graph without a Python program driving it, and check it against eager results.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "capture/trace_record.h"
#include "emit/captured_program.h"
#include "emit/channel.h"
#include "emit/emitted_graph.h"
#include "trace/program.h"

namespace terra::emit {

class ScriptedChannel final : public ChannelSource {
 public:
  void push_decision(const trace::Decision& d) { decisions_.push_back(d); }
  // The choice of a selected read (sites from kSelectSiteBase): one queue per site, since the
  // graph asks them between the Program's decisions.
  void push_selection(int64_t site, int64_t choice) { selections_[site].push_back(choice); }
  // An undefined tensor stands for "none" (a feed_or_none slot that read a graph value).
  void push_feed(int64_t slot, at::Tensor t) { feeds_[slot].push_back(std::move(t)); }
  // A scalar slot's next value in the channel's encoding (emitted_graph.h, ScalarUse).
  void push_scalar_bits(int64_t slot, int64_t bits) { scalars_[slot].push_back(bits); }

  int64_t case_select(int64_t site) override;
  bool loop_cond(int64_t site) override;
  at::Tensor feed(int64_t slot) override;
  double feed_scalar(int64_t slot) override;
  int64_t feed_int(int64_t slot) override;
  // Keeps a copy: the graph may update the tensor in place after Python read it.
  void fetch(int64_t slot, const at::Tensor& value) override;

  const std::vector<std::pair<int64_t, at::Tensor>>& fetched() const { return fetched_; }
  // Empty if every decision and feed was consumed, else a description of what was left.
  std::string leftovers() const;

 private:
  uint32_t take(int64_t site, const char* what);

  std::deque<trace::Decision> decisions_;
  std::unordered_map<int64_t, std::deque<int64_t>> selections_;
  std::unordered_map<int64_t, std::deque<at::Tensor>> feeds_;
  std::unordered_map<int64_t, std::deque<int64_t>> scalars_;
  std::vector<std::pair<int64_t, at::Tensor>> fetched_;
};

// What record `record` (merged into `node`) posts on the graph's scalar slots, in the channel's
// order, appended to `out` as (slot, value): a float as its bits, an int or bool as itself, a
// list as its length and then its elements (emitted_graph.h, ScalarUse). Throws
// std::runtime_error if the record passes another kind of scalar than the graph feeds.
void append_scalar_posts(const EmittedGraph& emitted, trace::NodeId node, const capture::OpRecord& record,
                         std::vector<std::pair<int64_t, int64_t>>& out);

// (site, choice) of every selected read trace `index` makes, in program order.
std::vector<std::pair<int64_t, int64_t>> selections_for_trace(const CapturedProgram& program, uint32_t index,
                                                              const trace::Program& structured,
                                                              const EmittedGraph& emitted);

// The script that makes `emitted` replay trace `index` of `program`: decisions from a Cursor over
// `structured`, the producer each selected read of the trace read, and per feed slot the external tensors `captured` (the capture trace the index
// was built from) read there, taken from `externals` (indexed like captured.externals).
// Throws std::runtime_error if the program does not accept the trace.
ScriptedChannel script_for_trace(const CapturedProgram& program, uint32_t index, const trace::Program& structured,
                                 const EmittedGraph& emitted, const capture::Trace& captured,
                                 std::span<const at::Tensor> externals);

}  // namespace terra::emit
