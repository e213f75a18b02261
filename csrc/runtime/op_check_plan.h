// What the per-op check (runtime/op_check.cpp) asks of the emitted graph about one TraceGraph
// node and each of its inputs, gathered once per graph into flat arrays: a read-only plan,
// apart from the PythonRunner's per-iteration state.
//
// The emitter hands its facts over as hash maps keyed by node or by (node, input)
// (emit/emitted_graph.h), which is the right shape for building them. The check asked four to
// six of those maps per op (an unordered_map find hashes, divides by the bucket count and
// follows a chain); here one index gives the node's entry and one more each input's.
//
// Example: node 12 reads a parameter (input 1, fed through feed slot 3) and a value the graph
// computed (input 0, a checked read), and takes a Python float that varied in the traces:
//
//   plan.node(12) = {emitted, not gated, scalars -> [ScalarUse{attribute 0, slot 5, kFloat}], ...}
//   plan.input(plan.node(12), 0) = {feed -1, checked -> {copy -> producers}, selected none}
//   plan.input(plan.node(12), 1) = {feed 3, ...}
//   plan.input(plan.node(12), 7) = {feed -1, none, none}  (beyond the inputs the tables name)
//
// An input's checked and selected reads are per copy of an unrolled loop (0 outside one). Most
// inputs have one or a few copies, so each input's (copy, entry) pairs lie side by side in one
// array and are scanned (checked_at, selected_at): a find in the emitter's per-copy map, a
// modulo by its bucket count and a chain to follow, was half of validate()'s own samples on the
// quick suite's gpt (perf, 1.8% of the Python thread).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "emit/emitted_graph.h"
#include "trace/node.h"

namespace terra::runtime {

class OpCheckPlan {
 public:
  using Producers = std::vector<emit::EmittedGraph::ReadProducer>;
  // An input's entries, one per copy it was seen in: `count` (copy, entry) pairs from `first` in
  // one of the plan's flat arrays.
  struct Copies {
    uint32_t first = 0, count = 0;
  };
  struct Input {
    int64_t feed = -1;  // the feed slot of this input (EmittedGraph::feed_slot)
    Copies checked;     // EmittedGraph::checked_reads of this input (count 0: not a checked read)
    Copies selected;    // EmittedGraph::selected_reads of this input
  };
  struct Node {
    bool emitted = false;  // the graph has the node (it publishes an output or is a side effect)
    bool gated = false;    // Python posts its gate (EmittedGraph::node_gated)
    const std::string* unsupported = nullptr;  // why the graph cannot run it (EmittedGraph::unsupported)
    const std::vector<emit::EmittedGraph::ScalarUse>* scalars = nullptr;
    const std::vector<std::pair<uint32_t, const void*>>* generators = nullptr;
    uint32_t first_input = 0;  // its inputs in inputs_
    uint32_t num_inputs = 0;
  };

  // `emitted` must outlive the plan (its maps' entries are pointed to).
  explicit OpCheckPlan(const emit::EmittedGraph& emitted);

  const Node& node(trace::NodeId n) const { return n < nodes_.size() ? nodes_[n] : kNone; }
  const Input& input(const Node& node, uint32_t slot) const {
    return slot < node.num_inputs ? inputs_[node.first_input + slot] : kNoInput;
  }
  // The producers a checked read of `input` may come from in copy `copy`; null if the emitter
  // saw no read of it in that copy (or the input is not a checked read).
  const Producers* checked_at(const Input& input, uint64_t copy) const {
    return find_copy(checked_copies_, input.checked, copy);
  }
  // The selection the graph makes at `input` in copy `copy`, if any.
  const emit::EmittedGraph::Selection* selected_at(const Input& input, uint64_t copy) const {
    return find_copy(selected_copies_, input.selected, copy);
  }

 private:
  template <typename T>
  using Flat = std::vector<std::pair<uint64_t, const T*>>;
  template <typename T>
  static const T* find_copy(const Flat<T>& all, Copies copies, uint64_t copy) {
    for (uint32_t i = copies.first; i < copies.first + copies.count; ++i)
      if (all[i].first == copy) return all[i].second;
    return nullptr;
  }
  // Appends an emitter map's (copy -> entry) pairs to `all`; where they lie.
  template <typename T>
  static Copies flatten(const std::unordered_map<uint64_t, T>& per_copy, Flat<T>& all) {
    const Copies copies{static_cast<uint32_t>(all.size()), static_cast<uint32_t>(per_copy.size())};
    for (const auto& [copy, entry] : per_copy) all.emplace_back(copy, &entry);
    return copies;
  }

  static const Node kNone;
  static const Input kNoInput;
  std::vector<Node> nodes_;
  std::vector<Input> inputs_;
  Flat<Producers> checked_copies_;
  Flat<emit::EmittedGraph::Selection> selected_copies_;
};

}  // namespace terra::runtime
