// Emits the TorchScript graph of a Program. The walk follows the Program tree; data flow uses the
// variables of value_flow.h, kept as an environment (variable -> current SSA value) that is
// forked at each prim::If and merged by the If's outputs, and threaded through prim::Loop as
// carried values. A journal of assignments makes forking O(assignments in the branch) rather
// than O(variables).
#include "emit/graph_emitter.h"
#include "emit/written_feeds.h"

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/common_subexpression_elimination.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "capture/grad_mode_kernels.h"
#include "capture/interceptor.h"
#include "emit/channel.h"
#include "emit/value_flow.h"
#include "trace/case_assignment.h"

namespace terra::emit {

namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;
using torch::jit::WithInsertPoint;
using trace::NodeId;
using trace::ProgId;
using trace::ProgKind;

enum class TensorKind { kNone, kTensor, kOptionalTensor, kTensorList, kOptionalTensorList };

TensorKind tensor_kind(const c10::TypePtr& t) {
  auto is_tensor = [](const c10::TypePtr& x) { return x->kind() == c10::TypeKind::TensorType; };
  if (is_tensor(t)) return TensorKind::kTensor;
  if (auto opt = t->cast<c10::OptionalType>())
    if (is_tensor(opt->getElementType())) return TensorKind::kOptionalTensor;
  if (auto list = t->cast<c10::ListType>()) {
    const c10::TypePtr& e = list->getElementType();
    if (is_tensor(e)) return TensorKind::kTensorList;
    if (auto opt = e->cast<c10::OptionalType>())
      if (is_tensor(opt->getElementType())) return TensorKind::kOptionalTensorList;
  }
  return TensorKind::kNone;
}

std::string op_name(const c10::OperatorHandle& op) { return c10::toString(op.operator_name()); }

class Emitter {
 public:
  Emitter(const CapturedProgram& cp, const trace::Program& prog, EmittedGraph& out, bool coexec)
      : cp_(cp), prog_(prog), out_(out), g_(*out.graph), flow_(cp.graph(), prog, cp.traces(), cp.all_record_nodes()),
        coexec_(coexec) {
    env_.assign(flow_.num_vars(), nullptr);
    case_select_ = c10::Symbol::fromQualString(kCaseSelectOp);
    loop_cond_ = c10::Symbol::fromQualString(kLoopCondOp);
    feed_ = c10::Symbol::fromQualString(kFeedOp);
    feed_or_none_ = c10::Symbol::fromQualString(kFeedOrNoneOp);
    fetch_ = c10::Symbol::fromQualString(kFetchOp);
    gate_ = c10::Symbol::fromQualString(kGateOp);
    publish_ = c10::Symbol::fromQualString(kPublishOp);
    feed_scalar_ = c10::Symbol::fromQualString(kFeedScalarOp);
    feed_int_ = c10::Symbol::fromQualString(kFeedIntOp);
    feed_bool_ = c10::Symbol::fromQualString(kFeedBoolOp);
    feed_int_list_ = c10::Symbol::fromQualString(kFeedIntListOp);
    feed_float_list_ = c10::Symbol::fromQualString(kFeedFloatListOp);
    feed_number_list_ = c10::Symbol::fromQualString(kFeedNumberListOp);
  }

  const std::vector<uint64_t>& stale_loops() const { return flow_.stale_loops(); }

  void emit(ProgId p) {
    const trace::ProgNode& pn = prog_.at(p);
    switch (pn.kind) {
      case ProgKind::kSeq:
        for (const ProgId c : pn.children) emit(c);
        return;
      case ProgKind::kBlock:
        for (const NodeId n : pn.ops) emit_op(n);
        return;
      case ProgKind::kSwitch:
        emit_switch(pn);
        return;
      case ProgKind::kWhile:
        emit_while(pn);
        return;
      case ProgKind::kUnrolled:
        ++out_.stats.unrolled;
        for (uint32_t i = 0; i < pn.trip_count; ++i) {
          copy_.push_back(i);
          emit(pn.children[0]);
          copy_.pop_back();
        }
        return;
    }
  }

 private:
  // ---- environment -------------------------------------------------------------------------

  void assign(VarId v, Value* value) {
    journal_.emplace_back(v, env_[v]);
    env_[v] = value;
  }

  // Variables assigned since `mark`, with their current values, in first-assignment order.
  std::vector<std::pair<VarId, Value*>> changes_since(size_t mark) {
    std::vector<std::pair<VarId, Value*>> out;
    ++epoch_;
    if (seen_.size() < env_.size()) seen_.resize(env_.size(), 0);
    for (size_t j = mark; j < journal_.size(); ++j) {
      const VarId v = journal_[j].first;
      if (seen_[v] == epoch_) continue;
      seen_[v] = epoch_;
      out.emplace_back(v, env_[v]);
    }
    return out;
  }

  void undo(size_t mark) {
    while (journal_.size() > mark) {
      env_[journal_.back().first] = journal_.back().second;
      journal_.pop_back();
    }
  }

  // ---- small node helpers ------------------------------------------------------------------

  Value* constant(const c10::IValue& v) {
    if (auto c = torch::jit::tryInsertConstant(g_, v)) return *c;
    throw std::runtime_error("terra_torch: TorchScript has no constant for an attribute of type " +
                             v.tagKind());
  }

  Value* int_constant(int64_t v) { return g_.insertConstant(v); }

  // Stands for a value on paths that do not produce it. The TorchScript frontend uses the same
  // node for variables that are only defined on some paths out of loops; it is never folded, and
  // the emitted data flow never reads it on a path where it is live.
  Value* uninitialized() { return g_.insertNode(g_.createUninitialized(c10::TensorType::get()))->output(); }

  Value* channel_op(c10::Symbol kind, std::vector<Value*> inputs, c10::TypePtr result) {
    Node* n = g_.insertNode(g_.create(kind, inputs, result ? 1 : 0));
    if (!result) return nullptr;
    return n->output()->setType(std::move(result));
  }

  // ---- values read by op inputs ------------------------------------------------------------

  // Python may send "none" at a fed input that has also read graph values.
  bool optional_feed(NodeId n, uint32_t slot) const {
    const auto& sources = cp_.graph().node(n).inputs[slot];
    return std::any_of(sources.begin(), sources.end(),
                       [](const trace::Source& s) { return s.kind == trace::Source::Kind::kNode; });
  }

  bool several_producers(NodeId n, uint32_t slot) const {
    const auto& sources = cp_.graph().node(n).inputs[slot];
    return std::count_if(sources.begin(), sources.end(),
                         [](const trace::Source& s) { return s.kind == trace::Source::Kind::kNode; }) > 1;
  }

  // The variable is assigned by copies of nodes in unrolled loops: which copy Python read matters.
  bool reads_copies(VarId var) const {
    const auto& ps = flow_.producers(var);
    return std::any_of(ps.begin(), ps.end(), [&](const Producer& p) { return flow_.copied(p.node); });
  }

  // A selected read: the producer Python read, by its index among the choices.
  Value* select(NodeId n, uint32_t slot, const std::vector<VarId>& choices) {
    EmittedGraph::Selection sel{kSelectSiteBase + static_cast<int64_t>(out_.num_selections++), {}};
    for (const VarId c : choices) {
      const Producer& p = flow_.producers(c).at(0);
      sel.producers.push_back({p.node, p.output, false, EmittedGraph::copy_hash(p.copy)});
    }
    Value* which = channel_op(case_select_, {int_constant(sel.site)}, c10::IntType::get());
    Node* resume = g_.insertPoint();  // the chain's Ifs nest in else-blocks; carry on after it
    out_.selected_reads[EmittedGraph::key(n, slot)][EmittedGraph::copy_hash(copy_)] = std::move(sel);
    auto value_of = [&](VarId c) { return env_[c] != nullptr ? env_[c] : uninitialized(); };
    // if which == 0: choice 0 else (if which == 1: choice 1 else ...)
    Value* picked = value_of(choices.back());
    Node* outer = nullptr;
    for (size_t k = 0; k + 1 < choices.size(); ++k) {
      Value* is_k = g_.insert(c10::Symbol::fromQualString("aten::eq"), {which, int_constant(static_cast<int64_t>(k))});
      Node* pick = g_.insertNode(g_.create(c10::prim::If, {is_k}, 0));
      {
        WithInsertPoint wp(pick->addBlock());
        pick->blocks()[0]->registerOutput(value_of(choices[k]));
      }
      pick->addBlock();
      Value* out = pick->addOutput()->setType(c10::TensorType::get());
      if (outer == nullptr) {
        picked = out;
      } else {
        outer->blocks()[1]->registerOutput(out);
      }
      outer = pick;
      g_.setInsertPoint(pick->blocks()[1]);
    }
    if (outer != nullptr) outer->blocks()[1]->registerOutput(value_of(choices.back()));
    g_.setInsertPoint(resume);
    return picked;
  }

  Value* input(NodeId n, uint32_t slot) {
    const VarId var = flow_.read(n, slot, copy_);
    // (Offline replays post the choice from the trace: scripted_channel.h.)
    const std::vector<VarId>* choices = var != kNoVar ? flow_.choices(n, slot, copy_) : nullptr;
    if (coexec_ && var != kNoVar && choices == nullptr && (several_producers(n, slot) || reads_copies(var))) {
      std::vector<EmittedGraph::ReadProducer>& check = out_.checked_reads[EmittedGraph::key(n, slot)][EmittedGraph::copy_hash(copy_)];
      check.clear();
      for (const Producer& p : flow_.producers(var))
        check.push_back({p.node, p.output, p.any, EmittedGraph::copy_hash(p.copy)});
    }
    if (flow_.fed(n, slot)) {
      const bool optional = optional_feed(n, slot);
      const uint64_t key = EmittedGraph::key(n, slot);
      auto [it, inserted] = out_.feed_index.try_emplace(key, static_cast<uint32_t>(out_.feeds.size()));
      if (inserted) out_.feeds.push_back({n, slot, optional});
      Value* s = int_constant(it->second);
      if (!optional) return channel_op(feed_, {s}, c10::TensorType::get());
      Value* computed = choices != nullptr ? select(n, slot, *choices) : var != kNoVar ? env_[var] : nullptr;
      // Python sends the tensor when this execution read an external one, none when it read the
      // value the graph computed: select between them with an If.
      Value* fed = channel_op(feed_or_none_, {s}, c10::OptionalType::ofTensor());
      Value* none = g_.insertNode(g_.createNone())->output();
      Value* is_none = g_.insert(c10::Symbol::fromQualString("aten::__is__"), {fed, none});
      Node* pick = g_.insertNode(g_.create(c10::prim::If, {is_none}, 0));
      {
        WithInsertPoint wp(pick->addBlock());
        pick->blocks()[0]->registerOutput(computed != nullptr ? computed : uninitialized());
      }
      {
        WithInsertPoint wp(pick->addBlock());
        pick->blocks()[1]->registerOutput(g_.insertUncheckedCast(fed, c10::TensorType::get()));
      }
      return pick->addOutput()->setType(c10::TensorType::get());
    }
    if (var == kNoVar) throw std::logic_error("terra_torch: input " + std::to_string(slot) + " of node " +
                                              std::to_string(n) + " has no recorded source");
    // No producer precedes this read in program order: the construct is only reachable on
    // program paths that are not TraceGraph paths (e.g. an unrolled first iteration taking a
    // case that the recorded traces only took in later iterations), which the Cursor rejects.
    if (choices != nullptr) return select(n, slot, *choices);
    if (env_[var] == nullptr) return uninitialized();
    return env_[var];
  }

  // ---- ops ----------------------------------------------------------------------------------

  void emit_op(NodeId n) {
    const OpInfo* info = cp_.info(n);
    if (info == nullptr) throw std::logic_error("terra_torch: block holds node " + std::to_string(n) + " without op info");
    const c10::FunctionSchema& schema = info->op.schema();
    if (is_read_op(schema)) {
      if (!coexec_) emit_read(n, *info);  // co-execution: Python reads the published inputs
      return;
    }
    if (info->tensor_args.empty() && !returns_tensors(schema)) {
      // Host bookkeeping that neither takes nor gives tensors (the profiler's
      // _record_function_exit of optimizer.step()): Python always runs it itself
      // (capture/region.cpp, is_host_op), with the handle its own enter op returned; the
      // graph has nothing to compute, and a baked-in handle would be another iteration's.
      return;
    }
    ++out_.stats.ops;
    if (!coexec_) {
      emit_node(n, *info);
      return;
    }
    // A node the graph cannot express costs only the paths through it: the graph waits there
    // at a gate Python never opens (Python diverges at this node instead, with the reason), and
    // its outputs are placeholders of the graph that nothing past the gate ever reads.
    Node* stop = g_.insertNode(g_.create(gate_, {int_constant(n)}, 0));
    try {
      emit_node(n, *info);
      stop->destroy();
    } catch (const std::logic_error&) {
      throw;  // a bug of ours, not something this op's arguments refused
    } catch (const std::exception& e) {
      out_.unsupported[n] = e.what();
      std::vector<VarId> vars;
      for (uint32_t k = 0; k < info->num_outputs; ++k) {
        vars.clear();
        flow_.assigned_by(n, k, copy_, vars);
        Value* none = uninitialized();  // (inserted after the gate, like whatever emit_node left)
        for (const VarId var : vars) assign(var, none);
      }
    }
  }

  void emit_node(NodeId n, const OpInfo& info) {
    const c10::FunctionSchema& schema = info.op.schema();
    std::vector<Value*> args = arguments(n, info);
    const uint64_t check = coexec_ ? cp_.check_key(n) : 0;
    const bool checked = coexec_ && cp_.is_check(check);
    if (checked) out_.gated_checks.insert(check);
    const bool gated = coexec_ && (has_side_effect(info.op) || checked);
    if (gated) channel_op(gate_, {int_constant(n)}, nullptr);
    // The user's GradMode, which capture folded into an argument (capture/grad_mode_kernels.h).
    const std::optional<size_t> grad_mode = capture::grad_mode_argument(info.op);
    if (grad_mode) set_grad_enabled(args.at(*grad_mode));
    Node* node = g_.insertNode(g_.create(c10::Symbol::fromQualString(schema.name()), args, 0));
    for (const c10::Argument& r : schema.returns()) node->addOutput()->setType(r.type());
    if (!resolves_to_recorded(node, info)) {
      // TorchScript would run another overload, or none (a bool Scalar): call the recorded
      // operator boxed instead, with the same arguments (channel_ops.cpp, terra::boxed_call).
      node->destroy();
      node = boxed_call(info, args);
      ++out_.stats.boxed;
    }
    if (grad_mode) set_grad_enabled(g_.insertConstant(false));  // (the graph runner also does after a failed op)
    std::vector<Value*> outputs = bind_outputs(n, info, node);
    if (coexec_) publish(n, outputs, gated);
  }

  void set_grad_enabled(Value* on) {
    g_.insertNode(g_.create(c10::Symbol::fromQualString("aten::set_grad_enabled"), {on}, 0));
  }

  // Every output joins the output sequence, in program order; an op without outputs publishes
  // one none, so that Python can tell when it has run.
  void publish(NodeId n, const std::vector<Value*>& outputs, bool gated) {
    if (out_.node_publishes.size() <= n) {
      out_.node_publishes.resize(n + 1, 0);
      out_.node_gated.resize(n + 1, 0);
      out_.node_in_loop.resize(n + 1, 0);
      out_.node_copied.resize(n + 1, 0);
    }
    out_.node_copied[n] = !copy_.empty();
    out_.node_gated[n] = gated;
    out_.node_in_loop[n] = loop_depth_ > 0;
    if (outputs.empty()) {
      Value* none = g_.insertNode(g_.createNone())->output();
      channel_op(publish_, {g_.insertConstant(EmittedGraph::publish_tag(n, 255)), none}, nullptr);
      out_.node_publishes[n] = 1;
      return;
    }
    for (uint32_t k = 0; k < outputs.size(); ++k)
      channel_op(publish_, {g_.insertConstant(EmittedGraph::publish_tag(n, k)), outputs[k]}, nullptr);
    out_.node_publishes[n] = static_cast<uint32_t>(outputs.size());
  }

  // Python reads each tensor input of this op (and computes the op's scalar result itself).
  void emit_read(NodeId n, const OpInfo& info) {
    const bool marker = info.op.schema().name() == kFetchOp;
    const int64_t tag = marker && !info.attributes.empty() && info.attributes[0].isInt() ? info.attributes[0].toInt() : -1;
    for (uint32_t s = 0; s < info.tensor_args.size(); ++s) {
      Value* v = input(n, s);
      auto [it, inserted] = out_.fetch_index.try_emplace(EmittedGraph::key(n, s),
                                                         static_cast<uint32_t>(out_.fetches.size()));
      if (inserted) out_.fetches.push_back({n, s, tag});
      channel_op(fetch_, {int_constant(it->second), v}, nullptr);
    }
  }

  // Rebuilds the schema's argument list from the tensor slots and the recorded attributes.
  //
  // A Tensor? argument without a tensor was recorded either as a None attribute or (an undefined
  // tensor) not at all. The attribute count tells how many were None; only when some were and
  // some were not does the next attribute being None decide. (A per-attribute schema position
  // in the capture record would remove the guess.)
  std::vector<Value*> arguments(NodeId n, const OpInfo& info) {
    const auto& params = info.op.schema().arguments();
    std::vector<std::vector<std::pair<int32_t, uint32_t>>> slots(params.size());
    for (uint32_t s = 0; s < info.tensor_args.size(); ++s) {
      const TensorArg& a = info.tensor_args[s];
      if (a.argument < 0 || static_cast<size_t>(a.argument) >= params.size())
        throw std::logic_error("terra_torch: tensor input outside the schema of " + op_name(info.op));
      slots[a.argument].emplace_back(a.list_index, s);
    }
    size_t non_tensor = 0, bare_optional = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const TensorKind k = tensor_kind(params[i].type());
      if (k == TensorKind::kNone) ++non_tensor;
      else if (k == TensorKind::kOptionalTensor && slots[i].empty()) ++bare_optional;
    }
    const auto& attrs = info.attributes;
    if (attrs.size() < non_tensor || attrs.size() - non_tensor > bare_optional)
      throw std::runtime_error("terra_torch: attributes of " + op_name(info.op) + " do not fit its schema");
    size_t nones = attrs.size() - non_tensor;
    size_t next = 0;
    std::vector<Value*> out;
    out.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const TensorKind k = tensor_kind(params[i].type());
      auto& arg_slots = slots[i];
      std::sort(arg_slots.begin(), arg_slots.end());
      switch (k) {
        case TensorKind::kNone:
          if (attrs.at(next).isGenerator() && info.varying.at(next))
            throw std::runtime_error("terra_torch: cannot generate a graph for " + op_name(info.op) +
                                     ": it draws from a different torch.Generator object in different iterations");
          if (attrs.at(next).isGenerator())  // the object itself: Python checks it passes the same one
            out_.node_generators[n].emplace_back(static_cast<uint32_t>(next),
                                                 attrs.at(next).toGenerator().unsafeGetGeneratorImpl());
          out.push_back(generalizes(info.op) && scalar_kind(attrs.at(next)) ? scalar(n, info, next, params[i].type())
                                                                           : constant(attrs.at(next)));
          ++next;
          break;
        case TensorKind::kTensor:
          out.push_back(arg_slots.empty() ? g_.insertNode(g_.createAutogradZero())->output()
                                          : input(n, arg_slots[0].second));
          break;
        case TensorKind::kOptionalTensor:
          if (!arg_slots.empty()) {
            out.push_back(input(n, arg_slots[0].second));
            break;
          }
          if (nones > 0 && (nones == bare_optional || (next < attrs.size() && attrs[next].isNone()))) {
            ++next;
            --nones;
          }
          --bare_optional;
          out.push_back(g_.insertNode(g_.createNone())->output());
          break;
        case TensorKind::kTensorList:
        case TensorKind::kOptionalTensorList: {
          const bool optional = k == TensorKind::kOptionalTensorList;
          const c10::TypePtr elem = optional ? c10::OptionalType::ofTensor() : c10::TensorType::get();
          std::vector<Value*> items;
          for (const auto& [index, slot] : arg_slots) {
            if (index < 0) throw std::logic_error("terra_torch: list input without index in " + op_name(info.op));
            while (optional && items.size() < static_cast<size_t>(index))
              items.push_back(g_.insertNode(g_.createNone())->output());
            items.push_back(input(n, slot));
          }
          out.push_back(g_.insertNode(g_.createList(elem, items))->output());
          break;
        }
      }
    }
    if (next != attrs.size())
      throw std::runtime_error("terra_torch: attributes of " + op_name(info.op) + " do not fit its schema");
    return out;
  }

  // A Python scalar attribute (float, int, bool, int list): fed when it varied between the
  // traces, else a constant (which the PythonRunner checks Python passes again).
  Value* scalar(NodeId n, const OpInfo& info, size_t attribute, const c10::TypePtr& param) {
    using K = EmittedGraph::ScalarKind;
    auto& uses = out_.node_scalars[n];
    const bool varying = attribute < info.varying.size() && info.varying[attribute];
    const c10::IValue& value = info.attributes[attribute];
    auto it = std::find_if(uses.begin(), uses.end(), [&](const auto& u) { return u.attribute == attribute; });
    if (it == uses.end()) {
      EmittedGraph::ScalarUse use{static_cast<uint32_t>(attribute),
                                  varying ? static_cast<int64_t>(out_.num_scalar_slots++) : -1, *scalar_kind(value), {}};
      scalar_bits(value, use.kind, use.constant);
      uses.push_back(std::move(use));
      it = uses.end() - 1;
    }
    if (it->slot < 0) return constant(value);
    Value* slot = int_constant(it->slot);
    switch (it->kind) {
      case K::kFloat: return channel_op(feed_scalar_, {slot}, c10::FloatType::get());
      case K::kInt: return channel_op(feed_int_, {slot}, c10::IntType::get());
      case K::kBool: return channel_op(feed_bool_, {slot}, c10::BoolType::get());
      case K::kIntList: return channel_op(feed_int_list_, {slot}, c10::ListType::ofInts());
      case K::kFloatList: {
        // A Scalar[] parameter (_foreach_div_.ScalarList) takes no float[]: the interpreter
        // refuses to cast the list at run time, so it gets a list of numbers.
        auto list = param->cast<c10::ListType>();
        if (list && list->getElementType()->kind() == c10::TypeKind::NumberType)
          return channel_op(feed_number_list_, {slot}, c10::ListType::create(c10::NumberType::get()));
        return channel_op(feed_float_list_, {slot}, c10::ListType::ofFloats());
      }
    }
    throw std::logic_error("terra_torch: unknown scalar kind");
  }

  // terra::boxed_call(name, overload, [args...]) -> Any, cast back to the schema's returns. The
  // node returned has one output per return, as the op's own node would (bind_outputs).
  Node* boxed_call(const OpInfo& info, const std::vector<Value*>& args) {
    const c10::FunctionSchema& schema = info.op.schema();
    Value* list = g_.insertNode(g_.createList(c10::AnyType::get(), args))->output();
    Node* call = g_.insertNode(g_.create(c10::Symbol::fromQualString(kBoxedCallOp),
                                         {g_.insertConstant(schema.name()), g_.insertConstant(schema.overload_name()), list}, 1));
    call->output()->setType(c10::AnyType::get());
    const auto& returns = schema.returns();
    if (returns.empty()) return call->output()->setType(c10::NoneType::get())->node();
    if (returns.size() == 1) return g_.insertUncheckedCast(call->output(), returns[0].type())->node();
    std::vector<c10::TypePtr> types;
    for (const c10::Argument& r : returns) types.push_back(r.type());
    Value* tuple = g_.insertUncheckedCast(call->output(), c10::TupleType::create(std::move(types)));
    return g_.insertNode(g_.createTupleUnpack(tuple));
  }

  static bool returns_tensors(const c10::FunctionSchema& schema) {
    for (const c10::Argument& r : schema.returns())
      if (capture::type_contains_tensor(r.type())) return true;
    return false;
  }

  // The JIT picks the overload itself from the input types (there is no way to pin one on a
  // Node): true when it picks the one eager ran.
  static bool resolves_to_recorded(Node* node, const OpInfo& info) {
    const c10::FunctionSchema* chosen = node->maybeSchema();
    const c10::OperatorName& want = info.op.operator_name();
    return chosen != nullptr && chosen->name() == want.name && chosen->overload_name() == want.overload_name;
  }

  // Recorded outputs are the tensors of the results, lists flattened; map them back.
  std::vector<Value*> bind_outputs(NodeId n, const OpInfo& info, Node* node) {
    const auto& returns = info.op.schema().returns();
    size_t plain = 0, lists = 0;
    for (const auto& r : returns) {
      const TensorKind k = tensor_kind(r.type());
      if (k == TensorKind::kTensor || k == TensorKind::kOptionalTensor) ++plain;
      else if (k == TensorKind::kTensorList) ++lists;
    }
    if (lists > 1 || info.num_outputs < plain)
      throw std::runtime_error("terra_torch: cannot map the recorded outputs of " + op_name(info.op));
    uint32_t k = 0;
    std::vector<VarId> vars;
    std::vector<Value*> values;
    auto bind = [&](Value* v) {
      values.push_back(v);
      vars.clear();
      flow_.assigned_by(n, k, copy_, vars);
      for (const VarId var : vars) assign(var, v);
      ++k;
    };
    for (size_t r = 0; r < returns.size(); ++r) {
      const TensorKind kind = tensor_kind(returns[r].type());
      if (kind == TensorKind::kTensor || kind == TensorKind::kOptionalTensor) {
        bind(node->output(r));
      } else if (kind == TensorKind::kTensorList) {
        Node* unpack = g_.insertNode(g_.createListUnpack(node->output(r), info.num_outputs - plain));
        for (Value* v : unpack->outputs()) bind(v);
      }
    }
    return values;
  }

  // ---- control flow -------------------------------------------------------------------------

  // prim::If whose outputs are every variable either branch assigns; a branch that leaves one
  // alone returns its value from before the If (or an uninitialized value if it has none yet).
  template <class Then, class Else>
  void emit_if(Value* cond, Then&& then_fn, Else&& else_fn) {
    Node* node = g_.insertNode(g_.create(c10::prim::If, {cond}, 0));
    std::vector<std::pair<VarId, Value*>> changed[2];
    for (int b = 0; b < 2; ++b) {
      Block* block = node->addBlock();
      const size_t mark = journal_.size();
      {
        WithInsertPoint wp(block);
        if (b == 0) then_fn();
        else else_fn();
      }
      changed[b] = changes_since(mark);
      undo(mark);
    }
    std::vector<VarId> vars;
    std::unordered_map<VarId, Value*> in_branch[2];
    for (int b = 0; b < 2; ++b) {
      for (const auto& [v, value] : changed[b]) {
        if (!in_branch[0].count(v) && !in_branch[1].count(v)) vars.push_back(v);
        in_branch[b][v] = value;
      }
    }
    Value* missing = nullptr;
    for (const VarId v : vars) {
      for (int b = 0; b < 2; ++b) {
        auto it = in_branch[b].find(v);
        Value* value = it != in_branch[b].end() ? it->second : env_[v];
        if (value == nullptr) {
          if (missing == nullptr) {
            WithInsertPoint wp(node);
            missing = uninitialized();
          }
          value = missing;
        }
        node->blocks()[b]->registerOutput(value);
      }
      assign(v, node->addOutput()->setType(c10::TensorType::get()));
    }
  }

  // Case k of a switch runs when case_select returns k: a chain of two-way Ifs.
  void emit_switch(const trace::ProgNode& pn) {
    ++out_.stats.switches;
    Value* which = channel_op(case_select_, {int_constant(pn.site)}, c10::IntType::get());
    emit_cases(pn, which, 0);
  }

  void emit_cases(const trace::ProgNode& pn, Value* which, size_t first) {
    if (first + 1 == pn.children.size()) {
      emit(pn.children[first]);
      return;
    }
    Value* is_first = g_.insert(c10::Symbol::fromQualString("aten::eq"), {which, int_constant(static_cast<int64_t>(first))});
    emit_if(
        is_first, [&] { emit(pn.children[first]); }, [&] { emit_cases(pn, which, first + 1); });
  }

  // prim::Loop(max, true, carried...): the body runs, then loop_cond says whether to go on,
  // which is exactly kWhile (the body runs at least once). Every variable the body assigns is
  // carried, since a later iteration or the code after the loop may read it.
  void emit_while(const trace::ProgNode& pn) {
    ++out_.stats.loops;
    std::vector<VarId> carried;
    ++epoch_;
    if (seen_.size() < env_.size()) seen_.resize(env_.size(), 0);
    collect_writes(pn.children[0], carried);
    std::vector<Value*> inputs{int_constant(std::numeric_limits<int64_t>::max()), g_.insertConstant(true)};
    Value* missing = nullptr;
    for (const VarId v : carried) {
      if (env_[v] == nullptr && missing == nullptr) missing = uninitialized();
      inputs.push_back(env_[v] != nullptr ? env_[v] : missing);
    }
    Node* loop = g_.insertNode(g_.create(c10::prim::Loop, inputs, 0));
    ++loop_depth_;
    Block* body = loop->addBlock();
    body->addInput()->setType(c10::IntType::get());
    const size_t mark = journal_.size();
    for (const VarId v : carried) assign(v, body->addInput()->setType(c10::TensorType::get()));
    {
      WithInsertPoint wp(body);
      emit(pn.children[0]);
      body->registerOutput(channel_op(loop_cond_, {int_constant(pn.site)}, c10::BoolType::get()));
      for (const VarId v : carried) body->registerOutput(env_[v]);
    }
    --loop_depth_;
    undo(mark);
    for (const VarId v : carried) assign(v, loop->addOutput()->setType(c10::TensorType::get()));
  }

  void collect_writes(ProgId p, std::vector<VarId>& out) {
    const trace::ProgNode& pn = prog_.at(p);
    if (pn.kind == ProgKind::kBlock) {
      std::vector<VarId> vars;
      for (const NodeId n : pn.ops) {
        for (uint32_t k = 0; k < cp_.graph().node(n).num_outputs; ++k) {
          vars.clear();
          flow_.assigned_by(n, k, copy_, vars);
          for (const VarId v : vars) {
            if (seen_[v] == epoch_) continue;
            seen_[v] = epoch_;
            out.push_back(v);
          }
        }
      }
      return;
    }
    if (pn.kind == ProgKind::kUnrolled) {
      for (uint32_t i = 0; i < pn.trip_count; ++i) {
        copy_.push_back(i);
        collect_writes(pn.children[0], out);
        copy_.pop_back();
      }
      return;
    }
    for (const ProgId c : pn.children) collect_writes(c, out);
  }

  const CapturedProgram& cp_;
  const trace::Program& prog_;
  EmittedGraph& out_;
  Graph& g_;
  ValueFlow flow_;
  std::vector<Value*> env_;
  std::vector<std::pair<VarId, Value*>> journal_;
  CopyIndex copy_;  // trip indices of the unrolled loops being emitted
  std::vector<uint32_t> seen_;
  uint32_t epoch_ = 0;
  bool coexec_;
  int loop_depth_ = 0;  // prim::Loop bodies being emitted
  c10::Symbol case_select_, loop_cond_, feed_, feed_or_none_, fetch_, gate_, publish_, feed_scalar_, feed_int_,
      feed_bool_, feed_int_list_, feed_float_list_, feed_number_list_;
};

size_t count_nodes(const Block* b) {
  size_t n = 0;
  for (const Node* node : b->nodes()) {
    ++n;
    for (const Block* inner : node->blocks()) n += count_nodes(inner);
  }
  return n;
}

}  // namespace

LoopsToFlatten::LoopsToFlatten(std::vector<uint64_t> ids)
    : std::runtime_error("terra_torch: " + std::to_string(ids.size()) +
                         " loop(s) must be flattened: values of earlier iterations are read after later ones ran"),
      loop_ids(std::move(ids)) {}

EmittedGraph emit_program(CapturedProgram& program, std::optional<trace::Program>& structured,
                          const EmitOptions& options) {
  // Each round flattens at least one loop the traces contain, so the rounds are bounded by the
  // number of distinct loops; the bound below only guards against a loop that will not go.
  for (int round = 0; round < 64; ++round) {
    structured = trace::assign_cases(program.graph());
    try {
      return emit_graph(program, *structured, options);
    } catch (const LoopsToFlatten& e) {
      if (!program.flatten(e.loop_ids))
        throw std::logic_error("terra_torch: flattening a loop left its stale reads in place");
    }
  }
  throw std::logic_error("terra_torch: loops kept needing flattening");
}

void optimize_graph(std::shared_ptr<Graph>& graph, bool lint) {
  torch::jit::EliminateDeadCode(graph);
  torch::jit::ConstantPropagation(graph);
  torch::jit::EliminateCommonSubexpression(graph);
  torch::jit::EliminateDeadCode(graph);
  if (lint) graph->lint();
}

EmittedGraph emit_graph(const CapturedProgram& program, const trace::Program& structured, const EmitOptions& options) {
  using Clock = std::chrono::steady_clock;
  auto ms = [](Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); };
  EmittedGraph out;
  out.graph = std::make_shared<Graph>();
  auto t0 = Clock::now();
  {
    Emitter emitter(program, structured, out, options.coexec);
    if (!emitter.stale_loops().empty()) throw LoopsToFlatten(emitter.stale_loops());
    emitter.emit(structured.root);
  }
  out.stats.emit_ms = ms(t0);
  t0 = Clock::now();
  if (options.optimize) optimize_graph(out.graph, options.lint);
  else if (options.lint) out.graph->lint();
  mark_written_feeds(out);
  out.stats.optimize_ms = ms(t0);
  out.stats.nodes_after_passes = count_nodes(out.graph->block());
  return out;
}

}  // namespace terra::emit
