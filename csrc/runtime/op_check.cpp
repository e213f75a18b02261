// The PythonRunner's per-op check: an op Python issued against the emitted graph. The cursor
// steps (O(1)); every input must come from the producer the graph reads for the cursor's copy
// (feeds, selected reads, checked reads, loops); Python scalars are fed or must equal the baked
// constant; then the op's posts are queued, or the op is a divergence with its reason.
#include "runtime/python_runner.h"

#include <Python.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Exceptions.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "capture/placeholder.h"
#include "capture/region.h"
#include "capture/terra_key.h"
#include "capture/value_checks.h"
#include "runtime/executor.h"
#include "runtime/gil_release.h"
#include "runtime/runner_helpers.h"
#include "trace/hash.h"

namespace terra::runtime {

// ---- the hook --------------------------------------------------------------------------------

PythonRunner::Verdict PythonRunner::validate(const capture::Region& region, const capture::OpRecord& rec,
                                             int32_t index, c10::ArrayRef<c10::IValue> args, size_t num_outputs,
                                             bool needs_data, bool host) {
  ++stats_.ops;
  known_.settle();  // (the previous op has returned through autograd)
  if (diverged_) return Verdict::kDiverged;  // the graph failed under this iteration (recover_from_failure)
  if (record_nodes_.size() <= static_cast<size_t>(index)) {  // (outputs() looks every record up)
    record_nodes_.resize(index + 1, trace::kNoNode);
    record_copies_.resize(index + 1, 0);
  }
  const trace::OpKey key = program_.key_and_frames(region.trace(), rec, num_outputs, loops_);
  const trace::Match m = cursor_.step(key, loops_);
  if (!m.matched) return diverge(detail::op_name(rec) + " is not where the traced iterations had it", index);
  const trace::NodeId node = m.node;
  const OpCheckPlan::Node& checks = check_plan_.node(node);
  if (checks.unsupported != nullptr) {
    at_unsupported_ = true;  // the graph stops here on every path through this node
    return diverge("the graph cannot run " + detail::op_name(rec) + " (" + *checks.unsupported + ")", index);
  }
  path_ = trace::hash_combine(path_, node);
  const bool emitted = checks.emitted;
  const uint64_t here = copy_here(node);

  // The data flow must be the graph's too; checked for every input before anything is posted.
  plan_.clear();
  if (emitted) {
    const trace::Node& gnode = program_.graph().node(node);
    uint32_t slot = 0;
    for (const capture::OpInput& in : rec.inputs) {
      if (emit::is_none_input(region.trace(), in)) continue;
      const uint32_t s = slot++;
      const OpCheckPlan::Input& input = check_plan_.input(checks, s);
      const int64_t fslot = input.feed;
      const emit::EmittedGraph::Selection* selection = check_plan_.selected_at(input, here);
      if (in.value.is_external()) {
        if (selection != nullptr) plan_.push_back(decision(selection->site, 0));  // (the graph takes the feed)
        const at::Tensor& t = region.external_tensors().at(in.value.external);
        path_ = detail::hash_sizes(path_, t);  // sizes are not part of a node's key (see outputs())
        if (fslot < 0)
          return diverge(detail::op_name(rec) + " reads a tensor from outside the iteration where the graph reads a value it computes",
                         index);
        if (const auto linked = linked_index(t)) {
          values_->pin(*linked);  // taken by the graph's feed (a later in-place op may retire it)
          plan_.push_back(deferred_feed(fslot, *linked, t));
        } else {
          // A placeholder of another program (or an alias autograd made) that has its value
          // becomes an ordinary tensor; one without a value is not something the graph can read.
          if (!capture::adopt_if_backed(t))
            return diverge(detail::op_name(rec) + " reads a placeholder this program did not make", index);
          plan_.push_back(feed(fslot, t));
        }
        continue;
      }
      const trace::NodeId producer = record_nodes_.at(in.value.record);
      bool known = false;
      for (const trace::Source& src : gnode.inputs.at(s))
        known |= src.kind == trace::Source::Kind::kNode && src.id == producer &&
                 src.output == static_cast<uint32_t>(in.value.output);
      if (!known)
        return diverge(detail::op_name(rec) + " reads a value produced by another op than in the traced iterations", index);
      if (selection != nullptr) {
        // The graph picks the producer Python read.
        const int64_t j = selection->index_of(producer, static_cast<uint32_t>(in.value.output), record_copies_.at(in.value.record));
        if (j < 0)
          return diverge(detail::op_name(rec) + " reads a value produced by another op than the ones the graph picks among there",
                         index);
        plan_.push_back(decision(selection->site, j));
      } else if (input.checked.count != 0) {
        const auto* producers = check_plan_.checked_at(input, here);  // (a copy the emitter never saw: no read passes)
        if (producers == nullptr || !reads_latest(*producers, in.value.record, static_cast<uint32_t>(in.value.output)))
          return diverge(detail::op_name(rec) + " reads another value than the one the graph reads there", index);
      }
      if (in_loop(producer) || in_loop(node)) {
        // Inside prim::Loop every iteration of the producer writes the same graph value: only
        // a read of its latest execution is one the graph can serve. (A producer in a loop the
        // emitter flattened inside it has a value per copy: the latest of the copy read.)
        const at::Tensor t = detail::argument_tensor(args, in);
        const uint64_t copy = record_copies_.at(in.value.record);
        const int64_t tag = emit::EmittedGraph::publish_tag(producer, in.value.output);
        const Latest* latest = latest_.find(copy != 0 ? latest_key(tag, copy) : static_cast<uint64_t>(tag));
        if (!t.defined() || !t.has_storage() || latest == nullptr ||
            latest->where != std::make_pair(static_cast<const void*>(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()),
                                         t.storage_offset()))
          return diverge(detail::op_name(rec) + " reads a value from an earlier iteration of a loop (the graph keeps only the latest)",
                         index);
      }
      if (fslot >= 0) {
        if (!emitted_.feeds[fslot].optional)
          return diverge(detail::op_name(rec) + " reads a value computed in the iteration where the graph was fed one", index);
        plan_.push_back(feed(fslot, at::Tensor()));
      }
    }
  }

  // Python scalars (floats, ints, bools, int lists): fed where they varied in the traces;
  // elsewhere they must equal the constant the graph has baked in (one that changes for the
  // first time is a divergence, and its trace makes the next graph feed it).
  if (emitted && checks.scalars != nullptr) {
    for (const auto& use : *checks.scalars) {
      if (use.attribute >= rec.attributes.size())
        return diverge(detail::op_name(rec) + " received another kind of argument than in the traced iterations", index);
      const c10::IValue& v = rec.attributes[use.attribute];
      if (use.slot >= 0) {
        if (!emit::scalar_bits(v, use.kind, bits_))
          return diverge(detail::op_name(rec) + " received another kind of argument than in the traced iterations", index);
        if (emit::EmittedGraph::is_list(use.kind))
          plan_.push_back(scalar_bits(use.slot, static_cast<int64_t>(bits_.size())));
        for (const int64_t b : bits_) plan_.push_back(scalar_bits(use.slot, b));
      } else if (!emit::scalar_equals(v, use.kind, use.constant)) {
        return diverge(describe_scalar_change(rec, use, v), index);
      }
    }
  }

  if (emitted && checks.generators != nullptr) {
    for (const auto& [attribute, impl] : *checks.generators)
      if (attribute >= rec.attributes.size() || !rec.attributes[attribute].isGenerator() ||
          rec.attributes[attribute].toGenerator().unsafeGetGeneratorImpl() != impl)
        return diverge(detail::op_name(rec) + " draws from another torch.Generator than the one the graph draws from", index);
  }

  if (emitted && checks.gated) plan_.push_back(gate(node));
  if (recording_) record_step(region, key, node, host || needs_data);
  if (call_recording_) record_call_step(region, key, node, host || needs_data);
  for (const trace::Decision& d : m.decisions) post(decision(d.site, d.value));
  for (Post& p : plan_) post(std::move(p));
  note_run(index, node, here, num_outputs);
  if (host || needs_data) return Verdict::kRunReal;
  ++stats_.placeholders;
  return Verdict::kPlaceholder;
}


std::string PythonRunner::describe_scalar_change(const capture::OpRecord& rec, const emit::EmittedGraph::ScalarUse& use,
                                                 const c10::IValue& now) {
  std::ostringstream msg;
  msg << detail::op_name(rec) << " received the Python value " << now;
  const auto& params = rec.op.schema().arguments();
  if (use.attribute < rec.attribute_arguments.size()) {
    const size_t arg = static_cast<size_t>(rec.attribute_arguments[use.attribute]);
    if (arg < params.size()) msg << " as " << params[arg].name();
  }
  msg << " where the traced iterations passed ";
  using K = emit::EmittedGraph::ScalarKind;
  if (use.kind == K::kFloat && use.constant.size() == 1) {
    double d;
    std::memcpy(&d, &use.constant[0], sizeof d);
    msg << d;
  } else if (use.kind == K::kBool && use.constant.size() == 1) {
    msg << (use.constant[0] != 0 ? "True" : "False");
  } else if (use.kind == K::kFloatList) {
    msg << "[";
    for (size_t i = 0; i < use.constant.size(); ++i) {
      double d;
      std::memcpy(&d, &use.constant[i], sizeof d);
      msg << (i ? ", " : "") << d;
    }
    msg << "]";
  } else if (use.kind == K::kIntList) {
    msg << "[";
    for (size_t i = 0; i < use.constant.size(); ++i) msg << (i ? ", " : "") << use.constant[i];
    msg << "]";
  } else if (!use.constant.empty()) {
    msg << use.constant[0];
  }
  return msg.str();
}

uint64_t PythonRunner::copy_here(trace::NodeId node) {
  if (node >= emitted_.node_copied.size() || emitted_.node_copied[node] == 0) return 0;
  cursor_.copy_index(copy_);
  return emit::EmittedGraph::copy_hash(copy_);
}

void PythonRunner::note_run(int32_t index, trace::NodeId node, uint64_t copy, size_t num_outputs) {
  if (record_nodes_.size() <= static_cast<size_t>(index)) {
    record_nodes_.resize(index + 1, trace::kNoNode);
    record_copies_.resize(index + 1, 0);
  }
  record_nodes_[index] = node;
  record_copies_[index] = copy;
  for (uint32_t k = 0; k < num_outputs; ++k) {
    const int64_t tag = emit::EmittedGraph::publish_tag(node, k);
    latest_.try_emplace(static_cast<uint64_t>(tag)).first->record = index;
    if (copy != 0) latest_.try_emplace(latest_key(tag, copy)).first->record = index;
  }
}

// The graph's variable at a checked read holds whichever of its producer copies ran last
// (value_flow.h); Python's input passes if it is that one. Records, not tensors, are compared:
// an in-place op's record is the producer of what it wrote, as in the TraceGraph.
bool PythonRunner::reads_latest(const std::vector<emit::EmittedGraph::ReadProducer>& producers, int32_t record,
                                uint32_t output) const {
  if (record < 0 || static_cast<size_t>(record) >= record_nodes_.size()) return false;
  const trace::NodeId node = record_nodes_[record];
  const uint64_t copy = record_copies_[record];
  bool member = false;
  int32_t last = -1;
  for (const auto& p : producers) {
    const int64_t tag = emit::EmittedGraph::publish_tag(p.node, p.output);
    member |= p.node == node && p.output == output && (p.any || p.copy == copy);
    const Latest* ran = latest_.find(p.any || p.copy == 0 ? static_cast<uint64_t>(tag) : latest_key(tag, p.copy));
    if (ran != nullptr) last = std::max(last, ran->record);
  }
  return member && last == record;
}

bool PythonRunner::in_loop(trace::NodeId n) const {
  return n < emitted_.node_in_loop.size() && emitted_.node_in_loop[n] != 0;
}

}  // namespace terra::runtime
