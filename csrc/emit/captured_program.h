// The bridge from the capture layer (torch types) to the torch-free TraceGraph: each captured
// trace is translated into a terra::trace::Trace and merged, and what the TraceGraph does not
// keep but the graph emitter needs (operator handle, attribute values, which schema argument
// each tensor input slot fills) is kept here, per TraceGraph node.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "capture/op_arguments.h"
#include "capture/trace_record.h"
#include "capture/value_checks.h"
#include "emit/emitted_graph.h"
#include "trace/hash.h"
#include "trace/trace_graph.h"

namespace terra::capture {
class Region;
}

namespace terra::emit {

// Where one tensor input slot of a node goes in the schema.
struct TensorArg {
  int32_t argument = 0;     // position in the schema's arguments
  int32_t list_index = -1;  // index inside a Tensor[] / Tensor?[] argument, -1 for a plain Tensor
  friend bool operator==(const TensorArg&, const TensorArg&) = default;
};

// Side table of one TraceGraph op node, taken from the first record merged into it. Every later
// record of the node has the same operator, attribute hash and tensor layout (both are part of
// its OpKey), so one copy serves all.
struct OpInfo {
  c10::OperatorHandle op;
  std::vector<c10::IValue> attributes;  // non-tensor arguments, in schema order
  std::vector<TensorArg> tensor_args;   // per input slot of the node
  uint32_t num_outputs = 0;             // tensor outputs, lists flattened
  // Per attribute: a Python scalar (scalar_kind) whose value differed between the records
  // merged into this node (the graph feeds it instead of baking it in), or a torch.Generator
  // that was another object (the graph cannot draw from it).
  std::vector<bool> varying;
};

// The attributes the graph takes as values (EmittedGraph::ScalarUse): top-level floats, ints,
// bools and int lists. Every other attribute (strings, devices, None, lists of floats) is part of
// the node's identity. Ops of the terra namespace keep all of theirs (a terra::fetch marker's tag
// names the read): `generalizes` says whether an op's scalars are values at all.
bool generalizes(const c10::OperatorHandle& op);
std::optional<EmittedGraph::ScalarKind> scalar_kind(const c10::IValue& v);
// `v`'s encoding (emitted_graph.h); false when it is not of kind `kind`.
bool scalar_bits(const c10::IValue& v, EmittedGraph::ScalarKind kind, std::vector<int64_t>& out);
// Whether `v` is of kind `kind` and encodes to `bits`, without building the encoding.
bool scalar_equals(const c10::IValue& v, EmittedGraph::ScalarKind kind, const std::vector<int64_t>& bits);

// Feed ids in the translated traces name an external tensor *object*: its TensorImpl address,
// interned across all traces of the program (a parameter keeps one id). Python scalars that the
// arg parser wraps into 0-dim tensors are fresh objects at every op, so they all share this id;
// otherwise a loop would add one feed source per iteration to its slot.
inline constexpr uint32_t kWrappedScalarFeed = 0;

class CapturedProgram {
 public:
  CapturedProgram();

  // Translates and merges one captured trace; returns its index. Throws std::invalid_argument
  // for records the TraceGraph refuses (inputs that do not precede their use).
  uint32_t add(const capture::Trace& trace);

  const trace::TraceGraph& graph() const { return graph_; }
  size_t num_traces() const { return traces_.size(); }
  // The translated trace (input of the Cursor) and the node each of its records merged into.
  const trace::Trace& trace(uint32_t i) const { return traces_[i]; }
  const std::vector<trace::NodeId>& record_nodes(uint32_t i) const { return record_nodes_[i]; }
  const std::vector<trace::Trace>& traces() const { return traces_; }
  const std::vector<std::vector<trace::NodeId>>& all_record_nodes() const { return record_nodes_; }
  // Every device other than the CPU that a tensor of the merged traces lived on, in first-seen
  // order: the runtime picks the stream the graph runs on from it.
  const std::vector<c10::Device>& devices() const { return devices_; }
  // nullptr for start, end and loop nodes.
  const OpInfo* info(trace::NodeId n) const {
    return n < infos_.size() && infos_[n] ? &*infos_[n] : nullptr;
  }

  // The TraceGraph input for a captured trace (without merging it).
  trace::Trace translate(const capture::Trace& trace);

  // The key and loop frames of a captured record as this program merges it: frames of
  // flattened loops dropped, backward ops keyed by their forward op's trip through them. Both
  // translate() and the runtime's cursor take records from here, so they see the same thing.
  trace::OpKey key_and_frames(const capture::Trace& trace, const capture::OpRecord& rec, size_t num_outputs,
                              std::vector<trace::LoopFrame>& frames) const;

  // Errors only the data can raise (capture/value_checks.h): the ops, as capture::check_key,
  // that co-execution checks before the graph runs them, so the graph waits at their gate.
  // Merged records flagged `checked` add theirs; so does every op that raised in an iteration.
  void add_check(uint64_t key) { checks_.insert(key); }
  const std::unordered_set<uint64_t>& checks() const { return checks_; }
  bool is_check(uint64_t key) const { return !checks_.empty() && checks_.count(key) != 0; }
  // The same for an op of a region: asked for every op in co-execution, so nothing is hashed
  // while no op is to be checked.
  bool is_check(uint64_t location, const c10::OperatorHandle& op) const {
    return !checks_.empty() && checks_.count(capture::check_key(location, op)) != 0;
  }
  // The check key of op node `n` (0 for other nodes).
  uint64_t check_key(trace::NodeId n) const;

  // Treats the loops `loop_ids` as straight-line code from now on: their loop frames are dropped
  // (here and, through is_flattened, by the runtime's cursor), so each iteration merges as its
  // own copy of the body and a varying trip count becomes a switch after each iteration. Every
  // trace is merged again into a new TraceGraph: node ids change. False if no id was new.
  bool flatten(std::span<const uint64_t> loop_ids);

 private:
  bool is_flattened(uint64_t loop_id) const { return flattened_.count(loop_id) != 0; }
  // Backward ops are located by the forward op that created their autograd node, which is one
  // statement for every iteration of a loop. Once the loop is flattened, the backward of
  // iteration i must not merge with the backward of iteration j (their data flow differs: each
  // reads its own iteration's activations), so the forward op's trip through each flattened
  // loop joins the key: XOR of one mark per loop, the same whichever round flattened which loop.
  static uint64_t iteration_mark(uint64_t loop_id, uint32_t iteration) {
    return trace::mix64(trace::hash_combine(loop_id, iteration + 1));
  }

  uint32_t feed_id(const capture::ExternalInput& external);

  trace::TraceGraph graph_;
  std::vector<trace::Trace> traces_;
  std::vector<std::vector<trace::NodeId>> record_nodes_;
  std::vector<std::optional<OpInfo>> infos_;
  std::vector<c10::Device> devices_;
  std::unordered_map<const void*, uint32_t> feed_ids_;
  std::unordered_set<uint64_t> flattened_;
  std::unordered_set<uint64_t> checks_;
  std::vector<int64_t> scratch_;  // add(): one attribute's encoding
};

// The OpKey.op of an operator: a stable 64-bit hash of "ns::name.overload", equal across runs.
uint64_t operator_id(const c10::OperatorName& name);
// The same for a handle, remembered per thread by the operator's name object (each op of every
// co-executed iteration asks: hashing its name again was 0.6% of the Python thread's
// instructions in the `branches` program).
uint64_t operator_id(const c10::OperatorHandle& op);

// True for ops whose results Python reads instead of the graph using them: they return values
// but no tensor (aten::_local_scalar_dense behind .item() and bool(t), aten::equal, ...), and
// terra::fetch itself (an explicit "Python reads this tensor" marker).
bool is_read_op(const c10::FunctionSchema& schema);

// Writes to one of its arguments, draws random numbers or is a collective: in a co-execution graph it must not
// run before Python has validated it (a later divergence could not undo it).
bool has_side_effect(const c10::OperatorHandle& op);

// The TraceGraph key of a captured record whose op produces `num_outputs` tensors (records
// built for co-execution are keyed before their outputs exist).
trace::OpKey key_of(const capture::Trace& trace, const capture::OpRecord& rec, size_t num_outputs);

// An input that stands for None: the capture layer records an undefined tensor inside a
// Tensor?[] argument (x[:, idx] indexes with [None, idx]) as an external whose TensorImpl is the
// undefined-tensor singleton. Such inputs get no slot; the emitter fills the hole with None.
bool is_none_input(const capture::Trace& trace, const capture::OpInput& input);

// The external tensors of a region, indexed like region.trace().externals. The region keeps them
// alive (Region::externals_alive_) and its trace records their TensorImpl, which is all this
// needs; valid while the region lives.
std::vector<at::Tensor> external_tensors(const capture::Region& region);

}  // namespace terra::emit
