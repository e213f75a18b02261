// Data flow of a TraceGraph as the emitter needs it, without torch.
//
// The generated graph must give each op input the value the recorded traces gave it. Op nodes
// are emitted once per *copy*: once, or once per iteration of each unrolled loop around them; a
// copy is named by the trip indices of those unrolled loops (outermost first). From the traces
// we know, for every consumer copy and input slot, which producer copies it read (different
// paths can read different ones). That set is a *variable*: every producer copy in it assigns
// the variable when it runs, and the consumer reads it, i.e. it reads whichever ran last on the
// path taken. The emitter turns variables into SSA values (prim::If outputs at merges,
// prim::Loop carried values), so the choice costs nothing at run time.
//
// Copy-level sets matter for unrolled loops: `for p in params: s.append(zeros_like(p))` followed
// by `for p, z in zip(params, s): ...` reads copy i of zeros_like in copy i of the second loop,
// which "the last zeros_like that ran" would get wrong. Inside prim::Loop (a trip count that
// varies) iterations share one copy, so such a pairing cannot be expressed (graph_emitter.h).
//
// Inside prim::Loop the variable holds only the latest iteration's value. A read of an earlier
// iteration's value after later iterations ran (backward ops reading each iteration's forward
// activations) cannot be served that way: such reads are found here (stale_loops) and the
// emitter's caller flattens those loops (CapturedProgram::flatten), which turns each iteration
// into its own copy of the body, with a switch where the trip count varies.
//
// "Whichever ran last" is not always the one read: two producers of a set can both run on a path
// that reads the earlier one (the optimizer's loop over parameters reads parameter k's gradient
// at position i, and which parameter sits at position i depends on which experts ran; autograd
// accumulates a gradient in place into whichever operand its reference counts allowed). Where a
// trace shows that, the read is *selected*: each producer also assigns a variable of its own,
// and the graph picks among them by a decision Python posts (it knows the producer it read).
//
// A set that names copies of nodes inside unrolled loops is *widened* to every copy of those
// nodes when each trace's read there was the latest execution of any of their copies: a
// variable the program reassigns in a loop (`x = x + layer(x)` with layers skipped at random)
// then reads the right copy on paths whose combination of copies no trace showed. Where a trace
// contradicts that (backward ops reading the activations of one particular layer), the set keeps
// its exact copies. Either way the PythonRunner checks at run time that Python read the copy the
// graph reads (EmittedGraph::checked_reads): an accepted path never reads another copy silently.
//
// Copies no trace executed (the program allows paths the TraceGraph does not) fall back to the
// node-level producer set of the TraceGraph with "any copy". Slots that saw external tensors are
// fed from Python: always (only feeds seen) or when Python says so (feed_or_none).
#pragma once

#include <cstdint>
#include <span>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "trace/op_record.h"
#include "trace/program.h"
#include "trace/trace_graph.h"

namespace terra::emit {

using VarId = uint32_t;
inline constexpr VarId kNoVar = UINT32_MAX;

// Trip indices of the unrolled loops around a copy, outermost first.
using CopyIndex = std::vector<uint32_t>;

// A producer copy a variable can hold: output `output` of copy `copy` of `node`, or of any copy.
struct Producer {
  trace::NodeId node;
  uint32_t output;
  bool any;
  CopyIndex copy;  // empty when `any`
};

class ValueFlow {
 public:
  // `traces[i]` was merged into `graph` with `record_nodes[i]`; `program` = assign_cases(graph).
  ValueFlow(const trace::TraceGraph& graph, const trace::Program& program, std::span<const trace::Trace> traces,
            std::span<const std::vector<trace::NodeId>> record_nodes);

  // The variable input `slot` of copy `copy` of `node` reads; kNoVar if only feeds were seen.
  VarId read(trace::NodeId node, uint32_t slot, const CopyIndex& copy) const;
  // External tensors were seen at this input (in any copy).
  bool fed(trace::NodeId node, uint32_t slot) const;
  // Appends the variables copy `copy` of `node` assigns with output `output`.
  void assigned_by(trace::NodeId node, uint32_t output, const CopyIndex& copy, std::vector<VarId>& out) const;
  uint32_t num_vars() const { return num_vars_; }
  // The producer copies that assign `var`.
  const std::vector<Producer>& producers(VarId var) const { return producers_.at(var); }
  // Whether `node` lies in an unrolled loop (its executions are told apart by copy).
  bool copied(trace::NodeId node) const { return node < copied_.size() && copied_[node] != 0; }
  // A selected read: the variable of each producer it may read, in the order of
  // producers(choice); nullptr for reads of "whichever ran last".
  const std::vector<VarId>* choices(trace::NodeId node, uint32_t slot, const CopyIndex& copy) const {
    const auto it = choices_.find(Key{node, slot, copy});
    return it == choices_.end() ? nullptr : &it->second;
  }
  // Loop ids (LoopFrame::loop_id) of prim::Loop loops some trace read a stale iteration of.
  const std::vector<uint64_t>& stale_loops() const { return stale_loops_; }

 private:
  struct Key {
    trace::NodeId node;
    uint32_t index;  // input slot (reads) or output (writes)
    CopyIndex copy;
    friend bool operator==(const Key&, const Key&) = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const noexcept;
  };
  struct Item {  // one producer copy
    trace::NodeId node;
    uint32_t output;
    CopyIndex copy;
    bool any;  // every copy of the node (fallback sets)
    friend bool operator==(const Item&, const Item&) = default;
    friend bool operator<(const Item& a, const Item& b) {
      return std::tie(a.node, a.output, a.any, a.copy) < std::tie(b.node, b.output, b.any, b.copy);
    }
  };

  // Returns the copy of every record.
  std::vector<CopyIndex> observe(const trace::TraceGraph& graph, const trace::Program& program,
                                 const trace::Trace& trace, const std::vector<trace::NodeId>& nodes,
                                 std::unordered_map<Key, std::vector<Item>, KeyHash>& seen);
  // Marks the reads of `trace` whose producer is not the last-run member of their set.
  // Widens the read sets that every trace's reads allow to (see the class comment).
  void widen(std::span<const trace::Trace> traces, std::span<const std::vector<trace::NodeId>> record_nodes,
             const std::vector<std::vector<CopyIndex>>& copies,
             std::unordered_map<Key, std::vector<Item>, KeyHash>& seen) const;
  void find_selected(const trace::Trace& trace, const std::vector<trace::NodeId>& nodes,
                     const std::vector<CopyIndex>& copies, std::unordered_map<Key, bool, KeyHash>& selected) const;
  void note_stale(const trace::Program& program, const trace::Trace& trace, uint32_t producer, uint32_t consumer,
                  const std::vector<trace::NodeId>& loops);
  void add_fallbacks(const trace::TraceGraph& graph, const trace::Program& program, trace::ProgId p,
                     CopyIndex& copy, std::unordered_map<Key, std::vector<Item>, KeyHash>& seen);
  VarId intern(std::vector<Item> set);

  std::unordered_map<Key, VarId, KeyHash> reads_;
  std::unordered_map<Key, std::vector<VarId>, KeyHash> choices_;
  std::unordered_map<Key, std::vector<VarId>, KeyHash> writes_;      // exact producer copies
  std::unordered_map<uint64_t, std::vector<VarId>> writes_any_;      // (node, output) -> vars
  std::vector<std::vector<bool>> fed_;                                // [node][slot]
  std::vector<std::pair<std::vector<Item>, VarId>> sets_;  // indexed by VarId, while building
  std::unordered_map<uint64_t, std::vector<uint32_t>> set_index_;    // set hash -> sets_ entries
  uint32_t num_vars_ = 0;
  std::vector<std::vector<Producer>> producers_;  // per variable
  std::vector<uint8_t> copied_;                  // per node
  std::vector<uint64_t> stale_loops_;
};

// The copy (value_flow.h) of every record of `trace`, merged into `graph` with `nodes`.
std::vector<CopyIndex> record_copies(const trace::TraceGraph& graph, const trace::Program& program,
                                     const trace::Trace& trace, const std::vector<trace::NodeId>& nodes);

// Trip index of each enclosing loop for every record of `trace` (the iteration count of the
// loop instance so far, 0-based; iterations that issued no ops do not count), by the loop-frame
// rules of docs/TRACEGRAPH.md.
std::vector<std::vector<uint32_t>> trip_indices(const trace::Trace& trace);

}  // namespace terra::emit
