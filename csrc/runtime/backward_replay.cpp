// backward() in co-execution: the walk of the autograd graph, the recording of a backward the
// engine ran op by op, and its replay (runtime/backward_replay.h). The replay is the PythonRunner's
// (it posts, steps the cursor and claims value-table indices exactly as validate() and outputs()
// would for the same ops), so its half lives here as PythonRunner members.
#include "runtime/backward_replay.h"

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <typeinfo>
#include <cstring>
#include <memory>

#include "capture/placeholder.h"
#include "capture/region.h"
#include "capture/terra_key.h"
#include "emit/captured_program.h"
#include "emit/channel.h"
#include "runtime/python_runner.h"
#include "common/flat_map.h"
#include "trace/hash.h"

namespace terra::runtime {

namespace {

using torch::autograd::Node;

// A Python autograd.Function's node (torch/csrc/autograd/python_function.h). Compared by the
// dynamic type's name: libtorch_python does not export PyNode's type_info for a dynamic_cast.
bool is_python_function(Node* node) { return std::strcmp(typeid(*node).name(), "N5torch8autograd6PyNodeE") == 0; }

// A DDP reducer's hook on an AccumulateGrad node, while the reducer is idle
// (tolerate_idle_reducer_hooks): it runs as before, with interception suspended, since the ops it
// may issue (find_unused_parameters marks the reducer's own used map) are the reducer's
// bookkeeping, not the program's.
class IdleReducerHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit IdleReducerHook(std::unique_ptr<torch::autograd::FunctionPostHook> inner) : inner_(std::move(inner)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    capture::SuspendGuard not_the_programs;
    return (*inner_)(outputs, inputs);
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override { inner_->compiled_args(args); }
  std::unique_ptr<torch::autograd::FunctionPostHook> release() { return std::move(inner_); }

 private:
  std::unique_ptr<torch::autograd::FunctionPostHook> inner_;
};

// What the reducer registers (torch/csrc/autograd/utils/lambda_post_hook.h), by the dynamic
// type's name: libtorch does not export its type_info for a dynamic_cast.
bool is_lambda_hook(const torch::autograd::FunctionPostHook& hook) {
  return std::strcmp(typeid(hook).name(), "N5torch8autograd5utils14LambdaPostHookE") == 0;
}

bool only_idle_reducer_hooks(Node* node) {
  for (const auto& hook : node->post_hooks())
    if (dynamic_cast<const IdleReducerHook*>(hook.get()) == nullptr) return false;
  return true;
}

// Why Python code would run when the engine executes `node` (empty: it would not).
std::string python_in(Node* node) {
  if (is_python_function(node))
    return "the backward runs a Python autograd.Function (" + node->name() + ")";
  if (!node->pre_hooks().empty() || !node->tensor_pre_hooks().empty()) return "a hook on " + node->name();
  if (!node->retains_grad_hooks().empty()) return "retain_grad() on an output of " + node->name();
  if (!node->post_hooks().empty() && !only_idle_reducer_hooks(node)) return "a hook on " + node->name();
  if (node->tensor_post_acc_grad_hooks() != nullptr) return "a post-accumulate-grad hook on a leaf";
  return {};
}

bool same_impl(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() == b.defined() && (!a.defined() || a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl());
}

// Two CPU wrapped numbers (0-dim tensors of Python scalars) hold the same bits.
bool same_number(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.dtype() != b.dtype() || a.numel() != 1 || b.numel() != 1 || !a.is_cpu() ||
      !b.is_cpu() || a.data_ptr() == nullptr || b.data_ptr() == nullptr)
    return false;
  return std::memcmp(a.data_ptr(), b.data_ptr(), a.element_size()) == 0;
}

// Non-tensor arguments equal as the graph would see them: the Python scalars the graph may feed
// by their bits (emit::scalar_equals, as the PythonRunner checks baked constants), the rest as
// values (None, strings, devices, other lists) or, for objects such as a generator, by identity.
bool same_attribute(const c10::IValue& a, const c10::IValue& b, std::vector<int64_t>& scratch) {
  if (const auto kind = emit::scalar_kind(a)) return emit::scalar_bits(a, *kind, scratch) && emit::scalar_equals(b, *kind, scratch);
  if (a.tagKind() != b.tagKind()) return false;
  if (a.isNone() || a.isString() || a.isDevice() || a.isList()) return a == b;
  return a.isSameIdentity(b);
}

}  // namespace

AutogradReach reach(const BackwardCall& call, bool whole_graph) {
  AutogradReach out;
  reach_into(call, out, whole_graph);
  return out;
}

void reach_into(const BackwardCall& call, AutogradReach& out, bool whole_graph) {
  out.nodes.clear();
  out.leaves.clear();
  out.python.clear();
  // Scratch kept per thread: a backward() per step walked a fresh hash set (a node allocation
  // per autograd node) and stack.
  thread_local common::FlatMap<Node*, bool> seen;
  thread_local std::vector<Node*> stack;
  seen.clear();
  stack.clear();
  for (const at::Tensor& root : call.roots) {
    if (!root.defined()) continue;
    Node* fn = torch::autograd::impl::gradient_edge(root).function.get();
    if (fn == nullptr) {
      out.python = "a root of backward() has no grad_fn";  // (the engine raises; let it)
      return;
    }
    if (seen.try_emplace(fn).second) stack.push_back(fn);
  }
  // Depth first, next edges in order: the same graph gives the same leaf order.
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    out.nodes.push_back(node);
    if (out.python.empty())
      if (std::string why = python_in(node); !why.empty()) {
        out.python = std::move(why);
        if (!whole_graph) return;
      }
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node); acc != nullptr && acc->variable.defined())
      out.leaves.push_back(acc->variable);
    const auto& edges = node->next_edges();
    for (auto e = edges.rbegin(); e != edges.rend(); ++e) {
      Node* next = e->function.get();
      if (next != nullptr && seen.try_emplace(next).second) stack.push_back(next);
    }
  }
}

void tolerate_idle_reducer_hooks(const std::vector<at::Tensor>& leaves, bool idle) {
  for (const at::Tensor& leaf : leaves) {
    auto node = torch::autograd::impl::grad_accumulator(leaf);
    if (!node) continue;
    for (auto& hook : node->post_hooks()) {
      if (idle && is_lambda_hook(*hook)) {
        hook = std::make_unique<IdleReducerHook>(std::move(hook));
      } else if (!idle) {
        // The original objects go back where they were: the reducer deletes its hooks by
        // their addresses when it is destroyed.
        if (auto* idle_hook = dynamic_cast<IdleReducerHook*>(hook.get())) hook = idle_hook->release();
      }
    }
  }
}

void release_saved(const AutogradReach& reach) {
  for (Node* node : reach.nodes) {
    node->will_release_variables();
    node->release_variables();
  }
}

// ---- the PythonRunner's half --------------------------------------------------------------------

PythonRunner::BackwardPath PythonRunner::per_op(std::string why) {
  ++backward_stats_.per_op;
  backward_stats_.reason = std::move(why);
  return BackwardPath::kPerOp;
}

PythonRunner::BackwardPath PythonRunner::begin_backward(capture::Region& region, const BackwardCall& call) {
  recording_.reset();
  if (!in_iteration_ || diverged_ || region.mode() != capture::Mode::CoExec)
    return BackwardPath::kPerOp;  // not co-executing: the engine runs as in eager (not counted)
  call_not_replayable("the call runs a backward()");
  if (call.create_graph) return per_op("backward(create_graph=True)");
  if (call.has_inputs) return per_op("backward(inputs=...)");
  if (!call.accumulate_grad) return per_op("torch.autograd.grad");
  if (torch::autograd::AnomalyMode::is_enabled()) return per_op("anomaly mode is on");
  AutogradReach& r = reach_;
  reach_into(call, r);
  // (The leaves go when this call is over: the runner must not keep parameters alive.)
  struct DropLeaves {
    AutogradReach& r;
    ~DropLeaves() {
      r.leaves.clear();
      r.nodes.clear();
    }
  } drop{r};
  if (!r.python.empty()) return per_op(r.python);

  BackwardMemo key;
  key.path = path_;
  key.records_before = region.trace().ops.size();
  key.externals_before = region.trace().externals.size();
  key.keep_graph = call.keep_graph;
  for (const at::Tensor& t : call.roots) {
    std::optional<capture::ValueRef> ref = region.produced(t);
    if (!ref) return per_op("backward() of a tensor this iteration did not compute");
    key.roots.push_back(*ref);
  }
  for (const at::Tensor& g : call.grads) {
    std::optional<capture::ValueRef> ref = g.defined() ? region.produced(g) : capture::ValueRef{};
    if (!ref) return per_op("backward() with a gradient this iteration did not compute");
    key.grads.push_back(*ref);
  }
  for (const at::Tensor& leaf : r.leaves) key.leaf_has_grad.push_back(leaf.grad().defined() ? 1 : 0);

  auto same_ref = [](const capture::ValueRef& a, const capture::ValueRef& b) {
    return a.record == b.record && a.output == b.output && a.external == b.external;
  };
  auto matches = [&](const BackwardMemo& m) {
    if (m.path != key.path || m.records_before != key.records_before || m.externals_before != key.externals_before ||
        m.keep_graph != key.keep_graph || m.leaf_has_grad != key.leaf_has_grad || m.leaves.size() != r.leaves.size() ||
        m.roots.size() != key.roots.size() || m.grads.size() != key.grads.size())
      return false;
    for (size_t i = 0; i < m.roots.size(); ++i)
      if (!same_ref(m.roots[i], key.roots[i])) return false;
    for (size_t i = 0; i < m.grads.size(); ++i)
      if (!same_ref(m.grads[i], key.grads[i])) return false;
    for (size_t i = 0; i < m.leaves.size(); ++i)
      if (m.leaves[i].expired() || m.leaves[i]._unsafe_get_target() != r.leaves[i].unsafeGetTensorImpl()) return false;
    std::vector<int64_t> scratch;
    for (const auto& [origin, attributes] : m.origin_attributes) {
      const auto& now = region.trace().ops.at(origin).attributes;
      if (now.size() != attributes.size()) return false;
      for (size_t a = 0; a < now.size(); ++a)
        if (!same_attribute(attributes[a], now[a], scratch)) return false;
    }
    return true;
  };
  for (const BackwardMemo& m : memos_) {
    if (!matches(m)) continue;
    replay(region, m, r, call);
    ++backward_stats_.replayed;
    return BackwardPath::kReplayed;
  }

  // Not seen yet: the engine runs it op by op and validate() records every step.
  auto rec = std::make_unique<BackwardRecording>();
  rec->memo = std::move(key);
  for (const at::Tensor& leaf : r.leaves) {
    rec->memo.leaves.emplace_back(leaf.getIntrusivePtr());
    rec->grads_before.push_back(leaf.grad());
    rec->versions_before.push_back(leaf.grad().defined() ? leaf.grad()._version() : 0);
  }
  rec->reach = r;  // (a copy: reach_ keeps its memory for the next call)
  rec->sequence_before = at::sequence_number::peek();
  recording_ = std::move(rec);
  return BackwardPath::kRecording;
}

void PythonRunner::not_replayable(std::string why) {
  if (recording_ && recording_->ineligible.empty()) recording_->ineligible = std::move(why);
}

void PythonRunner::record_step(const capture::Region& region, const trace::OpKey& key, trace::NodeId node,
                               bool runs_real) {
  BackwardRecording& r = *recording_;
  if (!r.ineligible.empty()) return;
  if (runs_real) return not_replayable("an op of the backward needs data");
  // (Inside a graph loop too: the memo's key is the path so far, trips before included, so a
  // replay steps the cursor through the same loop frames, copies and latest outputs.)
  std::string why = recorded_step(region, key, node, r.memo.steps.emplace_back(), [&]() -> std::string {
    // A fed number of a backward op (a view's sizes, a select's index) follows from its forward
    // op's arguments and the sizes in the key: replayed as recorded while the forward op's
    // arguments are the same (BackwardMemo::origin_attributes).
    const int32_t origin = region.trace().ops.back().origin;
    if (origin < 0 || static_cast<size_t>(origin) >= r.memo.records_before)
      return "the backward reads a Python number the graph is fed, not from a forward op";
    if (std::find(r.scalar_origins.begin(), r.scalar_origins.end(), origin) == r.scalar_origins.end())
      r.scalar_origins.push_back(origin);
    return {};
  });
  if (!why.empty()) not_replayable(std::move(why));
}

// ---- one recorded op, replayed (also call_replay.cpp) ------------------------------------------

std::vector<BackwardMemo::Alias> aliases_after(capture::Region& region, size_t begin) {
  std::vector<BackwardMemo::Alias> out;
  const auto& externals = region.external_tensors();
  for (size_t k = 0; k < externals.size(); ++k) {
    std::optional<capture::ValueRef> ref = region.produced(externals[k]);
    if (ref && ref->record >= static_cast<int32_t>(begin))
      out.push_back({static_cast<int32_t>(k), ref->record - static_cast<int32_t>(begin), ref->output});
  }
  return out;
}

void PythonRunner::apply_aliases(capture::Region& region, size_t records_before,
                                 const std::vector<BackwardMemo::Alias>& aliases) {
  const auto& externals = region.external_tensors();
  for (const BackwardMemo::Alias& a : aliases) {
    const int32_t index = static_cast<int32_t>(records_before) + a.record;
    region.set_produced(externals.at(a.external), index, a.output);
    note_latest(emit::EmittedGraph::publish_tag(record_nodes_.at(index), a.output), record_copies_.at(index),
                externals.at(a.external));
  }
}

std::string PythonRunner::recorded_step(const capture::Region& region, const trace::OpKey& key, trace::NodeId node,
                                        ReplayStep& step, c10::function_ref<std::string()> fed_number) {
  step.node = node;
  step.publishes = node < emitted_.node_publishes.size() ? emitted_.node_publishes[node] : 0;
  step.key = key;
  step.loops = loops_;
  const auto& externals = region.external_tensors();
  for (const Post& p : plan_) {
    ReplayPost out;
    out.key = p.key;
    out.value = p.value;
    switch (p.kind) {
      case Post::Kind::kDecision:
        if (is_scalar_key(p.key))
          if (std::string why = fed_number(); !why.empty()) return why;
        // (A select site's value names the producer copy the recorded op read: the same
        // records replayed read the same copy.)
        out.kind = ReplayPost::Kind::kDecision;
        break;
      case Post::Kind::kFeed:
      case Post::Kind::kDeferredFeed: {
        if (!p.tensor.defined()) {
          out.kind = ReplayPost::Kind::kFeedNone;
          break;
        }
        out.kind = ReplayPost::Kind::kFeed;
        for (size_t k = externals.size(); k-- > 0;)
          if (externals[k].unsafeGetTensorImpl() == p.tensor.unsafeGetTensorImpl()) {
            out.external = static_cast<int32_t>(k);
            break;
          }
        if (out.external < 0) return "an op feeds a tensor the region does not know";
        break;
      }
    }
    step.posts.push_back(out);
  }
  return {};
}

int32_t PythonRunner::replay_op(capture::Region& region, const capture::OpRecord& rec, const ReplayStep& step,
                                c10::ArrayRef<double> numbers) {
  const int32_t index = region.append_record(rec);
  const trace::Match m = cursor_.step(step.key, step.loops);
  TORCH_CHECK(m.matched && m.node == step.node, "terra_torch internal error: a replayed op (",
              c10::toString(rec.op.operator_name()), ") is not where the recorded one was");
  ++stats_.ops;
  ++stats_.placeholders;
  for (const trace::Decision& d : m.decisions) post(decision(d.site, d.value));
  const auto& externals = region.external_tensors();
  for (const ReplayPost& p : step.posts) {
    switch (p.kind) {
      case ReplayPost::Kind::kDecision: {
        int64_t value = p.value;
        if (p.parameter >= 0) std::memcpy(&value, &numbers[p.parameter], sizeof value);  // (a float's bits)
        post({Post::Kind::kDecision, p.key, value, {}});
        break;
      }
      case ReplayPost::Kind::kFeedNone:
        post(feed(p.key, at::Tensor()));
        break;
      case ReplayPost::Kind::kFeed: {
        const at::Tensor& t = externals.at(p.external);
        if (const auto linked = linked_index(t)) {
          values_->pin(*linked);
          post(deferred_feed(p.key, *linked, t));
        } else {
          TORCH_CHECK(capture::adopt_if_backed(t), "terra_torch internal error: a replayed op feeds a "
                      "placeholder without a value");
          post(feed(p.key, t));
        }
        break;
      }
    }
  }
  note_run(index, step.node, copy_here(step.node), rec.outputs.size());
  if (step.publishes > 0 && rec.outputs.empty())
    values_->expect(emit::EmittedGraph::publish_tag(step.node, 255), at::Tensor());
  return index;
}

void PythonRunner::end_backward(capture::Region& region, bool completed) {
  std::unique_ptr<BackwardRecording> owned = std::move(recording_);
  if (!owned || !completed || diverged_) return;
  BackwardRecording& r = *owned;
  BackwardMemo& memo = r.memo;
  auto give_up = [&](std::string why) { backward_stats_.reason = "not replayable: " + std::move(why); };
  if (!r.ineligible.empty()) return give_up(r.ineligible);
  if (at::sequence_number::peek() != r.sequence_before)
    return give_up("the backward created autograd nodes (checkpoint recomputation, or a hook that runs ops)");
  const capture::Trace& trace = region.trace();
  const size_t begin = memo.records_before;
  if (trace.ops.size() - begin != memo.steps.size()) return give_up("an op of the backward was not validated");
  memo.records.assign(trace.ops.begin() + static_cast<std::ptrdiff_t>(begin), trace.ops.end());
  for (const int32_t origin : r.scalar_origins)
    memo.origin_attributes.emplace_back(origin, std::vector<c10::IValue>(trace.ops[origin].attributes.begin(),
                                                                          trace.ops[origin].attributes.end()));

  // Externals first read in the backward: a leaf, the gradient a leaf had, or a copy of a Python
  // number a forward op read (autograd saved it for the backward).
  const auto& externals = region.external_tensors();
  for (size_t k = memo.externals_before; k < externals.size(); ++k) {
    const at::Tensor& t = externals[k];
    BackwardExternal named;
    for (size_t j = 0; j < r.reach.leaves.size() && named.leaf < 0 && named.forward_external < 0; ++j) {
      if (same_impl(r.reach.leaves[j], t)) named.leaf = static_cast<int32_t>(j);
      else if (r.grads_before[j].defined() && same_impl(r.grads_before[j], t)) named = {static_cast<int32_t>(j), true};
    }
    if (named.leaf < 0 && t.unsafeGetTensorImpl()->is_wrapped_number()) {
      // The forward op whose autograd node read it: its own copy of the number.
      for (const capture::OpRecord& rec : memo.records) {
        bool reads = false;
        for (const capture::OpInput& in : rec.inputs) reads |= in.value.external == static_cast<int32_t>(k);
        if (!reads || rec.origin < 0) continue;
        for (const capture::OpInput& in : trace.ops[rec.origin].inputs) {
          const int32_t j = in.value.external;
          if (j >= 0 && static_cast<size_t>(j) < memo.externals_before &&
              externals[j].unsafeGetTensorImpl()->is_wrapped_number() && same_number(externals[j], t)) {
            named.forward_external = j;
            break;
          }
        }
        break;
      }
    }
    if (named.leaf < 0 && named.forward_external < 0)
      return give_up("the backward reads a tensor from outside the iteration that is no leaf, no leaf's gradient "
                     "and no saved Python number");
    memo.new_externals.push_back(named);
  }

  for (size_t j = 0; j < r.reach.leaves.size(); ++j) {
    const at::Tensor& leaf = r.reach.leaves[j];
    const at::Tensor before = r.grads_before[j];
    const at::Tensor after = leaf.grad();
    LeafOutcome o;
    if (!after.defined()) {
      if (before.defined()) return give_up("backward() removed a leaf's gradient");
    } else if (same_impl(before, after)) {
      o.version_bumps = after._version() - r.versions_before[j];
      if (o.version_bumps != 0) {
        o.kind = LeafOutcome::Kind::kInPlace;
        std::optional<capture::ValueRef> ref = region.produced(after);
        if (!ref || ref->record < static_cast<int32_t>(begin)) return give_up("a leaf's gradient was written outside the ops seen");
        o.record = ref->record - static_cast<int32_t>(begin);
        o.output = ref->output;
      }
    } else if (!before.defined()) {
      o.kind = LeafOutcome::Kind::kNew;
      std::optional<capture::ValueRef> ref = region.produced(after);
      if (!ref || ref->record < static_cast<int32_t>(begin) || !capture::is_placeholder(after) || after.is_view())
        return give_up("a leaf's new gradient is not a placeholder of the backward");
      o.record = ref->record - static_cast<int32_t>(begin);
      o.output = ref->output;
      if (!(memo.records[o.record].outputs.at(o.output) == capture::meta_of(after)))
        return give_up("a leaf's new gradient differs from the output it came from");
    } else {
      return give_up("backward() replaced a leaf's gradient by another tensor");
    }
    memo.outcomes.push_back(o);
  }
  memo.external_aliases = aliases_after(region, begin);
  memo.path_after = path_;
  if (memos_.size() >= kMaxBackwardMemos) memos_.erase(memos_.begin());
  memos_.push_back(std::move(memo));
  ++backward_stats_.recorded;
}

void PythonRunner::replay(capture::Region& region, const BackwardMemo& memo, const AutogradReach& r,
                          const BackwardCall& call) {
  // Which outputs become leaf gradients: looked up per output below.
  std::vector<std::pair<int64_t, size_t>> leaf_outputs;  // (record << 16 | output, leaf)
  for (size_t j = 0; j < memo.outcomes.size(); ++j)
    if (memo.outcomes[j].kind != LeafOutcome::Kind::kUnchanged)
      leaf_outputs.emplace_back((int64_t(memo.outcomes[j].record) << 16) | memo.outcomes[j].output, j);
  std::vector<at::Tensor> grads_before;
  grads_before.reserve(r.leaves.size());
  for (const at::Tensor& leaf : r.leaves) grads_before.push_back(leaf.grad());
  std::vector<at::Tensor> new_grads(r.leaves.size());

  const auto& externals = region.external_tensors();
  for (size_t i = 0; i < memo.steps.size(); ++i) {
    const capture::OpRecord& mrec = memo.records[i];
    const ReplayStep& step = memo.steps[i];
    for (const capture::OpInput& in : mrec.inputs) {
      const int32_t k = in.value.external;
      if (k < 0 || static_cast<size_t>(k) < externals.size()) continue;
      const BackwardExternal& named = memo.new_externals.at(k - memo.externals_before);
      const at::Tensor t = named.forward_external >= 0 ? externals.at(named.forward_external)
                           : named.grad                ? grads_before.at(named.leaf)
                                                       : r.leaves.at(named.leaf);
      const capture::ValueRef got = region.value_of(t);
      TORCH_CHECK(got.external == k, "terra_torch internal error: a replayed backward's external input ", k,
                  " became input ", got.external);
    }
    const int32_t index = replay_op(region, mrec, step);
    // The leaves' gradients among the outputs become values of the region (as run_placeholder
    // makes them), and the output sequence is claimed as outputs() claims it: only they are kept.
    for (uint32_t k = 0; k < mrec.outputs.size(); ++k) {
      const int64_t tag = emit::EmittedGraph::publish_tag(step.node, k);
      const int64_t id = (int64_t(i) << 16) | k;
      auto leaf = std::find_if(leaf_outputs.begin(), leaf_outputs.end(), [&](const auto& e) { return e.first == id; });
      if (leaf == leaf_outputs.end()) {
        if (step.publishes > 0) values_->expect(tag, at::Tensor());
        continue;
      }
      const size_t j = leaf->second;
      at::Tensor t = memo.outcomes[j].kind == LeafOutcome::Kind::kNew
                         ? capture::make_placeholder(mrec.outputs[k], mrec.op)
                         : grads_before[j];
      region.set_produced(t, index, static_cast<int32_t>(k));
      note_latest(tag, record_copies_.at(index), t);
      if (memo.outcomes[j].kind == LeafOutcome::Kind::kNew) new_grads[j] = t;
      if (step.publishes > 0) expect_output(tag, t);
    }
  }
  // What the engine leaves behind: the leaves' gradients, versions of those written in place,
  // and (without retain_graph) a graph whose saved tensors are gone.
  for (size_t j = 0; j < memo.outcomes.size(); ++j) {
    const LeafOutcome& o = memo.outcomes[j];
    if (o.kind == LeafOutcome::Kind::kNew) {
      r.leaves[j].mutable_grad() = new_grads[j];
    } else if (o.kind == LeafOutcome::Kind::kInPlace) {
      for (int64_t b = 0; b < o.version_bumps; ++b) torch::autograd::impl::bump_version(grads_before[j]);
      known_.forget(grads_before[j]);  // the graph writes it: no known or fresh value
    }
  }
  // (A parameter that equals a view the backward made, t(t(weight)) in a linear layer's
  // backward, is that output from now on, as when the engine ran: its latest one, too.)
  apply_aliases(region, memo.records_before, memo.external_aliases);
  path_ = memo.path_after;
  if (!call.keep_graph) release_saved(r);
  flush();
  // A gradient accumulated in place into memory Python can read or write without an op (an
  // array `g = p.grad.numpy()` kept across steps, masked after backward()): the graph runs the
  // backward before Python goes on, as PythonRunner::outputs does for such writes.
  for (size_t j = 0; j < memo.outcomes.size(); ++j)
    if (memo.outcomes[j].kind == LeafOutcome::Kind::kInPlace && python_writable_memory(grads_before[j])) {
      catch_up();
      break;
    }
}

}  // namespace terra::runtime
