#include "capture/region.h"

#include <ATen/ops/empty_strided.h>
#include <ATen/SequenceNumber.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <typeinfo>

#include "capture/coexec_hook.h"
#include "capture/collectives.h"
#include "capture/draw_side.h"
#include "capture/grad_mode_kernels.h"
#include "capture/interceptor.h"
#include "capture/op_arguments.h"
#include "capture/outside_program.h"
#include "capture/placeholder.h"
#include "capture/schema_aliases.h"
#include "capture/shape_inference.h"
#include "capture/terra_key.h"
#include "capture/value_checks.h"

#include "common/scoped_flag.h"
#include "trace/hash.h"

namespace terra::capture {

namespace {

std::atomic<Region*> g_active{nullptr};
std::atomic<bool> g_failure_armed{false};
std::mutex g_failure_mu;
std::string g_failure_op;  // guarded by g_failure_mu

// Throws if a failure is armed for `op` (and disarms it).
void check_injected_failure(const c10::OperatorHandle& op) {
  std::lock_guard<std::mutex> lock(g_failure_mu);
  const std::string name = c10::toString(op.operator_name());
  if (g_failure_op.empty() || name.rfind(g_failure_op, 0) != 0) return;
  g_failure_op.clear();
  g_failure_armed.store(false, std::memory_order_relaxed);
  TORCH_CHECK(false, "terra_torch: injected failure at ", name, " (terra_torch.debug.fail_at)");
}
std::atomic<size_t> g_expected_ops{256};  // ops of the latest closed region
std::atomic<size_t> g_expected_externals{64};  // and its external inputs

// A Python scalar passed straight to an op (a learning rate, Adam's bias correction, the index of
// x[i], the sizes of a view, a keepdim flag) is a value of the program, not part of the op's
// identity: it is hashed by type only (an int list or a list of floats, is_float_list, by type and
// length), so that iterations that differ in it share one TraceGraph node, and the generated
// graph receives it as a feed (emit: scalar feeds, captured_program.h: scalar_kind). Scalars
// inside other lists stay part of the identity, and so do all of a terra:: op's (`generalize`
// false). Opaque objects (the profiler's record handle, a ScriptObject new every iteration) are
// hashed by type: their identity is not the program's.
uint64_t hash_attribute(uint64_t h, const c10::IValue& v, bool top_level = true, bool generalize = true) {
  h = trace::hash_combine(h, static_cast<uint64_t>(v.tag));
  const bool value = top_level && generalize;
  if (v.isInt()) return value ? h : trace::hash_combine(h, static_cast<uint64_t>(v.toInt()));
  if (v.isBool()) return value ? h : trace::hash_combine(h, v.toBool());
  if (v.isDouble() && top_level) return h;
  if (v.isDouble()) {
    double d = v.toDouble();
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    return trace::hash_combine(h, bits);
  }
  if (v.isString()) return trace::hash_combine(h, std::hash<std::string>()(v.toStringRef()));
  if (v.isDevice()) return trace::hash_combine(h, static_cast<uint64_t>(v.toDevice().type()) * 256 + v.toDevice().index());
  if ((v.isIntList() || is_float_list(v)) && value) return trace::hash_combine(h, v.toListRef().size());
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) h = hash_attribute(h, e, false);
    return h;
  }
  return h;  // None, Generator, Object, ...: the tag says enough
}

// emplace_back(MetaOf{t}) builds the TensorMeta in the record's slot (the conversion's result
// is not a temporary), instead of building it aside and moving its two SmallVectors in.
struct MetaOf {
  const at::Tensor& t;
  operator TensorMeta() const { return meta_of(t); }
};

bool is_tensor_like(const c10::IValue& v) {
  return v.isTensor() || v.isTensorList() || v.isOptionalTensorList();
}

// Neither takes nor gives tensors. Almost every op has a tensor argument, so the arguments at
// hand answer first and the schema's return types are read only for the rest.
bool is_host_op(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  for (const c10::IValue& v : args)
    if (is_tensor_like(v)) return false;
  for (const auto& ret : op.schema().returns())
    if (type_contains_tensor(ret.type())) return false;
  return true;
}

// Whether an op that restrides an argument in place (OutputSpec::restrides: transpose_,
// squeeze_, as_strided_; nn.GRU and nn.LSTM with batch_first=True end with `transpose_(0, 1)` on
// their output, aten/src/ATen/native/RNN.cpp) would restride a tensor that is not a placeholder
// (a parameter, an input, a placeholder already given its value): Python must see the new
// metadata at once, and the graph, which holds the same tensor, would apply the op a second time.
bool restrides_a_real_tensor(const InferredOutputs& inferred, c10::ArrayRef<c10::IValue> args) {
  if (!inferred.restrides) return false;  // (nearly every op)
  for (const ReturnSpec& ret : inferred.returns)
    for (const OutputSpec& spec : ret.tensors)
      if (spec.restrides && !is_placeholder(args[spec.argument].toTensor())) return true;
  return false;
}

}  // namespace

Region* active_region() { return g_active.load(std::memory_order_acquire); }

namespace {
std::atomic<bool> g_forked_child{false};
}  // namespace

bool forked_child() { return g_forked_child.load(std::memory_order_relaxed); }

void forget_regions_after_fork() {
  // (The region object itself is left as it is: its mutex may have been held by a thread that
  // does not exist here.)
  g_forked_child.store(true, std::memory_order_relaxed);
  g_active.store(nullptr, std::memory_order_release);
  auto local = c10::impl::tls_local_dispatch_key_set();
  local.included_ = c10::DispatchKeySet(c10::DispatchKeySet::RAW, local.included_.raw_repr() & ~terra_keyset().raw_repr());
  c10::impl::_force_tls_local_dispatch_key_set(local);
}

void inject_failure(const std::string& op) {
  std::lock_guard<std::mutex> lock(g_failure_mu);
  g_failure_op = op;
  g_failure_armed.store(!op.empty(), std::memory_order_relaxed);
}

Region::Region(Mode mode, PyFrameObject* stop_frame) : mode_(mode), locations_(stop_frame) {
  // Sized up front: growing the tables rehashes every entry (it cost more per op than the
  // lookups), while a table much larger than the region is initialised and swept for nothing
  // (a 70-op training step paid for 2,048 slots). Regions repeat one step, so the previous
  // region's size is the best guess.
  const size_t expected = g_expected_ops.load(std::memory_order_relaxed);
  trace_.ops.reserve(expected + expected / 8);
  const size_t externals = g_expected_externals.load(std::memory_order_relaxed);
  trace_.externals.reserve(externals + externals / 8);
  externals_alive_.reserve(externals + externals / 8);
  produced_.reserve(expected);
  produced_storage_.reserve(expected);
}

Region::Region(CoExecHook* hook, PyFrameObject* stop_frame) : Region(Mode::CoExec, stop_frame) { hook_ = hook; }

Region::~Region() {
  if (open_) close();
}

void Region::open() {
  Region* expected = nullptr;
  TORCH_CHECK(g_active.compare_exchange_strong(expected, this),
              "terra_torch: a capture region is already open; regions do not nest");
  intercept_.emplace();
  open_ = true;
}

void Region::close() {
  if (!open_) return;
  intercept_.reset();
  g_active.store(nullptr, std::memory_order_release);
  open_ = false;
  g_expected_ops.store(std::max<size_t>(trace_.ops.size(), 16), std::memory_order_relaxed);
  g_expected_externals.store(std::max<size_t>(trace_.externals.size(), 8), std::memory_order_relaxed);
  // The tables only serve the open region: emptied (releasing their pins), their slots kept
  // for reuse().
  produced_.clear();
  produced_storage_.clear();
}

void Region::reuse(PyFrameObject* stop_frame) {
  TORCH_CHECK(!open_, "terra_torch internal error: an open region cannot be reused");
  TORCH_CHECK(hook_ != nullptr, "terra_torch internal error: only co-execution regions are reused");
  mode_ = Mode::CoExec;  // (a divergence turned it to recording)
  trace_.ops.clear();
  trace_.externals.clear();
  externals_alive_.clear();
  produced_.clear();
  produced_storage_.clear();
  external_index_.clear();
  node_location_.clear();
  last_noted_sequence_nr_ = UINT64_MAX;
  last_backward_node_ = nullptr;
  backward_index_ = 0;
  last_loops_.clear();
  raised_.clear();
  unsupported_.clear();
  handled_ = 0;
  locations_.restart(stop_frame);
}

std::optional<ValueRef> Region::find_produced(const at::Tensor& t) const {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (const Produced* p = produced_.find(impl)) return p->ref;
  if (t.has_storage()) {
    if (const StorageEntry* entry = produced_storage_.find(impl->unsafe_storage().unsafeGetStorageImpl())) {
      // Newest first: after an in-place op the newest version is the one to read.
      for (auto alias = entry->aliases.rbegin(); alias != entry->aliases.rend(); ++alias) {
        const TensorMeta& m = trace_.ops[alias->record].outputs[alias->output];
        if (m.storage_offset == impl->storage_offset() && caffe2::TypeMeta::fromScalarType(m.dtype) == impl->dtype() &&
            c10::IntArrayRef(m.sizes) == impl->sizes() && c10::IntArrayRef(m.strides) == impl->strides() &&
            m.conj == impl->is_conj() && m.neg == impl->is_neg())
          return *alias;
      }
    }
  }
  return std::nullopt;
}

uint64_t Region::Reader::hash() const {
  return trace::hash_combine(trace::hash_combine(location, static_cast<uint64_t>(argument)),
                             static_cast<uint64_t>(list_index + 1));
}

ValueRef Region::reference(const at::Tensor& t, const Reader* reader) {
  if (std::optional<ValueRef> ref = find_produced(t)) return *ref;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->is_wrapped_number()) {
    // A Python number the arg parser wrapped for this one call (PythonArgs::tensor_slow makes a
    // fresh tensor of its own, scalar_to_tensor): nothing else holds it and no op writes it (it
    // is never `self`), so it is kept as it is (the graph reads it when it is fed). It was copied
    // before, 2.8% of the Python thread's instructions in a co-executed Adam step (callgrind).
    // Not deduplicated by address: the next object at that address is another tensor.
    trace_.externals.push_back({meta_of(t), impl, reader ? reader->hash() : 0, true});
    externals_alive_.push_back(t);
    ValueRef ref;
    ref.external = static_cast<int32_t>(trace_.externals.size() - 1);
    return ref;
  }
  auto [ext, inserted] = external_index_.try_emplace(impl);
  if (inserted) {
    *ext = static_cast<int32_t>(trace_.externals.size());
    trace_.externals.push_back({meta_of(t), impl, reader ? reader->hash() : 0, false});
    externals_alive_.push_back(t);
  }
  ValueRef ref;
  ref.external = *ext;
  return ref;
}

void Region::produce(const at::Tensor& t, int32_t record, int32_t output) {
  // Called right after trace_.ops[record].outputs[output] was set to t's metadata: the storage
  // aliases below compare against that record.
  if (!t.defined()) return;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  ValueRef ref;
  ref.record = record;
  ref.output = output;
  // In-place ops return their input: its newest version is this output from now on (the pin
  // taken when it was first seen still holds the same address).
  auto [produced, fresh] = produced_.try_emplace(impl);
  if (fresh) produced->impl.emplace(t.getIntrusivePtr());
  produced->ref = ref;
  if (t.has_storage()) {
    const c10::Storage& storage = impl->unsafe_storage();
    auto [entry, first] = produced_storage_.try_emplace(storage.unsafeGetStorageImpl());
    if (first) entry->storage.emplace(storage.getWeakStorageImpl());
    entry->aliases.push_back(ref);
  }
}

void Region::add_inputs_and_attributes(OpRecord& rec, c10::ArrayRef<c10::IValue> args) {
  uint64_t h = 0x5eed;
  // (emit::generalizes, without the emit layer: terra:: ops keep their scalars in the identity)
  const bool generalize = rec.op.operator_name().getNamespace() != "terra";
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = args[i];
    Reader reader{rec.location, static_cast<int64_t>(i), -1};
    if (v.isTensor()) {
      if (v.toTensor().defined()) rec.inputs.push_back({int32_t(i), -1, reference(v.toTensor(), &reader)});
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t k = 0; k < list.size(); ++k) {
        at::Tensor e = list.get(k);
        reader.list_index = static_cast<int64_t>(k);
        if (e.defined()) rec.inputs.push_back({int32_t(i), int32_t(k), reference(e, &reader)});
      }
    } else if (v.isOptionalTensorList()) {
      int32_t k = 0;
      for (const c10::IValue& e : v.toListRef()) {
        reader.list_index = k;
        if (e.isTensor() && e.toTensor().defined()) rec.inputs.push_back({int32_t(i), k, reference(e.toTensor(), &reader)});
        ++k;
      }
    }
    if (!is_tensor_like(v)) {
      rec.attributes.push_back(v);
      rec.attribute_arguments.push_back(static_cast<int16_t>(i));
      h = hash_attribute(h, v, true, generalize);
    }
  }
  rec.attributes_hash = h;
  note_graph_draws(rec.op, args);  // (capture/draw_side.h)
}

// ---- ops outside the program ---------------------------------------------------------------------

bool Region::outside_input(const at::Tensor& t) const {
  if (is_placeholder(t)) return false;
  if (!t.has_storage()) return produced_.find(t.unsafeGetTensorImpl()) == nullptr;
  // By storage, not find_produced's storage and layout: any alias of a value of this iteration
  // (produce() lists every produced storage), whatever its sizes, is one.
  const c10::StorageImpl* storage = t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  return produced_storage_.find(storage) == nullptr && !program_wrote(storage);
}

bool Region::outside_tensor(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu_);
  return t.defined() && outside_input(t);
}

bool Region::runs_outside(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) const {
  // Random numbers from a generator the graph draws from keep program order only on the graph's
  // side (capture/draw_side.h).
  if (op.hasTag(at::Tag::nondeterministic_seeded) && !python_draws(op, args)) return false;
  if (is_collective(op)) return false;
  const c10::FunctionSchema& schema = op.schema();
  auto fits = [&](const at::Tensor& t, size_t a) {
    if (!t.defined()) return true;
    if (!outside_input(t)) return false;
    // A write only into what the block made: anything else may be read by the graph later.
    return !writes_argument(schema, a) ||
           (t.has_storage() && made_outside(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()));
  };
  for (size_t a = 0; a < args.size(); ++a) {
    const c10::IValue& v = args[a];
    if (v.isTensor()) {
      if (!fits(v.toTensor(), a)) return false;
    } else if (v.isTensorList()) {
      for (const at::Tensor& e : v.toTensorList().vec())
        if (!fits(e, a)) return false;
    } else if (v.isOptionalTensorList()) {
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor() && !fits(e.toTensor(), a)) return false;
    } else if (v.isStorage()) {
      // Unpickling a batch a worker process sent: `set_` of shared memory into a tensor the
      // block made (Region::adopt_outside_memory's case, but for a real tensor no op has read).
      const c10::StorageImpl* storage = v.toStorage().unsafeGetStorageImpl();
      if (produced_storage_.find(storage) != nullptr || program_wrote(storage)) return false;
    }
  }
  return true;
}

void Region::note_program_writes(const OpRecord& rec, c10::ArrayRef<c10::IValue> args) {
  // Every real tensor the op writes that is no value of this iteration, a training batch norm's
  // running statistics included: its schema does not say that it writes them
  // (capture/op_arguments.h), and `bn.running_mean.sum()` in a block was computed from memory
  // the graph had not updated yet (test_data_loading.py).
  for_each_written(rec.op, args, [&](const at::Tensor& w) {
    if (!w.defined() || !w.has_storage() || is_placeholder(w)) return;
    const c10::Storage& storage = w.unsafeGetTensorImpl()->unsafe_storage();
    if (produced_storage_.find(storage.unsafeGetStorageImpl()) == nullptr) note_program_write(storage);
  });
}

uint64_t Region::locate(OpRecord& rec, int32_t index, torch::autograd::Node* node, bool has_python, bool walked,
                        bool* guarded) {
  // The Python stack gives forward ops their location and every op its loop context. Backward
  // ops on CPU run on the thread that called backward(), whose frames are still there; on an
  // engine device thread there are none, and the newest forward op's loops stand in.
  uint64_t site = 0;
  if (has_python) {
    site = locations_.capture(walked, &rec.loops, node == nullptr ? guarded : nullptr);
    last_loops_ = rec.loops;
  } else {
    rec.loops = last_loops_;
  }
  if (node == nullptr) {
    last_backward_node_ = nullptr;
    // The autograd node for this op (if any) was created just before autograd redispatched to
    // us, so it holds the previous sequence number. The first op to see a number is its creator.
    uint64_t next = at::sequence_number::peek();
    if (next > 0 && next - 1 != last_noted_sequence_nr_) {
      last_noted_sequence_nr_ = next - 1;
      auto [creator, inserted] = node_location_.try_emplace(next - 1);
      if (inserted) *creator = Creator{site, index};
    }
    return site;
  }
  // Backward ops: the location of the forward op that created the autograd node, plus the
  // op's index inside that node's backward, plus where backward() was called.
  rec.backward = true;
  if (node != last_backward_node_) {
    last_backward_node_ = node;
    backward_index_ = 0;
  }
  // The node's type, without Node::name(), which demangles a string on every call.
  const uint64_t node_type = typeid(*node).hash_code();
  uint64_t base;
  if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
    // One per leaf (parameter): anchored on the op input that first read the leaf in this
    // region, which names it in every iteration and, unlike its address, in another process
    // (warm start); the address where no such input is known.
    const c10::TensorImpl* leaf = acc->variable.unsafeGetTensorImpl();
    const int32_t* ext = external_index_.find(leaf);
    uint64_t reader = ext != nullptr ? trace_.externals[*ext].first_reader : 0;
    if (reader == 0) {
      // A leaf this region made (reentrant checkpointing detaches its inputs in backward and
      // accumulates into them): named by the op that made it, as its address is new each time.
      const std::optional<ValueRef> made = find_produced(acc->variable);
      if (made && made->record >= 0)
        reader = trace::hash_combine(trace::hash_combine(0x1eaf, trace_.ops[made->record].location), made->output);
    }
    base = trace::hash_combine(0xacc, reader != 0 ? reader : reinterpret_cast<uintptr_t>(leaf));
  } else {
    const Creator* forward = node_location_.find(node->sequence_nr());
    base = forward != nullptr ? forward->location : trace::hash_combine(0xb0, node_type);
    if (forward != nullptr) rec.origin = forward->record;
  }
  return locations_.derive(base, trace::hash_combine(node_type, site), backward_index_++,
                           [node] { return node->name(); });
}

namespace {

// The thread is inside Region::handle (see Region::handling_on_this_thread).
thread_local bool t_handling = false;

// While alive, the ops this thread issues are the region's own work or kernels it runs for real:
// the interceptor lets them through (intercepting_region), so mu_ is never taken twice by one
// thread.
struct HandlingOnThisThread : common::ScopedFlag {
  HandlingOnThisThread() : common::ScopedFlag(t_handling) {}
};

// The GIL for the location walk, released on every path (an exception thrown while it is held
// would leave the main thread holding it, and the autograd engine's gil_scoped_release waits
// for it forever).
class GilForLocations {
 public:
  GilForLocations() = default;
  ~GilForLocations() { release(); }
  void take() {
    if (held_) return;
    state_ = PyGILState_Ensure();
    held_ = true;
  }
  void release() {
    if (!held_) return;
    held_ = false;
    PyGILState_Release(state_);
  }
  GilForLocations(const GilForLocations&) = delete;
  GilForLocations& operator=(const GilForLocations&) = delete;

 private:
  bool held_ = false;
  PyGILState_STATE state_{};
};

}  // namespace

bool Region::handling_on_this_thread() { return t_handling; }

namespace {

// Forward-mode AD's zero tangents (`torch._efficientzerotensor`: a ZeroTensor, which ops treat as
// zeros without reading memory; torch.func.jvp, jacfwd and hessian make them). The graph cannot
// run ops on them: `add` on one recursed through Python's meta functions on the worker and
// failed the first co-executed iteration (session 31 hunt). The region stops capturing there
// (Region::unsupported), and the program runs eagerly with the reason.
bool makes_zero_tensor(const c10::OperatorHandle& op) {
  static const std::optional<c10::OperatorHandle> zeros =
      c10::Dispatcher::singleton().findSchema({"aten::_efficientzerotensor", ""});
  return zeros.has_value() && op == *zeros;
}

// Region::unsupported()'s reason: the kind of tensor co-execution does not capture (zero, nested,
// sparse, ...) and how `op` met it.
std::string not_captured(const char* kind, const c10::OperatorHandle& op, const char* how) {
  return std::string(kind) + " tensors are not captured (" + c10::toString(op.operator_name()) + " " + how + ")";
}

}  // namespace

void Region::handle(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const size_t nargs = op.schema().arguments().size();
  const HandlingOnThisThread handling;  // (our own work and the kernels we run never come back here)
  if (!unsupported_.empty()) {  // (nested tensors: see unsupported())
    run_real(op, ks, stack);
    return;
  }
  c10::ArrayRef<c10::IValue> args(stack->data() + stack->size() - nargs, nargs);
  const bool host = is_host_op(op, args);
  if (host && !is_collective(op)) {
    // Host bookkeeping that neither takes nor gives tensors: the profiler's record_function pair
    // that torch.optim puts around every step() and zero_grad(), and a DataLoader around every
    // batch. No graph computes it and no value of the program depends on it, so it runs where
    // Python calls it and leaves no record: recorded, it cost four ops' full work per training
    // step (location, record, check against the graph), and a block entered on some iterations
    // only was a new path to trace (test_convergence.py: 7 traced iterations instead of 3).
    run_real(op, ks, stack);
    return;
  }
  if (outside_program_on_this_thread()) {
    bool outside;
    {
      std::lock_guard<std::mutex> lock(mu_);
      outside = runs_outside(op, args);
    }
    if (outside) {
      // Not the program's: eager's kernel on eager's values, where Python issues it; its results
      // are ordinary tensors the program reads as inputs from outside.
      run_real(op, ks, stack);
      if (hook_ != nullptr) hook_->ran_outside();
      for (size_t r = stack->size() - op.schema().returns().size(); r < stack->size(); ++r) {
        const c10::IValue& v = (*stack)[r];
        if (v.isTensor() && v.toTensor().has_storage())
          note_made_outside(v.toTensor().unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
      }
      return;
    }
  }
  if (makes_zero_tensor(op)) {
    stop_capturing(not_captured("zero", op, "makes one: forward-mode AD's tangent of a value without one"), -1);
    run_real(op, ks, stack);
    return;
  }
  for (size_t i = stack->size() - nargs; i < stack->size(); ++i) {
    const c10::IValue& v = (*stack)[i];
    if (v.isStorage() && adopt_outside_memory(op, ks, stack)) return;
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    const char* kind = v.toTensor()._is_zerotensor() ? "zero" : v.toTensor().is_nested() ? "nested" : nullptr;
    if (kind != nullptr) {
      stop_capturing(not_captured(kind, op, "takes one"), -1);
      run_real(op, ks, stack);
      return;
    }
  }
  // Forward ops read the Python stack. On Python 3.11 that needs no GIL once the stack's code
  // objects are known (LocationTracker::walk_without_gil); otherwise the GIL is taken (torch's
  // bindings released it). Lock order is always GIL -> mu_, so a walk that needs the GIL lets
  // mu_ go first; backward ops on engine threads take no GIL at all. Taking the GIL back and the
  // frame objects PyFrame_GetBack makes for every call level took this function from 687k to
  // 769k instructions per co-executed Adam MLP step, of the Python thread's 1.9M (callgrind).
  auto node = torch::autograd::get_current_node();
  const bool has_python = PyGILState_GetThisThreadState() != nullptr;
  if (g_failure_armed.load(std::memory_order_relaxed)) check_injected_failure(op);
  GilForLocations gil;
  std::unique_lock<std::mutex> lock(mu_);
  const bool walked = has_python && locations_.walk_without_gil();
  if (has_python && !walked) {
    lock.unlock();
    gil.take();
    lock.lock();
  }
  ++handled_;
  // Built in place: a record is too large to move around cheaply.
  const int32_t index = static_cast<int32_t>(trace_.ops.size());
  OpRecord& rec = trace_.ops.emplace_back(op);
  bool guarded = false;
  try {
    rec.location = locate(rec, index, node.get(), has_python, walked, &guarded);
  } catch (...) {
    trace_.ops.pop_back();
    throw;
  }
  gil.release();
  rec.checked = guarded && checks_argument_values(op);
  fold_grad_mode(op, stack->data() + stack->size() - nargs);  // (capture/grad_mode_kernels.h)
  add_inputs_and_attributes(rec, args);
  note_program_writes(rec, args);

  // (A collective without tensors, the one host op recorded, always runs.)
  if (mode_ == Mode::Placeholder && !host) {
    run_placeholder(op, infer_outputs(op, args), rec, index, args, stack);
    return;
  }
  const bool report = mode_ == Mode::CoExec;
  if (report && co_execute(op, ks, rec, index, args, stack)) return;
  // A placeholder without memory would be read as a null data pointer. Live placeholders get
  // their values at a divergence and after a failure of the graph; only values the graph never
  // computed (it failed first) are missing.
  TORCH_CHECK(!has_unbacked_placeholder(args), "terra_torch: ", c10::toString(op.operator_name()),
              " reads a tensor of this iteration whose value was never computed: the graph stopped before it (an "
              "error raised earlier in this iteration); compute it again");
  // (args dies with the run: the stack then holds the results)
  const std::optional<LayoutWitness> witness = layout_witness(op, args);
  try {
    run_real(op, ks, stack);
  } catch (...) {
    drop_raised(op);
    throw;
  }
  record_outputs(op, rec, index, stack, report && mode_ == Mode::CoExec, witness ? &*witness : nullptr);
}

void Region::materialize(c10::ArrayRef<c10::IValue> args) {
  if (!has_unbacked_placeholder(args)) return;
  TORCH_CHECK(mode_ == Mode::CoExec && hook_ != nullptr,
              "terra_torch: an op reads the values of placeholder tensors on the host, which placeholder capture "
              "cannot give");
  hook_->materialize_inputs(args);
}

void Region::stop_capturing(std::string why, int32_t index) {
  // In co-execution the graph is stopped first and every placeholder gets its value: the ops
  // that follow run for real on them.
  if (mode_ == Mode::CoExec && hook_ != nullptr) hook_->refuse(index, why);
  mode_ = Mode::Record;
  unsupported_ = std::move(why);
}

void Region::stop_at_unsupported_layout(const c10::OperatorHandle& op, const char* layout) {
  const HandlingOnThisThread handling;
  std::lock_guard<std::mutex> lock(mu_);
  if (!unsupported_.empty()) return;
  stop_capturing(not_captured(layout, op, "makes or reads one"), -1);
}

void Region::note_data_replaced(const at::Tensor& self, const at::Tensor& from) {
  // (A wait that finds the graph failed gives placeholders their values: not intercepted, as
  // mu_ is held.)
  const HandlingOnThisThread handling;
  std::lock_guard<std::mutex> lock(mu_);
  if (!unsupported_.empty() || !self.defined() || !from.defined()) return;
  // `self` keeps its TensorImpl and takes `from`'s storage and metadata; the two share memory
  // from then on, and each may be written in place (an optimizer's update of `self`). So neither
  // is a value of this region any more: what the produced tables knew of them by address or by
  // `from`'s storage no longer holds, and their next reads are inputs from outside (new ones:
  // `self`'s sizes may have changed), fed with their memory, which the graph writes in place.
  produced_.erase(self.unsafeGetTensorImpl());
  produced_.erase(from.unsafeGetTensorImpl());
  if (from.has_storage()) produced_storage_.erase(from.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
  external_index_.erase(self.unsafeGetTensorImpl());
  external_index_.erase(from.unsafeGetTensorImpl());
  if (mode_ == Mode::CoExec && hook_ != nullptr) hook_->storage_replaced(self, from);
}

int32_t Region::append_record(const OpRecord& rec) {
  std::lock_guard<std::mutex> lock(mu_);
  trace_.ops.push_back(rec);
  return static_cast<int32_t>(trace_.ops.size() - 1);
}

ValueRef Region::value_of(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu_);
  return reference(t);
}

std::optional<ValueRef> Region::produced(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu_);
  return find_produced(t);
}

void Region::set_produced(const at::Tensor& t, int32_t record, int32_t output) {
  std::lock_guard<std::mutex> lock(mu_);
  produce(t, record, output);
}

void Region::record_outputs(const c10::OperatorHandle& op, OpRecord& rec, int32_t index, torch::jit::Stack* stack,
                            bool report, const LayoutWitness* witness) {
  for (size_t r = 0; r < op.schema().returns().size(); ++r) {
    const c10::IValue& v = (*stack)[stack->size() - op.schema().returns().size() + r];
    if (v.isTensor() && v.toTensor().is_nested()) {
      // (torch._nested_tensor_from_mask: nothing after it is recorded, see unsupported())
      stop_capturing(not_captured("nested", op, "gives one"), report ? index : -1);
      return;
    }
  }
  c10::SmallVector<at::Tensor, 4> flat;
  const bool collect = report || witness != nullptr;
  int32_t k = 0;
  for (size_t r = 0; r < op.schema().returns().size(); ++r) {
    const c10::IValue& v = (*stack)[stack->size() - op.schema().returns().size() + r];
    if (v.isTensor()) {
      rec.outputs.emplace_back(MetaOf{v.toTensor()});
      produce(v.toTensor(), index, k++);
      if (collect) flat.push_back(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        rec.outputs.emplace_back(MetaOf{t});
        produce(t, index, k++);
        if (collect) flat.push_back(t);
      }
    }
  }
  if (witness != nullptr) learn_layouts(*witness, flat);  // (capture/shape_inference.h)
  if (report) hook_->outputs(index, flat);
}

bool Region::adopt_outside_memory(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  // Unpickling a tensor builds it as `torch.empty((0,)).set_(storage, offset, size, stride)`
  // (torch/_utils.py, _rebuild_tensor): every batch a DataLoader's worker processes send, every
  // torch.load. The storage is memory Python holds, which no op of the program computed, so the
  // tensor is an input from outside from now on, exactly as if torch.tensor() had made it: the
  // set_ runs for real and is not recorded, and the tensor leaves the produced table (its
  // empty() stays in the trace, an op nothing reads). Recording it instead gave a trace the
  // graph cannot hold (a Storage constant), and such loops never co-executed.
  //
  // Only for a tensor without elements: no op can have read a value of it. In co-execution it
  // must also be a placeholder, whose value the graph keeps apart (a real tensor's old value
  // could still be read by an op the graph has not run yet): the general path handles the rest
  // (it runs the iteration on eagerly from there).
  const size_t nargs = op.schema().arguments().size();
  const c10::IValue& first = (*stack)[stack->size() - nargs];
  if (!first.isTensor()) return false;
  const at::Tensor self = first.toTensor();
  if (!self.defined() || self.numel() != 0) return false;
  const bool placeholder = is_placeholder(self);
  if (mode_ == Mode::CoExec && !placeholder) return false;
  run_real(op, ks, stack);
  if (placeholder) adopt_if_backed(self);  // an ordinary tensor of its memory now
  {
    std::lock_guard<std::mutex> lock(mu_);
    produced_.erase(self.unsafeGetTensorImpl());
    external_index_.erase(self.unsafeGetTensorImpl());  // (its sizes changed: a new external)
  }
  if (hook_ != nullptr) hook_->outside_memory(self);
  return true;
}

bool Region::co_execute(const c10::OperatorHandle& op, c10::DispatchKeySet ks, OpRecord& rec, int32_t index,
                        c10::ArrayRef<c10::IValue> args, torch::jit::Stack* stack) {
  const bool host = is_host_op(op, args);
  const InferredOutputs* inferred = nullptr;
  if (!host) inferred = &infer_outputs(op, args);
  const bool needs_data = inferred != nullptr && inferred->needs_materialization;
  const size_t nret = op.schema().returns().size();
  auto flatten = [&] {
    c10::SmallVector<at::Tensor, 4> flat;
    for (size_t r = 0; r < nret; ++r) {
      const c10::IValue& v = (*stack)[stack->size() - nret + r];
      if (v.isTensor()) flat.push_back(v.toTensor());
      else if (v.isTensorList())
        for (const at::Tensor& t : v.toTensorList().vec()) flat.push_back(t);
    }
    return flat;
  };
  const bool draws = op.hasTag(at::Tag::nondeterministic_seeded);
  if (needs_data && (is_collective(op) || writes_an_argument(op.schema()) || draws)) {
    const bool collective = is_collective(op);
    // Run for real here, it would run again in the graph (which holds the node) and its write
    // would happen twice, or its random numbers be drawn twice; a collective run here could
    // overtake the graph's earlier ones (a read waits only for its own inputs). The rest of the
    // iteration runs eagerly instead, after the graph has finished what Python validated.
    hook_->refuse(index, c10::toString(op.operator_name()) +
                             (collective ? " is a collective co-execution does not lower (capture/collectives.h)"
                              : draws    ? " draws random numbers"
                                         : " writes its arguments") +
                             " and has no shape without its data (" + inferred->reason + ")");
    mode_ = Mode::Record;
    return false;
  }
  if (host || needs_data) {
    // Runs first, validated after: an op that raises (a shape error the meta kernel reported
    // in its own words) raises eager's error and leaves no record and no step of the graph.
    const c10::SmallVector<c10::IValue, 6> inputs(args.begin(), args.end());  // the stack is reused
    torch::jit::Stack known;
    if (needs_data) {
      rec.needs_materialization = true;
      if (hook_->known_read_arguments(op, args, known)) {
        // Python knows every input's value: the op reads those, not the graph's (no wait).
        for (size_t i = 0; i < known.size(); ++i) (*stack)[stack->size() - known.size() + i] = known[i];
      } else {
        hook_->materialize_inputs(args);
      }
    }
    try {
      run_real(op, ks, stack);
    } catch (...) {
      drop_raised(op);
      throw;
    }
    const c10::SmallVector<at::Tensor, 4> flat = flatten();
    const bool diverged =
        hook_->validate(*this, rec, index, inputs, flat.size(), false, host) == CoExecHook::Verdict::kDiverged;
    if (diverged) mode_ = Mode::Record;
    record_outputs(op, rec, index, stack, !diverged);
    return true;
  }
  // Never an op that draws random numbers: running it ahead of the graph would draw twice.
  // Nor a collective: the other ranks would see it twice.
  if ((rec.checked || hook_->check_first(rec)) && !op.hasTag(at::Tag::nondeterministic_seeded) && !is_collective(op))
    check_first(op, ks, rec, index, args);  // returns only if the op would not raise
  if (restrides_a_real_tensor(*inferred, args)) {
    // Run for real here instead, after the graph has finished what Python validated.
    hook_->refuse(index, c10::toString(op.operator_name()) +
                             " changes the sizes or strides of a tensor that already has its value in place");
    mode_ = Mode::Record;
    return false;
  }
  if (hook_->admit(*this, rec, index, args, inferred->num_outputs, inferred->fewest_elements) ==
      CoExecHook::Verdict::kDiverged) {
    mode_ = Mode::Record;
    return false;
  }
  run_placeholder(op, *inferred, rec, index, args, stack);
  hook_->outputs(index, flatten());
  return true;
}

void Region::check_first(const c10::OperatorHandle& op, c10::DispatchKeySet ks, OpRecord& rec, int32_t index,
                         c10::ArrayRef<c10::IValue> args) {
  // An op that checks only its indices needs the values of those alone: its floating-point
  // tensors are stood in for by uninitialized ones of the same layout, so the check does not wait
  // for the graph to finish writing them (an embedding's weight, which the previous iteration's
  // optimizer step updates).
  const bool index_only = checks_only_index_values(op);
  auto shape_only = [&](const c10::IValue& a) {
    if (!index_only || !a.isTensor()) return false;
    const at::Tensor& t = a.toTensor();
    return t.defined() && (t.is_floating_point() || t.is_complex());
  };
  if (index_only) {
    c10::SmallVector<c10::IValue, 6> needed;
    for (const c10::IValue& a : args) needed.push_back(shape_only(a) ? c10::IValue() : a);
    hook_->materialize_inputs(needed);
  } else {
    hook_->materialize_inputs(args);  // everything Python validated has run; the graph waits at this op's gate
  }
  const c10::FunctionSchema& schema = op.schema();
  torch::jit::Stack probe;
  probe.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = i < schema.arguments().size() ? schema.arguments()[i].alias_info() : nullptr;
    if (shape_only(args[i])) {
      const at::Tensor& t = args[i].toTensor();
      SuspendGuard no_interception;
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      probe.emplace_back(at::empty_strided(t.sizes(), t.strides(), t.options()));
    } else if (alias != nullptr && alias->isWrite() && args[i].isTensor() && args[i].toTensor().defined()) {
      SuspendGuard no_interception;
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // not an op of the user's program
      probe.emplace_back(args[i].toTensor().clone());  // the graph writes the real one
    } else {
      probe.push_back(args[i]);
    }
  }
  std::exception_ptr raised;
  try {
    run_real(op, ks, &probe);
    return;
  } catch (...) {
    raised = std::current_exception();
  }
  // Eager raised here: so does the program, at this op, with eager's exception. The op did not
  // happen; the runtime decides whether the graph can go on without it.
  const bool diverged = hook_->check_raised(*this, rec, index) == CoExecHook::Verdict::kDiverged;
  drop_raised(op);
  if (diverged) mode_ = Mode::Record;
  std::rethrow_exception(raised);
}

void Region::drop_raised(const c10::OperatorHandle& op) {
  raised_.push_back(check_key(trace_.ops.back().location, op));  // learned: checked from now on
  trace_.ops.pop_back();  // the op raised in the user's program: it did not happen
}

void Region::run_placeholder(const c10::OperatorHandle& op, const InferredOutputs& inferred, OpRecord& rec,
                             int32_t index, c10::ArrayRef<c10::IValue> args, torch::jit::Stack* stack) {
  const size_t nargs = args.size();
  if (inferred.needs_materialization) {
    rec.needs_materialization = true;  // kept in the trace: it is where the program needs data
    TORCH_CHECK(false, "terra_torch: cannot continue with placeholders: ", inferred.reason);
  }
  // Build the outputs while the arguments are still on the stack (outputs may be arguments).
  int32_t k = 0;
  auto make = [&](const OutputSpec& spec) {
    at::Tensor out;
    switch (spec.kind) {
      case OutputSpec::Kind::Fresh:
        if (spec.meta.dtype != c10::ScalarType::Undefined) out = make_placeholder(spec.meta, op);
        break;
      case OutputSpec::Kind::SameAsArgument:
        out = args[spec.argument].toTensor();
        if (spec.restrides) {
          // As the kernel would: this tensor (not its views) gets the new metadata; the graph
          // applies the op to its own value, so the two agree when this one is bound.
          TORCH_CHECK(is_placeholder(out), "terra_torch: ", c10::toString(op.operator_name()),
                      " would change the sizes or strides of a tensor that has its value; placeholder "
                      "capture cannot run it");
          restride_placeholder(out, spec.meta);
        }
        break;
      case OutputSpec::Kind::ViewOfArgument:
        out = make_placeholder_view(args[spec.argument].toTensor(), spec.meta, op);
        break;
    }
    if (out.defined() && spec.kind != OutputSpec::Kind::SameAsArgument) {
      if (spec.conj) out._set_conj(true);
      if (spec.neg) out._set_neg(true);
    }
    rec.outputs.emplace_back(MetaOf{out});
    produce(out, index, k++);
    return out;
  };
  c10::SmallVector<c10::IValue, 4> results;
  for (const ReturnSpec& ret : inferred.returns) {
    if (!ret.is_list) {
      results.emplace_back(make(ret.tensors[0]));
    } else {
      c10::List<at::Tensor> list;
      for (const OutputSpec& spec : ret.tensors) list.push_back(make(spec));
      results.emplace_back(std::move(list));
    }
  }
  torch::jit::drop(*stack, nargs);
  for (c10::IValue& v : results) stack->push_back(std::move(v));
}

}  // namespace terra::capture
