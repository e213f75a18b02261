// Translation of captured traces into TraceGraph input, and the per-node side tables.
#include "emit/captured_program.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/UndefinedTensorImpl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include <ATen/core/enum_tag.h>

#include "capture/collectives.h"
#include "capture/region.h"
#include "capture/value_checks.h"
#include "trace/hash.h"

namespace terra::emit {

namespace {

// FNV-1a: a fixed function of the text, so op ids do not depend on std::hash or on the process.
uint64_t fnv1a(std::string_view s, uint64_t h = 0xcbf29ce484222325ULL) {
  for (const unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// The tensor layout (which arguments carry tensors, list lengths) and the output count are part
// of what makes two ops equal: the emitter rebuilds the argument list from one record per node,
// so records that disagree on it must not share a node.
uint64_t layout_hash(const capture::Trace& trace, const capture::OpRecord& rec, size_t num_outputs) {
  uint64_t h = trace::mix64(num_outputs + 1);
  for (const capture::OpInput& in : rec.inputs) {
    if (is_none_input(trace, in)) continue;
    h = trace::hash_combine(h, (static_cast<uint64_t>(in.argument) << 32) ^
                                   static_cast<uint32_t>(in.list_index));
  }
  return h;
}

}  // namespace

bool generalizes(const c10::OperatorHandle& op) { return op.operator_name().getNamespace() != "terra"; }

std::optional<EmittedGraph::ScalarKind> scalar_kind(const c10::IValue& v) {
  using K = EmittedGraph::ScalarKind;
  if (v.isDouble()) return K::kFloat;
  if (v.isInt()) return K::kInt;
  if (v.isBool()) return K::kBool;
  if (v.isIntList()) return K::kIntList;
  if (capture::is_float_list(v)) return K::kFloatList;  // foreach optimizers' per-parameter step sizes
  return std::nullopt;
}

bool scalar_bits(const c10::IValue& v, EmittedGraph::ScalarKind kind, std::vector<int64_t>& out) {
  using K = EmittedGraph::ScalarKind;
  out.clear();
  switch (kind) {
    case K::kFloat: {
      if (!v.isDouble()) return false;
      const double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);  // bits, not value: -0.0 and 0.0 differ in results
      out.push_back(bits);
      return true;
    }
    case K::kInt:
      if (!v.isInt()) return false;
      out.push_back(v.toInt());
      return true;
    case K::kBool:
      if (!v.isBool()) return false;
      out.push_back(v.toBool() ? 1 : 0);
      return true;
    case K::kIntList:
      if (!v.isIntList()) return false;
      for (const c10::IValue& e : v.toListRef()) out.push_back(e.toInt());
      return true;
    case K::kFloatList:
      if (!capture::is_float_list(v)) return false;
      for (const c10::IValue& e : v.toListRef()) {
        const double d = e.toDouble();
        int64_t bits;
        std::memcpy(&bits, &d, sizeof bits);
        out.push_back(bits);
      }
      return true;
  }
  return false;
}

bool scalar_equals(const c10::IValue& v, EmittedGraph::ScalarKind kind, const std::vector<int64_t>& bits) {
  using K = EmittedGraph::ScalarKind;
  switch (kind) {
    case K::kFloat: {
      if (!v.isDouble() || bits.size() != 1) return false;
      const double d = v.toDouble();
      int64_t b;
      std::memcpy(&b, &d, sizeof b);
      return b == bits[0];
    }
    case K::kInt:
      return v.isInt() && bits.size() == 1 && v.toInt() == bits[0];
    case K::kBool:
      return v.isBool() && bits.size() == 1 && (v.toBool() ? 1 : 0) == bits[0];
    case K::kIntList: {
      if (!v.isIntList()) return false;
      const auto& list = v.toListRef();
      if (list.size() != bits.size()) return false;
      for (size_t i = 0; i < bits.size(); ++i)
        if (list[i].toInt() != bits[i]) return false;
      return true;
    }
    case K::kFloatList: {
      if (!capture::is_float_list(v)) return false;
      const auto& list = v.toListRef();
      if (list.size() != bits.size()) return false;
      for (size_t i = 0; i < bits.size(); ++i) {
        const double d = list[i].toDouble();
        int64_t b;
        std::memcpy(&b, &d, sizeof b);
        if (b != bits[i]) return false;
      }
      return true;
    }
  }
  return false;
}

bool is_none_input(const capture::Trace& trace, const capture::OpInput& input) {
  const capture::ValueRef& v = input.value;
  return v.is_external() && static_cast<size_t>(v.external) < trace.externals.size() &&
         trace.externals[v.external].identity == c10::UndefinedTensorImpl::singleton();
}

trace::OpKey key_of(const capture::Trace& trace, const capture::OpRecord& rec, size_t num_outputs) {
  trace::OpKey key;
  key.op = operator_id(rec.op);
  key.attrs = trace::hash_combine(rec.attributes_hash, layout_hash(trace, rec, num_outputs));
  key.location = rec.location;
  return key;
}

bool has_side_effect(const c10::OperatorHandle& op) {
  // A collective is seen by the other ranks: run ahead of Python it would be issued again by
  // Python after a divergence (capture/collectives.h).
  return capture::writes_an_argument(op.schema()) || op.hasTag(at::Tag::nondeterministic_seeded) || capture::is_collective(op);
}

uint64_t operator_id(const c10::OperatorName& name) {
  uint64_t h = fnv1a(name.name);
  return fnv1a(name.overload_name, fnv1a(".", h));
}

uint64_t operator_id(const c10::OperatorHandle& op) {
  struct Slot {
    const c10::OperatorName* at = nullptr;
    c10::OperatorName name{"", ""};
    uint64_t id = 0;
  };
  thread_local std::array<Slot, 64> remembered;
  const c10::OperatorName& name = op.operator_name();
  Slot& slot = remembered[(reinterpret_cast<uintptr_t>(&name) >> 4) % remembered.size()];
  // (The name is compared as well, a memcmp: the entry of an operator that was deregistered, a
  // torch.library op whose Library died, may be reused by another.)
  if (slot.at != &name || slot.name != name) slot = Slot{&name, name, operator_id(name)};
  return slot.id;
}

bool is_read_op(const c10::FunctionSchema& schema) {
  if (schema.name() == "terra::fetch") return true;
  const auto& returns = schema.returns();
  if (returns.empty()) return false;  // in-place ops without results (_foreach_add_) mutate
  for (const c10::Argument& r : returns) {
    const c10::TypePtr& t = r.type();
    if (t->kind() == c10::TypeKind::TensorType) return false;
    if (auto list = t->cast<c10::ListType>())
      if (list->getElementType()->kind() == c10::TypeKind::TensorType) return false;
    if (auto opt = t->cast<c10::OptionalType>())
      if (opt->getElementType()->kind() == c10::TypeKind::TensorType) return false;
  }
  return true;
}

std::vector<at::Tensor> external_tensors(const capture::Region& region) { return region.external_tensors(); }

CapturedProgram::CapturedProgram() { feed_ids_.emplace(nullptr, kWrappedScalarFeed); }

uint32_t CapturedProgram::feed_id(const capture::ExternalInput& external) {
  if (external.wrapped_number) return kWrappedScalarFeed;
  const auto [it, inserted] = feed_ids_.try_emplace(external.identity, static_cast<uint32_t>(feed_ids_.size()));
  return it->second;
}

trace::Trace CapturedProgram::translate(const capture::Trace& in) {
  std::vector<uint32_t> feeds;
  feeds.reserve(in.externals.size());
  for (const capture::ExternalInput& e : in.externals) feeds.push_back(feed_id(e));

  trace::Trace out;
  out.ops.reserve(in.ops.size());
  for (size_t i = 0; i < in.ops.size(); ++i) {
    const capture::OpRecord& rec = in.ops[i];
    trace::OpRecord op;
    op.key = key_and_frames(in, rec, rec.outputs.size(), op.loops);
    op.origin = rec.origin;
    op.inputs.reserve(rec.inputs.size());
    const bool read = is_read_op(rec.op.schema());
    for (const capture::OpInput& input : rec.inputs) {
      if (is_none_input(in, input)) continue;
      const capture::ValueRef& v = input.value;
      if (v.is_external()) {
        op.inputs.push_back(trace::ValueRef::feed(feeds.at(v.external)));
        continue;
      }
      op.inputs.push_back(trace::ValueRef::output_of(v.record, v.output));
      if (read) out.fetches.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(v.record),
                                       static_cast<uint32_t>(v.output)});
    }
    op.num_outputs = static_cast<uint32_t>(rec.outputs.size());
    out.ops.push_back(std::move(op));
  }
  return out;
}

trace::OpKey CapturedProgram::key_and_frames(const capture::Trace& trace, const capture::OpRecord& rec,
                                             size_t num_outputs, std::vector<trace::LoopFrame>& frames) const {
  trace::OpKey key = key_of(trace, rec, num_outputs);
  frames.clear();
  if (flattened_.empty()) {  // the common case, on the runtime's per-op path
    for (const capture::LoopFrame& f : rec.loops) frames.push_back({f.loop_id, f.iteration});
    return key;
  }
  for (const capture::LoopFrame& f : rec.loops)
    if (!is_flattened(f.loop_id)) frames.push_back({f.loop_id, f.iteration});
  if (rec.origin >= 0 && static_cast<size_t>(rec.origin) < trace.ops.size())
    for (const capture::LoopFrame& f : trace.ops[rec.origin].loops)
      if (is_flattened(f.loop_id)) key.location ^= iteration_mark(f.loop_id, f.iteration);
  return key;
}

uint32_t CapturedProgram::add(const capture::Trace& captured) {
  trace::Trace t = translate(captured);
  trace::MergeResult merged = graph_.merge(t);
  infos_.resize(graph_.num_nodes());
  auto note_device = [&](const c10::Device& d) {
    if (!d.is_cpu() && std::find(devices_.begin(), devices_.end(), d) == devices_.end()) devices_.push_back(d);
  };
  for (const capture::ExternalInput& e : captured.externals) note_device(e.meta.device);
  for (size_t i = 0; i < captured.ops.size(); ++i) {
    std::optional<OpInfo>& slot = infos_[merged.record_nodes[i]];
    const capture::OpRecord& rec = captured.ops[i];
    if (rec.checked) add_check(capture::check_key(rec.location, rec.op));
    for (const capture::TensorMeta& out : rec.outputs) note_device(out.device);
    if (slot) {
      const bool scalars = generalizes(rec.op);
      for (size_t a = 0; a < slot->attributes.size() && a < rec.attributes.size(); ++a) {
        const c10::IValue& was = slot->attributes[a];
        const c10::IValue& now = rec.attributes[a];
        if (const auto kind = scalars ? scalar_kind(was) : std::nullopt)
          if (!slot->varying[a] && scalar_bits(was, *kind, scratch_) && !scalar_equals(now, *kind, scratch_))
            slot->varying[a] = true;
        if (was.isGenerator() && now.isGenerator() &&
            was.toGenerator().unsafeGetGeneratorImpl() != now.toGenerator().unsafeGetGeneratorImpl())
          slot->varying[a] = true;
      }
      continue;
    }
    OpInfo info{rec.op, std::vector<c10::IValue>(rec.attributes.begin(), rec.attributes.end()), {}, static_cast<uint32_t>(rec.outputs.size())};
    info.tensor_args.reserve(rec.inputs.size());
    for (const capture::OpInput& input : rec.inputs)
      if (!is_none_input(captured, input)) info.tensor_args.push_back({input.argument, input.list_index});
    info.varying.assign(info.attributes.size(), false);
    slot.emplace(std::move(info));
  }
  traces_.push_back(std::move(t));
  record_nodes_.push_back(std::move(merged.record_nodes));
  return static_cast<uint32_t>(traces_.size() - 1);
}

uint64_t CapturedProgram::check_key(trace::NodeId n) const {
  const OpInfo* op = info(n);
  return op == nullptr ? 0 : capture::check_key(graph_.node(n).key.location, op->op);
}

bool CapturedProgram::flatten(std::span<const uint64_t> loop_ids) {
  std::unordered_set<uint64_t> added;
  for (const uint64_t id : loop_ids)
    if (flattened_.insert(id).second) added.insert(id);
  if (added.empty()) return false;
  trace::TraceGraph graph;
  std::vector<std::optional<OpInfo>> infos;
  for (size_t t = 0; t < traces_.size(); ++t) {
    auto& ops = traces_[t].ops;
    // Keys first (they read the origin's frames), then the frames go.
    for (trace::OpRecord& op : ops) {
      if (op.origin < 0 || static_cast<size_t>(op.origin) >= ops.size()) continue;
      for (const trace::LoopFrame& f : ops[op.origin].loops)
        if (added.count(f.loop_id)) op.key.location ^= iteration_mark(f.loop_id, f.iteration);
    }
    for (trace::OpRecord& op : ops)
      std::erase_if(op.loops, [&](const trace::LoopFrame& f) { return added.count(f.loop_id) != 0; });
    trace::MergeResult merged = graph.merge(traces_[t]);
    infos.resize(graph.num_nodes());
    // A new node takes the side table of the old node of any record merged into it: records
    // of one node agree on everything OpInfo holds, `varying` aside, which stays conservative.
    for (size_t r = 0; r < merged.record_nodes.size(); ++r) {
      std::optional<OpInfo>& slot = infos[merged.record_nodes[r]];
      const std::optional<OpInfo>& old = infos_[record_nodes_[t][r]];
      if (!slot && old) slot = old;
    }
    record_nodes_[t] = std::move(merged.record_nodes);
  }
  graph_ = std::move(graph);
  infos_ = std::move(infos);
  return true;
}

}  // namespace terra::emit
