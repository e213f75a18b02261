// PythonRunner: per-op validation and posting, materialization, divergence.
//
// Everything here runs on the Python thread, inside the capture region's handler (region mutex
// held, GIL normally released by torch's bindings). Waits release the GIL if the caller held it,
// because the graph thread may need it to free a tensor whose Python object C++ kept alive.
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
#include "trace/hash.h"

namespace terra::runtime {

namespace {

using Clock = std::chrono::steady_clock;

int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

// Ctrl-C while Python waits for the graph: raise KeyboardInterrupt in the user's program.
void check_signals() {
  if (!Py_IsInitialized()) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  if (PyErr_CheckSignals() != 0) {
    python_error e;  // takes the pending KeyboardInterrupt, restored when it reaches Python
    e.persist();
    PyGILState_Release(gil);
    throw e;
  }
  PyGILState_Release(gil);
}

std::string op_name(const capture::OpRecord& rec) { return c10::toString(rec.op.operator_name()); }

// A tensor whose broadcast dimensions (stride 0) are cut to one element: an expanded placeholder
// is given its value through it, since a copy into memory that several elements share is refused.
at::Tensor without_broadcast(const at::Tensor& t) {
  at::Tensor out = t;
  for (int64_t d = 0; d < out.dim(); ++d)
    if (out.stride(d) == 0 && out.size(d) > 1) out = out.narrow(d, 0, 1);
  return out;
}

// The tensor an input of the record refers to, from the op's arguments.
at::Tensor argument_tensor(c10::ArrayRef<c10::IValue> args, const capture::OpInput& in) {
  if (in.argument < 0 || static_cast<size_t>(in.argument) >= args.size()) return {};
  const c10::IValue& a = args[in.argument];
  if (in.list_index < 0) return a.isTensor() ? a.toTensor() : at::Tensor();
  if (a.isTensorList()) return a.toTensorList().get(in.list_index);
  if (a.isOptionalTensorList()) {
    const c10::IValue& e = a.toListRef()[in.list_index];
    return e.isTensor() ? e.toTensor() : at::Tensor();
  }
  return {};
}

uint64_t hash_sizes(uint64_t h, const at::Tensor& t) {
  if (!t.defined()) return h;
  for (const int64_t d : t.sizes()) h = trace::hash_combine(h, static_cast<uint64_t>(d));
  return trace::hash_combine(h, static_cast<uint64_t>(t.dim()));
}

}  // namespace

PythonRunner::PythonRunner(emit::CapturedProgram& program, const trace::Program& structured,
                           const emit::EmittedGraph& emitted, Drive drive,
                           const std::vector<std::vector<std::string>>* node_frames)
    : program_(program),
      node_frames_(node_frames),
      structured_(structured),
      emitted_(emitted),
      drive_(drive),
      channel_(std::make_shared<ConcurrentChannel>()),
      values_(std::make_shared<ValueTable>()),
      cursor_(structured) {
  channel_->attach_values(values_);
  channel_->use_streams(StreamSync::for_devices(program.devices()));
  runner_ = std::make_unique<GraphRunner>(std::make_unique<TorchScriptExecutor>(emitted.graph), channel_);
}

PythonRunner::~PythonRunner() {
  GilRelease no_gil;
  runner_->shutdown();
}

// ---- iterations --------------------------------------------------------------------------------

void PythonRunner::begin_iteration() {
  TORCH_CHECK(!stopped_, "terra_torch: this PythonRunner was shut down");
  TORCH_CHECK(!in_iteration_, "terra_torch internal error: an iteration is already running");
  try {
    // An earlier graph iteration's error surfaces here (a failed graph cancels the channel at
    // once; its iteration ends soon after). Otherwise the finished ones are counted without a
    // wait or a GIL hand-over (a failure the count stops at surfaces at the next wait).
    if (channel_->cancelled()) drain_outcomes(true);
    else waited_ += runner_->take_finished();
  } catch (const std::exception& e) {
    // The graph failed in an op Python did not check (an index out of range): what it had
    // not computed is lost. Start clean so that the program can go on after the error.
    recover_from_failure(describe_failure(e.what()));
  }
  cursor_.reset();
  path_ = 0;
  recording_.reset();
  record_nodes_.clear();
  latest_.clear();
  diverged_ = false;
  at_unsupported_ = false;
  reason_.clear();
  divergence_record_ = -1;
  links_.erase_if([](const c10::TensorImpl*, const Link& link) { return link.expired(); });
  values_->sweep();
  if (known_.size() > 64) known_.prune();
  runner_->start_iteration();
  ++started_;
  in_iteration_ = true;
}

bool PythonRunner::end_iteration(bool partial) {
  TORCH_CHECK(in_iteration_, "terra_torch internal error: no iteration to end");
  struct Ended {  // also when the graph's failure surfaces here
    bool& flag;
    ~Ended() { flag = false; }
  } ended{in_iteration_};
  if (!diverged_) {
    const trace::Match m = cursor_.finish();
    if (!m.matched && partial) {
      in_iteration_ = false;
      stop_and_materialize("the iteration was ended early by synchronize()");
      return false;
    }
    if (!m.matched) {
      diverge("the iteration ended where the traced iterations went on", -1);
    } else {
      for (const trace::Decision& d : m.decisions) post(decision(d.site, d.value));
      flush();
      if (drive_ == Drive::kLazy) wait_for_graph(values_->expected());
    }
  }
  in_iteration_ = false;
  return diverged_;
}

// ---- the hook --------------------------------------------------------------------------------

PythonRunner::Verdict PythonRunner::validate(const capture::Region& region, const capture::OpRecord& rec,
                                             int32_t index, c10::ArrayRef<c10::IValue> args, size_t num_outputs,
                                             bool needs_data, bool host) {
  ++stats_.ops;
  if (diverged_) return Verdict::kDiverged;  // the graph failed under this iteration (recover_from_failure)
  if (record_nodes_.size() <= static_cast<size_t>(index)) record_nodes_.resize(index + 1, trace::kNoNode);
  const trace::OpKey key = program_.key_and_frames(region.trace(), rec, num_outputs, loops_);
  const trace::Match m = cursor_.step(key, loops_);
  if (!m.matched) return diverge(op_name(rec) + " is not where the traced iterations had it", index);
  const trace::NodeId node = m.node;
  if (!emitted_.unsupported.empty()) {
    const auto refused = emitted_.unsupported.find(node);
    if (refused != emitted_.unsupported.end()) {
      at_unsupported_ = true;  // the graph stops here on every path through this node
      return diverge("the graph cannot run " + op_name(rec) + " (" + refused->second + ")", index);
    }
  }
  path_ = trace::hash_combine(path_, node);
  const bool emitted = node < emitted_.node_publishes.size() && emitted_.node_publishes[node] > 0;

  // The data flow must be the graph's too; checked for every input before anything is posted.
  plan_.clear();
  if (emitted) {
    const trace::Node& gnode = program_.graph().node(node);
    uint32_t slot = 0;
    for (const capture::OpInput& in : rec.inputs) {
      if (emit::is_none_input(region.trace(), in)) continue;
      const uint32_t s = slot++;
      const int64_t fslot = emitted_.feed_slot(node, s);
      const emit::EmittedGraph::Selection* selection = selection_at(node, s);
      if (in.value.is_external()) {
        if (selection != nullptr) plan_.push_back(decision(selection->site, 0));  // (the graph takes the feed)
        const at::Tensor& t = region.external_tensors().at(in.value.external);
        path_ = hash_sizes(path_, t);  // sizes are not part of a node's key (see outputs())
        if (fslot < 0)
          return diverge(op_name(rec) + " reads a tensor from outside the iteration where the graph reads a value it computes",
                         index);
        if (const auto linked = linked_index(t)) {
          values_->pin(*linked);  // taken by the graph's feed (a later in-place op may retire it)
          plan_.push_back(deferred_feed(fslot, *linked, t));
        } else {
          // A placeholder of another program (or an alias autograd made) that has its value
          // becomes an ordinary tensor; one without a value is not something the graph can read.
          if (!capture::adopt_if_backed(t))
            return diverge(op_name(rec) + " reads a placeholder this program did not make", index);
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
        return diverge(op_name(rec) + " reads a value produced by another op than in the traced iterations", index);
      if (selection != nullptr) {
        // The graph picks the producer Python read.
        const auto& ps = selection->producers;
        const auto it = std::find(ps.begin(), ps.end(), std::make_pair(producer, static_cast<uint32_t>(in.value.output)));
        if (it == ps.end())
          return diverge(op_name(rec) + " reads a value produced by another op than the ones the graph picks among there",
                         index);
        plan_.push_back(decision(selection->site, it - ps.begin()));
      } else if (auto checked = emitted_.checked_reads.find(emit::EmittedGraph::key(node, s)); checked != emitted_.checked_reads.end()) {
        const auto producers = candidates(checked->second, gnode.inputs.at(s));
        if (producers.empty() || !latest_is(producers, argument_tensor(args, in)))
          return diverge(op_name(rec) + " reads another value than the one the graph reads there", index);
      }
      if (in_loop(producer) || in_loop(node)) {
        // Inside prim::Loop every iteration of the producer writes the same graph value: only
        // a read of its latest execution is one the graph can serve.
        const at::Tensor t = argument_tensor(args, in);
        const Latest* latest = latest_.find(emit::EmittedGraph::publish_tag(producer, in.value.output));
        if (!t.defined() || !t.has_storage() || latest == nullptr ||
            latest->where != std::make_pair(static_cast<const void*>(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()),
                                         t.storage_offset()))
          return diverge(op_name(rec) + " reads a value from an earlier iteration of a loop (the graph keeps only the latest)",
                         index);
      }
      if (fslot >= 0) {
        if (!emitted_.feeds[fslot].optional)
          return diverge(op_name(rec) + " reads a value computed in the iteration where the graph was fed one", index);
        plan_.push_back(feed(fslot, at::Tensor()));
      }
    }
  }

  // Python scalars (floats, ints, bools, int lists): fed where they varied in the traces;
  // elsewhere they must equal the constant the graph has baked in (one that changes for the
  // first time is a divergence, and its trace makes the next graph feed it).
  if (emitted) {
    auto scalars = emitted_.node_scalars.find(node);
    if (scalars != emitted_.node_scalars.end()) {
      for (const auto& use : scalars->second) {
        if (use.attribute >= rec.attributes.size())
          return diverge(op_name(rec) + " received another kind of argument than in the traced iterations", index);
        const c10::IValue& v = rec.attributes[use.attribute];
        if (use.slot >= 0) {
          if (!emit::scalar_bits(v, use.kind, bits_))
            return diverge(op_name(rec) + " received another kind of argument than in the traced iterations", index);
          if (emit::EmittedGraph::is_list(use.kind))
            plan_.push_back(scalar_bits(use.slot, static_cast<int64_t>(bits_.size())));
          for (const int64_t b : bits_) plan_.push_back(scalar_bits(use.slot, b));
        } else if (!emit::scalar_equals(v, use.kind, use.constant)) {
          return diverge(describe_scalar_change(rec, use, v), index);
        }
      }
    }
  }

  if (emitted && !emitted_.node_generators.empty()) {
    auto generators = emitted_.node_generators.find(node);
    if (generators != emitted_.node_generators.end()) {
      for (const auto& [attribute, impl] : generators->second)
        if (attribute >= rec.attributes.size() || !rec.attributes[attribute].isGenerator() ||
            rec.attributes[attribute].toGenerator().unsafeGetGeneratorImpl() != impl)
          return diverge(op_name(rec) + " draws from another torch.Generator than the one the graph draws from", index);
    }
  }

  if (emitted && emitted_.node_gated[node]) plan_.push_back(gate(node));
  if (recording_) record_step(region, key, node, host || needs_data);
  for (const trace::Decision& d : m.decisions) post(decision(d.site, d.value));
  for (Post& p : plan_) post(std::move(p));
  record_nodes_[index] = node;
  if (host || needs_data) return Verdict::kRunReal;
  ++stats_.placeholders;
  return Verdict::kPlaceholder;
}

void PythonRunner::materialize_inputs(c10::ArrayRef<c10::IValue> args) {
  // A read: everything Python validated so far must have run (the op may read a tensor the
  // graph updates in place), and the placeholders it reads get their values.
  ++stats_.reads;
  if (recording_) not_replayable("the backward reads data");
  flush();
  wait_for_graph(values_->expected());
  auto give_value = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    if (const auto linked = linked_index(t)) {
      std::optional<at::Tensor> v = values_->value(*linked);
      TORCH_CHECK(v.has_value(), "terra_torch internal error: the graph did not keep a value Python reads");
      refresh(t, *v);
    } else {
      TORCH_CHECK(capture::adopt_if_backed(t), "terra_torch: Python reads a placeholder that no runtime can give a "
                  "value (made by another program that has not computed it)");
    }
  };
  for (const c10::IValue& a : args) {
    if (a.isTensor()) {
      give_value(a.toTensor());
      if (known_values_enabled_) known_.learn(a.toTensor());  // small CPU tensors: later reads are answered here
    } else if (a.isTensorList()) {
      for (const at::Tensor& t : a.toTensorList().vec()) give_value(t);
    } else if (a.isOptionalTensorList()) {
      for (const c10::IValue& e : a.toListRef())
        if (e.isTensor()) give_value(e.toTensor());
    }
  }
}

bool PythonRunner::known_arguments(c10::ArrayRef<c10::IValue> args, bool read, torch::jit::Stack& out) {
  if (!known_values_enabled_ || diverged_ || known_.empty() || !known_.substitute(args, out)) return false;
  if (read) ++stats_.known_reads;
  return true;
}

void PythonRunner::follow_known(const c10::OperatorHandle& op, torch::jit::Stack& known,
                                c10::ArrayRef<at::Tensor> outputs) {
  known_.follow(op, known, outputs);
}

void PythonRunner::forget_written(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  if (known_.empty()) return;
  const auto& params = op.schema().arguments();
  for (size_t i = 0; i < params.size() && i < args.size(); ++i) {
    const c10::AliasInfo* alias = params[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    if (args[i].isTensor()) {
      known_.forget(args[i].toTensor());
    } else if (args[i].isTensorList()) {
      for (const at::Tensor& t : args[i].toTensorList().vec()) known_.forget(t);
    }
  }
}

void PythonRunner::outputs(int32_t index, c10::ArrayRef<at::Tensor> outputs) {
  const trace::NodeId node = record_nodes_.at(index);
  const uint32_t count = node < emitted_.node_publishes.size() ? emitted_.node_publishes[node] : 0;
  if (count == 0) return;
  if (outputs.empty()) {
    TORCH_CHECK(count == 1, "terra_torch internal error: node ", node, " publishes ", count, " values, the op none");
    values_->expect(emit::EmittedGraph::publish_tag(node, 255), at::Tensor());
    return;
  }
  TORCH_CHECK(outputs.size() == count, "terra_torch internal error: node ", node, " publishes ", count,
              " values, the op returned ", outputs.size());
  for (uint32_t k = 0; k < count; ++k) {
    const at::Tensor& t = outputs[k];
    // A backward is replayed for the same path (backward_replay.h); nodes merge across sizes
    // and fed scalars, so the sizes the forward produced join the path: a batch of another
    // size records its own memo instead of replaying one made for other shapes.
    path_ = hash_sizes(path_, t);
    const int64_t tag = emit::EmittedGraph::publish_tag(node, k);
    if (t.defined() && t.has_storage()) {
      Latest& latest = *latest_.try_emplace(tag).first;
      latest.where = {t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl(), t.storage_offset()};
      latest.seq = ++sequence_;
    }
    const bool keep = t.defined() && (capture::is_placeholder(t) || linked_index(t).has_value());
    const int64_t i = values_->expect(tag, keep ? t : at::Tensor());
    if (!keep) continue;
    auto [link, inserted] = links_.try_emplace(t.unsafeGetTensorImpl());
    if (!inserted && !link->expired()) values_->retire(link->index);  // in place: read the newer value
    // (an expired entry: a new tensor at a dead one's address)
    link->impl.emplace(t.getIntrusivePtr());
    link->index = i;
  }
}

bool PythonRunner::check_first(const capture::OpRecord& rec) {
  const bool check = !diverged_ && program_.is_check(rec.location, rec.op);
  if (check && recording_) not_replayable("an op of the backward is checked before the graph runs it");
  return check;
}

PythonRunner::Verdict PythonRunner::check_raised(const capture::Region& region, const capture::OpRecord& rec,
                                                 int32_t index) {
  // (The Session learns the key from region.raised() when it merges the iteration.)
  if (emitted_.gated_checks.count(capture::check_key(rec.location, rec.op)) != 0)
    return Verdict::kPlaceholder;  // the graph waits at its gate
  // The graph was generated before this op was known to raise: it may have run it already.
  return diverge(op_name(rec) + " raised (checked before the graph ran it), and this graph does not wait for the check",
                 index);
}

// ---- posting -----------------------------------------------------------------------------------

void PythonRunner::post(Post p) {
  pending_.push_back(std::move(p));
  if (drive_ == Drive::kCoExec && pending_.size() >= kPostBatch) flush();
}

void PythonRunner::flush() {
  try {
    channel_->post_batch(pending_);
  } catch (const ChannelCancelled&) {
    surface_failure();  // a graph that failed cancelled the channel: its own error, not this one
    throw;
  }
}

void PythonRunner::surface_failure() {
  try {
    drain_outcomes(true);
  } catch (const python_error&) {
    throw;
  } catch (const std::exception& e) {
    recover_from_failure(describe_failure(e.what()));
  }
}

// "aten::select.int received the Python value 7 as index where the traced iterations passed 3".
std::string PythonRunner::describe_scalar_change(const capture::OpRecord& rec, const emit::EmittedGraph::ScalarUse& use,
                                                 const c10::IValue& now) {
  std::ostringstream msg;
  msg << op_name(rec) << " received the Python value " << now;
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

// ---- waiting and values ------------------------------------------------------------------------

void PythonRunner::wait_for_graph(int64_t count) {
  // Python reads after this: its stream must also wait for the graph's (docs/RUNTIME.md, "Streams").
  StreamSync::JoinOnExit join(channel_->streams());
  if (values_->published() >= count) return;
  flush();
  try {
    wait_published(count);
  } catch (const python_error&) {
    throw;  // KeyboardInterrupt
  } catch (const std::exception& e) {
    recover_from_failure(describe_failure(e.what()));
  }
}

void PythonRunner::stop_graph(const std::string& why) {
  pending_.clear();
  channel_->cancel(why);
  GilRelease no_gil;
  while (waited_ < started_) {
    try {
      runner_->wait_iteration(std::chrono::nanoseconds::max());
    } catch (...) {
      // a failed iteration, or one the cancel stopped
    }
    ++waited_;
  }
  runner_->reset();
}

void PythonRunner::recover_from_failure(const std::string& error) {
  stop_graph("the graph failed");
  known_.clear();  // what the graph had not computed did not happen
  values_->clear();
  links_.clear();
  if (in_iteration_ && !diverged_) {
    // Nothing of this iteration can run on the graph any more: the rest of it records real ops.
    diverged_ = true;
    reason_ = "the graph failed: " + error;
    divergence_record_ = -1;
    ++stats_.divergences;
  }
  throw std::runtime_error(error);
}

std::string PythonRunner::describe_failure(const std::string& error) {
  // The graph runs ops in the order Python validated them and publishes each op's outputs
  // when it has run: the first value not published is the op that failed (if Python had
  // reached it; the graph may also have run ahead into ops Python has not validated yet).
  // Iterations queued after the failed one are cancelled at their first channel op, and every
  // publish is one, so the count stays where the failure left it.
  if (error.find("The following operation failed") == std::string::npos) return error;
  const std::optional<int64_t> tag = values_->tag_at(values_->published());
  if (!tag) return error;
  const trace::NodeId node = static_cast<trace::NodeId>(*tag >> 8);
  const uint64_t key = program_.check_key(node);
  if (key == 0) return error;
  program_.add_check(key);
  std::string where;
  if (node_frames_ != nullptr && node < node_frames_->size())
    for (const std::string& frame : (*node_frames_)[node]) where += "\n  " + frame;
  const emit::OpInfo* info = program_.info(node);
  return "terra_torch: " + (info ? c10::toString(info->op.operator_name()) : std::string("an op")) +
         " raised in the graph after Python had gone past it (no except clause of the program covers it, and it "
         "had not raised here before; from now on it is checked before the graph runs it)" +
         (where.empty() ? std::string() : ", issued at:" + where) + "\n" + error;
}

void PythonRunner::wait_published(int64_t count) {
  const auto t0 = Clock::now();
  struct Account {
    PythonRunnerStats& s;
    Clock::time_point t0;
    ~Account() { s.stall_ns += ns_since(t0); }
  } account{stats_, t0};
  GilRelease no_gil;
  auto last_signal_check = t0;
  while (!values_->wait_published(count, std::chrono::milliseconds(2))) {
    if (channel_->cancelled()) {
      // A failed graph cancels the channel before its iteration counts as finished: wait for
      // it (it stops at its next channel op), so that its own error is the one raised.
      drain_outcomes(true);
      throw std::runtime_error("terra_torch: the graph was cancelled (" + channel_->cancel_reason() + ")");
    }
    if (runner_->in_flight() == 0) {
      drain_outcomes(false);  // rethrows the graph's error, if it failed
      if (values_->published() >= count) return;
      throw std::runtime_error("terra_torch internal error: the graph stopped before computing output " +
                               std::to_string(count - 1) + " of the program");
    }
    if (channel_->graph_stuck()) {
      if (values_->published() >= count) return;
      const auto w = channel_->graph_waiting_for();
      std::ostringstream msg;
      msg << "terra_torch internal error: Python needs output " << count - 1 << " of the program but the graph ("
          << values_->published() << " published) waits for ";
      if (w) {
        msg << (w->kind == GraphWait::Kind::kFeed ? "feed " : w->kind == GraphWait::Kind::kGate ? "gate " : "decision ")
            << w->id;
      }
      throw std::runtime_error(msg.str());
    }
    if (Clock::now() - last_signal_check > std::chrono::milliseconds(100)) {
      last_signal_check = Clock::now();
      check_signals();
    }
  }
}

void PythonRunner::refresh(const at::Tensor& holder, const at::Tensor& value) {
  if (!holder.defined() || !value.defined() || holder.unsafeGetTensorImpl() == value.unsafeGetTensorImpl()) return;
  ++stats_.materialized;
  if (value.has_storage()) channel_->streams().reader_uses(value.storage().data_ptr());  // Python's stream reads it now
  auto* ph = dynamic_cast<capture::PlaceholderImpl*>(holder.unsafeGetTensorImpl());
  if (ph != nullptr && !ph->is_bound()) {
    ph->bind(value);  // (copies through without_broadcast when the placeholder is expanded)
    return;
  }
  c10::StorageImpl* storage = holder.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  if (storage->data() == nullptr && storage->nbytes() > 0) {
    // A placeholder's storage that only autograd's saved copies still use: give it memory.
    c10::Allocator* allocator = c10::GetAllocator(holder.device().type());
    storage->set_data_ptr_noswap(allocator->allocate(storage->nbytes()));
    storage->set_allocator(allocator);
  }
  capture::SuspendGuard no_interception;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // not an op of the user's program
  without_broadcast(holder).copy_(without_broadcast(value).expand_as(without_broadcast(holder)));
}

// Where the graph reads one of several producers it reads the one that ran last (value_flow.h);
// Python's input must be the latest output of the latest-run one among `producers` (candidates()).
bool PythonRunner::latest_is(const std::vector<std::pair<trace::NodeId, uint32_t>>& producers,
                             const at::Tensor& t) const {
  int64_t best_seq = -1;
  const std::pair<const void*, int64_t>* best = nullptr;
  for (const auto& [node, output] : producers) {
    const int64_t tag = emit::EmittedGraph::publish_tag(node, output);
    const Latest* latest = latest_.find(tag);
    if (latest == nullptr || latest->seq <= best_seq) continue;
    best_seq = latest->seq;
    best = &latest->where;
  }
  if (best == nullptr || !t.defined() || !t.has_storage()) return best == nullptr;
  return *best == std::make_pair(static_cast<const void*>(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()),
                                 t.storage_offset());
}

// The producers the graph reads for the copy the cursor stands in; every producer of the node's
// input where that copy's set holds "any copy of" a producer; none (so no tensor passes) for a
// copy the emitter never saw.
std::vector<std::pair<trace::NodeId, uint32_t>> PythonRunner::candidates(
    const std::map<std::vector<uint32_t>, std::vector<std::pair<trace::NodeId, uint32_t>>>& per_copy,
    const std::vector<trace::Source>& sources) {
  cursor_.copy_index(copy_);
  auto it = per_copy.find(copy_);
  if (it == per_copy.end()) return {};
  if (!it->second.empty()) return it->second;
  std::vector<std::pair<trace::NodeId, uint32_t>> all;
  for (const trace::Source& src : sources)
    if (src.kind == trace::Source::Kind::kNode) all.emplace_back(src.id, src.output);
  return all;
}

const emit::EmittedGraph::Selection* PythonRunner::selection_at(trace::NodeId node, uint32_t slot) {
  if (emitted_.selected_reads.empty()) return nullptr;
  const auto it = emitted_.selected_reads.find(emit::EmittedGraph::key(node, slot));
  if (it == emitted_.selected_reads.end()) return nullptr;
  cursor_.copy_index(copy_);
  const auto c = it->second.find(copy_);
  return c == it->second.end() ? nullptr : &c->second;
}

bool PythonRunner::in_loop(trace::NodeId n) const {
  return n < emitted_.node_in_loop.size() && emitted_.node_in_loop[n] != 0;
}

std::optional<int64_t> PythonRunner::linked_index(const at::Tensor& t) const {
  const Link* link = links_.find(t.unsafeGetTensorImpl());
  if (link == nullptr || link->expired()) return std::nullopt;
  return link->index;
}

void PythonRunner::drain_outcomes(bool block) {
  GilRelease no_gil;
  while (waited_ < started_) {
    bool done = false;
    try {
      done = runner_->wait_iteration(block ? std::chrono::nanoseconds::max() : std::chrono::nanoseconds(0));
    } catch (...) {
      ++waited_;
      throw;
    }
    if (!done) return;
    ++waited_;
  }
}

// ---- divergence and synchronization ------------------------------------------------------------

PythonRunner::Verdict PythonRunner::diverge(std::string reason, int32_t record) {
  diverged_ = true;
  reason_ = std::move(reason);
  divergence_record_ = record;
  ++stats_.divergences;
  stop_and_materialize("divergence: " + reason_);
  return Verdict::kDiverged;
}

void PythonRunner::stop_and_materialize(const std::string& why) {
  // Let the graph finish what Python validated (it cannot run past it: side effects wait at
  // gates), then stop it and give every live placeholder the value it computed.
  std::string failure;
  try {
    wait_for_graph(values_->expected());
  } catch (const std::exception& e) {
    failure = e.what();
  }
  stop_graph(why);
  for (const auto& [holder, value] : values_->live_values()) refresh(holder, value);
  values_->clear();
  links_.clear();
  if (!failure.empty())
    throw std::runtime_error("terra_torch: stopping the graph (" + why + ") failed: " + failure);
}

void PythonRunner::synchronize(bool finish) {
  if (stopped_) return;
  flush();
  wait_for_graph(values_->expected());
  for (const auto& [holder, value] : values_->live_values()) refresh(holder, value);
  if (finish) {
    TORCH_CHECK(!in_iteration_, "terra_torch internal error: cannot finish the graph inside an iteration");
    drain_outcomes(true);
  }
}

void PythonRunner::materialize(const at::Tensor& t) {
  if (stopped_ || !t.defined()) return;
  const auto linked = linked_index(t);
  flush();
  wait_for_graph(values_->expected());
  if (!linked) {
    TORCH_CHECK(!capture::is_placeholder(t), "terra_torch: this placeholder has no value the runtime can give it "
                "(it was made outside the ops terra_torch follows)");
    return;  // a real tensor: the wait above let the graph finish its updates
  }
  std::optional<at::Tensor> v = values_->value(*linked);
  TORCH_CHECK(v.has_value(), "terra_torch internal error: the graph did not keep a live placeholder's value");
  refresh(t, *v);
}

void PythonRunner::shut_down() {
  if (stopped_) return;
  if (!in_iteration_) synchronize(true);
  {
    GilRelease no_gil;
    runner_->shutdown();
  }
  values_->clear();
  links_.clear();
  stopped_ = true;
}

}  // namespace terra::runtime
