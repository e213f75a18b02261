// PythonRunner: the iteration's lifecycle (begin, end, synchronize, shut down), the outputs it
// hands out and their values (materialization, known values), divergence. The per-op check is in
// op_check.cpp, the link to the worker (posts, waits, stop, drain, recovery) in graph_link.cpp,
// backward() in backward_replay.cpp.
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
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "capture/collectives.h"
#include "capture/op_arguments.h"
#include "capture/placeholder.h"
#include "common/env.h"
#include "capture/region.h"
#include "capture/terra_key.h"
#include "capture/value_checks.h"
#include "runtime/executor.h"
#include "runtime/gil_release.h"
#include "runtime/runner_helpers.h"
#include "trace/hash.h"

namespace terra::runtime {

namespace {

// A tensor whose broadcast dimensions (stride 0) are cut to one element: an expanded placeholder
// is given its value through it, since a copy into memory that several elements share is refused.
at::Tensor without_broadcast(const at::Tensor& t) {
  at::Tensor out = t;
  for (int64_t d = 0; d < out.dim(); ++d)
    if (out.stride(d) == 0 && out.size(d) > 1) out = out.narrow(d, 0, 1);
  return out;
}

// TERRA_EARLY_BATCHES=0 keeps every batch whole, TERRA_EARLY_MEMORY=N sets how many iterations
// send early after a read waited (runtime/early_batches.h), so that benchmarks.step_ab can time
// the policies in one build, in interleaved processes.
EarlyBatchPolicy early_batch_policy() {
  const char* memory = std::getenv("TERRA_EARLY_MEMORY");
  return EarlyBatchPolicy(!common::switched_off("TERRA_EARLY_BATCHES"),
                          memory != nullptr && *memory != '\0' ? std::atoi(memory)
                                                                : EarlyBatchPolicy::kDefaultMemory);
}

}  // namespace

PythonRunner::PythonRunner(emit::CapturedProgram& program, const trace::Program& structured,
                           const emit::EmittedGraph& emitted, Drive drive,
                           const std::vector<std::vector<std::string>>* node_frames,
                           std::shared_ptr<Executor> executor)
    : program_(program),
      node_frames_(node_frames),
      structured_(structured),
      emitted_(emitted),
      check_plan_(emitted),
      drive_(drive),
      channel_(std::make_shared<ConcurrentChannel>()),
      values_(std::make_shared<ValueTable>()),
      cursor_(structured),
      early_batches_(early_batch_policy()) {
  channel_->attach_values(values_);
  channel_->use_streams(StreamSync::for_devices(program.devices()));
  // (The interpreter's code is made by the worker at its first run, while Python goes on.)
  static const CodeWhen when = common::switched_off("TERRA_CODE_ON_WORKER") ? CodeWhen::kNow : CodeWhen::kFirstRun;
  if (!executor) executor = std::make_shared<TorchScriptExecutor>(emitted.graph, TorchScriptMode::kInterpreter, when);
  runner_ = std::make_unique<GraphRunner>(std::move(executor), channel_);
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
    if (channel_->cancelled()) {
      drain_outcomes(true);
    } else {
      waited_ += runner_->take_finished();
      if (drive_ == Drive::kCoExec) wait_until_in_flight_below(kMaxIterationsAhead);
    }
    if (relearn_known_ && known_values_enabled_) known_.relearn_from_memory();
    relearn_known_ = false;
    release_kept_feeds();
  } catch (const std::exception& e) {
    // The graph failed in an op Python did not check (an index out of range): what it had
    // not computed is lost. Start clean so that the program can go on after the error.
    recover_from_failure(describe_failure(e.what()));
  }
  send_early_ = early_batches_.next_iteration(read_waits_);
  cursor_.reset();
  path_ = 0;
  recording_.reset();
  call_recording_.reset();
  record_nodes_.clear();
  record_copies_.clear();
  latest_.clear();
  diverged_ = false;
  at_unsupported_ = false;
  reason_.clear();
  divergence_record_ = -1;
  if (links_.size() >= 2 * links_pruned_ + 64) {
    links_.erase_if([](const c10::TensorImpl*, const Link& link) { return link.expired(); });
    links_pruned_ = links_.size();
  }
  if (known_.wants_pruning()) known_.prune();
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
  known_.settle();
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

void PythonRunner::materialize_inputs(c10::ArrayRef<c10::IValue> args) {
  // A read: what it reads must have run (read_horizon), and the placeholders it reads get their
  // values.
  ++stats_.reads;
  if (recording_) not_replayable("the backward reads data");
  if (call_recording_) call_not_replayable("the call reads data");
  flush();  // (all of it: the graph goes on with the rest while Python reads)
  const int64_t all = values_->expected();
  const int64_t horizon = read_horizon(args);
  if (horizon < all) ++stats_.early_reads;
  wait_for_graph(horizon);
  auto give_value = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    if (known_values_enabled_ && known_.memory_is_value(t)) return;  // (read_horizon: a view of a real tensor)
    if (const auto linked = linked_index(t)) {
      std::optional<at::Tensor> v = values_->value(*linked);
      if (!v && horizon < all) {
        // (Not expected: read_horizon's rules say the value is there. The general rule then.)
        wait_for_graph(all);
        v = values_->value(*linked);
      }
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

PythonRunner::Verdict PythonRunner::admit(const capture::Region& region, const capture::OpRecord& rec, int32_t index,
                                          c10::ArrayRef<c10::IValue> args, size_t num_outputs,
                                          int64_t fewest_elements) {
  // The known arguments are taken before validate(): a fresh tensor's value is read from its
  // memory, which the graph may write as soon as validate() has posted this op's gate (Adam's
  // `step_t += 1` then read one step ahead, under load).
  follow_.reset();
  sync_after_ = -1;
  const bool follows = known_arguments(rec.op, args, fewest_elements);
  const Verdict verdict = validate(region, rec, index, args, num_outputs, false, false);
  if (verdict == Verdict::kDiverged) return verdict;
  if (follows) follow_ = Follow{index, rec.op};
  // One walk over what the op writes. Not followed, its written tensors have no known value from
  // now on (a version counter does not always say so: a foreach kernel bumps its tensors'
  // versions from inside, where co-execution never runs it; and while nothing is known, written
  // storages are never fresh); memory Python can touch without an op makes outputs() wait for
  // the graph.
  capture::for_each_written(rec.op, args, [&](const at::Tensor& t) {
    if (!follows && known_values_enabled_) known_.forget(t);
    if (python_writable_memory(t)) sync_after_ = index;
    if (call_recording_) note_call_write(t);
  });
  return verdict;
}

bool PythonRunner::known_values_answer(const c10::OperatorHandle& op) {
  known_.drop_planned();
  // Never a collective: followed, or kept as a recipe for a read, it would run a second time on
  // this thread, and the other ranks would see it twice (a DDP run waited 30 s for a recv).
  if (!known_values_enabled_ || diverged_ || capture::is_collective(op)) return false;
  known_.settle();  // (the previous op has returned through autograd; validate() has not run yet)
  return true;
}

bool PythonRunner::known_read_arguments(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                        torch::jit::Stack& out) {
  if (!known_values_answer(op)) return false;
  auto link = [this](const at::Tensor& t) { return linked_index(t); };
  // (published already: no wait, no lock, nothing taken)
  auto ready = [this](int64_t index) { return values_->spin_published(index + 1, std::chrono::nanoseconds(0)); };
  bool waited = false;  // (blocked for the graph: a value published already is a take, not a wait)
  auto published = [this, &waited, &ready](int64_t index) -> std::optional<at::Tensor> {
    waited |= !ready(index);
    wait_for_graph(index + 1);
    return values_->value(index);
  };
  bool taken = false;
  auto published_now = [this, &taken, &ready](int64_t index) -> std::optional<at::Tensor> {
    if (!ready(index)) return std::nullopt;
    std::optional<at::Tensor> v = values_->value(index);
    taken |= v.has_value();
    return v;
  };
  const KnownValues::GraphValues graph{link, published, published_now, ready};
  if (!known_.substitute(args, out, &graph)) return false;
  ++stats_.known_reads;
  stats_.known_reads_published += taken ? 1 : 0;
  stats_.known_reads_close += known_.waited_close() ? 1 : 0;
  stats_.known_reads_recipe_waited += waited && known_.recipe_runs() > 0 ? 1 : 0;
  stats_.known_reads_waited += waited ? 1 : 0;
  return true;
}

bool PythonRunner::known_arguments(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                   int64_t fewest_elements) {
  if (!known_values_answer(op)) return false;
  if (!known_.substitute(args, known_args_)) {
    // (kept by outputs() for its small outputs)
    known_.plan_recipe(op, args, [this](const at::Tensor& t) { return linked_index(t); }, fewest_elements);
    return false;
  }
  known_written_.clear();
  capture::for_each_written(op, args, [&](const at::Tensor& t) { known_written_.push_back(t); });
  return true;
}

void PythonRunner::outputs(int32_t index, c10::ArrayRef<at::Tensor> outputs) {
  claim_outputs(index, outputs);
  if (sync_after_ == index) {
    sync_after_ = -1;
    catch_up();
  }
  if (!follow_ || follow_->index != index) return;  // (a stale one: an admitted op that raised before its outputs)
  known_.follow(follow_->op, known_args_, known_written_, outputs);
  follow_.reset();
  known_written_.clear();
}

void PythonRunner::claim_outputs(int32_t index, c10::ArrayRef<at::Tensor> outputs) {
  known_.keep_recipe(outputs);
  if (call_recording_) note_call_outputs(index, outputs);
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
    path_ = detail::hash_sizes(path_, t);
    const int64_t tag = emit::EmittedGraph::publish_tag(node, k);
    note_latest(tag, record_copies_.at(index), t);
    expect_output(tag, t);
  }
}

void PythonRunner::expect_output(int64_t tag, const at::Tensor& t) {
  const bool keep = t.defined() && (capture::is_placeholder(t) || linked_index(t).has_value());
  const int64_t i = values_->expect(tag, keep ? t : at::Tensor());
  if (!keep) return;
  auto [link, inserted] = links_.try_emplace(t.unsafeGetTensorImpl());
  if (!inserted && !link->expired()) values_->retire(link->index);  // in place: read the newer value
  // (an expired entry: a new tensor at a dead one's address)
  link->impl.emplace(t.getIntrusivePtr());
  link->index = i;
}

void PythonRunner::note_latest(int64_t tag, uint64_t copy, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return;
  const std::pair<const void*, int64_t> where{t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl(),
                                              t.storage_offset()};
  latest_.try_emplace(static_cast<uint64_t>(tag)).first->where = where;
  if (copy != 0) latest_.try_emplace(latest_key(tag, copy)).first->where = where;
}

bool PythonRunner::check_first(const capture::OpRecord& rec) {
  const bool check = !diverged_ && program_.is_check(rec.location, rec.op);
  if (check && recording_) not_replayable("an op of the backward is checked before the graph runs it");
  if (check && call_recording_) call_not_replayable("an op of the call is checked before the graph runs it");
  return check;
}

PythonRunner::Verdict PythonRunner::check_raised(const capture::Region& region, const capture::OpRecord& rec,
                                                 int32_t index) {
  // (The Session learns the key from region.raised() when it merges the iteration.)
  if (emitted_.gated_checks.count(capture::check_key(rec.location, rec.op)) != 0)
    return Verdict::kPlaceholder;  // the graph waits at its gate
  // The graph was generated before this op was known to raise: it may have run it already.
  return diverge(detail::op_name(rec) + " raised (checked before the graph ran it), and this graph does not wait for the check",
                 index);
}

void PythonRunner::bind_base_first(const at::Tensor& part) {
  if (part.is_view()) {
    const at::Tensor base(part._base());
    if (!capture::is_placeholder(base) || capture::adopt_if_backed(base)) return;
    if (const auto linked = linked_index(base)) {
      if (std::optional<at::Tensor> v = values_->value(*linked)) {
        refresh(base, *v);
        return;
      }
    }
  }
  // No view whose base has a value here: `.data` or `.detach()` of a view is a tensor over part of
  // its base's storage that records no base. torch.nn.utils.vector_to_parameters makes two such
  // (`p.data = vec[i:j].view_as(p).data` for every parameter): the first one bound gave the storage
  // memory and wrote its own part only, and the second, over memory now, was taken for an ordinary
  // tensor with garbage in its part (hunt of session 31: a Linear's bias 0 or 1e30). The value the
  // table holds for the whole storage, if any, fills it first.
  c10::StorageImpl* storage = part.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  if (storage == nullptr || storage->data() != nullptr || storage->nbytes() == 0) return;
  if (part.storage_offset() == 0 && part.is_contiguous() && part.numel() * part.element_size() == storage->nbytes())
    return;  // (it fills the storage itself)
  const auto whole = values_->index_covering(storage, part.dtype(), storage->nbytes());
  if (!whole) return;  // (not covered: the rest of the storage stays as the part's bind leaves it)
  const std::optional<at::Tensor> v = values_->value(*whole);
  if (!v || !v->defined()) return;
  capture::give_memory(*storage, part.device().type());
  capture::SuspendGuard no_interception;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // not an op of the user's program
  at::Tensor over = at::empty({0}, v->options());
  over.set_(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage)), 0, v->sizes(), v->strides());
  over.copy_(*v);
}

void PythonRunner::refresh(const at::Tensor& holder, const at::Tensor& value) {
  if (!holder.defined() || !value.defined() || holder.unsafeGetTensorImpl() == value.unsafeGetTensorImpl()) return;
  ++stats_.materialized;
  if (value.has_storage()) channel_->streams().reader_uses(value.storage().data_ptr());  // Python's stream reads it now
  auto* ph = dynamic_cast<capture::PlaceholderImpl*>(holder.unsafeGetTensorImpl());
  if (ph != nullptr && ph->over_memory()) {  // (adopted already, or now)
    TORCH_CHECK(ph->adopt(), "terra_torch internal error: a view over memory lost its memory");
    return;  // (its memory is its value: PlaceholderImpl::over_memory)
  }
  if (ph != nullptr && !ph->is_bound()) {
    // A view's value fills only its part of the storage it shares with its base, and the base,
    // backed then, would be taken for an ordinary tensor holding its value (adopt_if_backed)
    // with the rest uninitialized: `idx = perm[0:10]` read by an index op, then `perm[10:20]`
    // in the next iteration indexed with garbage. So the base gets its whole value first.
    bind_base_first(holder);
    if (!ph->adopt()) {
      ph->bind(value);  // (copies through without_broadcast when the placeholder is expanded)
      return;
    }
    // (the base's value is in place; the view's own, newer where it was written in place, follows)
  }
  c10::StorageImpl* storage = holder.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  // (A placeholder's storage that only autograd's saved copies still use.)
  if (storage->nbytes() > 0) capture::give_memory(*storage, holder.device().type());
  capture::SuspendGuard no_interception;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // not an op of the user's program
  without_broadcast(holder).copy_(without_broadcast(value).expand_as(without_broadcast(holder)));
}

int64_t PythonRunner::read_horizon(c10::ArrayRef<c10::IValue> args) const {
  // In general everything Python validated so far: the op may read a tensor that an op already
  // validated writes in place, and the graph runs in program order. But a placeholder whose
  // storage no co-executed op has written (KnownValues remembers every written storage, views
  // included) still holds what its producer output, at its link index; a read of only such
  // placeholders waits for those indices. `loss.item()` after `opt.step()` waits for the
  // forward, not for the backward and the step, which the graph runs while Python goes on.
  const int64_t all = values_->expected();
  if (!known_values_enabled_) return all;
  int64_t need = 0;
  auto reaches = [&](const at::Tensor& t) {
    if (!t.defined()) return true;
    // A real tensor's memory, or a view's of one (the batch `ids[i]` an embedding's check reads).
    if (known_.memory_is_value(t)) return true;
    if (known_.ever_written(t) || !capture::is_placeholder(t)) return false;
    const std::optional<int64_t> linked = linked_index(t);
    if (!linked) return false;
    need = std::max(need, *linked + 1);
    return true;
  };
  for (const c10::IValue& a : args) {
    if (a.isTensor()) {
      if (!reaches(a.toTensor())) return all;
    } else if (a.isTensorList()) {
      for (const at::Tensor& t : a.toTensorList().vec())
        if (!reaches(t)) return all;
    } else if (a.isOptionalTensorList()) {
      for (const c10::IValue& e : a.toListRef())
        if (e.isTensor() && !reaches(e.toTensor())) return all;
    }
  }
  return std::min(need, all);
}

void PythonRunner::outside_memory(const at::Tensor& t) {
  const Link* link = links_.find(t.unsafeGetTensorImpl());
  if (link == nullptr) return;
  values_->retire(link->index);
  links_.erase(t.unsafeGetTensorImpl());
}

void PythonRunner::storage_replaced(const at::Tensor& self, const at::Tensor& from) {
  catch_up();
  outside_memory(self);
  outside_memory(from);
  // `p.data = new` keeps p's TensorImpl and its version counter while its value changes: a value
  // known for p before would pass for current (KnownValues checks the version). A co-executed
  // `Linear` under no_grad then computed with last iteration's bias, now and then (session 31
  // hunt: 4 of 6 runs).
  if (known_values_enabled_) {
    known_.forget(self);
    known_.forget(from);
  }
}

std::optional<int64_t> PythonRunner::linked_index(const at::Tensor& t) const {
  const Link* link = links_.find(t.unsafeGetTensorImpl());
  if (link != nullptr && !link->expired()) return link->index;
  if (!capture::is_placeholder(t)) return std::nullopt;
  // Another TensorImpl over a linked placeholder's storage with its metadata: autograd's copy of
  // a saved output (SavedVariable keeps tensor_data(), a shallow copy), which a backward reads
  // when the output came from an earlier iteration (two forward calls, one backward: a siamese
  // loss, REINFORCE's log-probs). Rare, so searched rather than indexed; of several links over
  // that memory the newest entry holds its latest value (an in-place op links a later one).
  const c10::TensorImpl* want = t.unsafeGetTensorImpl();
  std::optional<int64_t> found;
  links_.for_each([&](const c10::TensorImpl* key, const Link& l) {
    if (l.expired() || key == want) return;
    const auto impl = l.impl->lock();
    if (!impl || impl->unsafe_storage().unsafeGetStorageImpl() != want->unsafe_storage().unsafeGetStorageImpl() ||
        impl->dtype() != want->dtype() || impl->storage_offset() != want->storage_offset() ||
        impl->sizes() != want->sizes() || impl->strides() != want->strides() ||
        impl->is_conj() != want->is_conj() || impl->is_neg() != want->is_neg())
      return;
    if (!found || l.index > *found) found = l.index;
  });
  // The output itself is gone (ReLU's output, consumed by Dropout, in a forward whose backward
  // runs in the next iteration): its link went with it, but its value is kept while the
  // storage lives.
  if (!found) found = values_->index_over_storage(t);
  return found;
}

// ---- divergence and synchronization ------------------------------------------------------------

PythonRunner::Verdict PythonRunner::diverge(std::string reason, int32_t record) {
  known_.clear();  // the rest of the iteration writes for real: no copy survives it
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
  forget_links();
  if (!failure.empty())
    throw std::runtime_error("terra_torch: stopping the graph (" + why + ") failed: " + failure);
}

void PythonRunner::catch_up() {
  if (stopped_) return;
  flush();
  wait_for_graph(values_->expected());  // (every op publishes: docs/ARCHITECTURE.md)
}

void PythonRunner::synchronize(bool finish) {
  if (stopped_) return;
  catch_up();
  for (const auto& [holder, value] : values_->live_values()) refresh(holder, value);
  if (finish) {
    TORCH_CHECK(!in_iteration_, "terra_torch internal error: cannot finish the graph inside an iteration");
    drain_outcomes(true);
    // Every placeholder has its memory now, and eager code may write it before the next
    // iteration (a program that runs eagerly for a while, a gradient scaled by hand after
    // terra_torch.synchronize()): the next iteration must feed that memory, not the value the
    // table kept for the placeholder, so the table and the links go, as after a divergence.
    values_->clear();
    forget_links();
    relearn_known_ = true;  // (at the next co-executed iteration: eager code may write them first)
  }
}

void PythonRunner::materialize(const at::Tensor& t) {
  if (stopped_ || !t.defined()) return;
  const auto linked = linked_index(t);
  catch_up();
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
  forget_links();
  stopped_ = true;
}

}  // namespace terra::runtime
