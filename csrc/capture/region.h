// A capture region: the span of a program (one iteration, or one debug.record call) whose aten
// ops are intercepted. It owns the trace being built and the bookkeeping that turns tensors into
// value references. One region is open at a time in a process; the autograd engine's threads
// reach it through the global pointer because our own thread_locals do not follow them.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <mutex>
#include <string>
#include <optional>

#include "capture/program_location.h"
#include "common/flat_map.h"
#include "capture/terra_key.h"
#include "capture/trace_record.h"

namespace torch::autograd {
struct Node;
}

namespace terra::capture {

enum class Mode {
  Record,       // run the real kernel, record the op
  Placeholder,  // run nothing, return placeholders
  CoExec,       // ask the co-execution hook per op: placeholders while the program follows the
                // graph, real ops (recorded) from a divergence on
};

class CoExecHook;
struct InferredOutputs;
struct LayoutWitness;

class Region {
 public:
  Region(Mode mode, PyFrameObject* stop_frame);
  // Mode::CoExec: `hook` (which must outlive the region) validates every op.
  Region(CoExecHook* hook, PyFrameObject* stop_frame);
  ~Region();

  // Opens the region on the calling thread (needs the GIL); close() must run on the same thread.
  void open();
  void close();
  // Makes a closed region the next iteration's, as if it had been made anew with `stop_frame`
  // (needs the GIL): its trace and tables are emptied but keep their memory, and its interned
  // locations stay (LocationTracker::restart). Building and freeing a region's tables and
  // interned locations every iteration cost a co-executed Adam MLP step ~5% of its Python
  // thread (perf: allocation, rehashing, destruction).
  void reuse(PyFrameObject* stop_frame);
  bool is_open() const { return open_; }
  // Why the program cannot be captured at all (empty if it can): an op took or gave a nested
  // tensor (nn.TransformerEncoder's fast path in eval), which has no sizes or strides to record.
  // From then on the region runs every op for real and records nothing; the Python side runs
  // the program eagerly.
  const std::string& unsupported() const { return unsupported_; }
  // An op on a `layout` ("sparse", "quantized") tensor, which reaches the fallback of its own
  // PrivateUse3 key (interceptor.cpp), never handle(): from here on the region records nothing
  // and runs every op for real, as after a nested tensor (unsupported()); in co-execution the
  // graph stops first and the placeholders get their values.
  void stop_at_unsupported_layout(const c10::OperatorHandle& op, const char* layout);

  Mode mode() const { return mode_; }
  const Trace& trace() const { return trace_; }
  // The external inputs themselves, in Trace::externals order (kept alive by the region).
  const std::vector<at::Tensor>& external_tensors() const { return externals_alive_; }
  LocationTracker& locations() { return locations_; }

  // Ops that raised in the user's program, as capture::check_key(location, op), in order.
  const std::vector<uint64_t>& raised() const { return raised_; }

  // The interceptor's entry: every aten op of the region arrives here.
  void handle(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);
  // Gives the placeholders among `args` their values, for a composite kernel that reads them on
  // the host (capture/host_filled_tensors.h); raises where no values exist (placeholder mode).
  void materialize(c10::ArrayRef<c10::IValue> args);
  // torch's set_data (`self.data = from`) is about to give `self` the storage and metadata of
  // `from`, which no op records. Both have their values (materialize() first, which raises where
  // none exist). Both become inputs from outside, after the graph has run everything posted
  // (region.cpp).
  void note_data_replaced(const at::Tensor& self, const at::Tensor& from);

  // True on a thread that is inside handle(): an op arriving then was issued by a kernel the
  // region runs for real (an SDPA backward calls aten::transpose through the dispatcher, and
  // placeholders bound to values still carry our key), or by the region's own work. It is not
  // an op of the user's program: the interceptor runs it untouched (interceptor.cpp).
  static bool handling_on_this_thread();
  // How many ops handle() has seen (records appended by a replay are not counted).
  int64_t handled() const { return handled_; }

  // ---- replay (runtime/backward_replay.cpp) ----
  // Appends a copy of a record that an earlier iteration captured (its inputs refer to records
  // and externals of this region by index); returns its index. Takes mu_.
  int32_t append_record(const OpRecord& rec);
  // The value reference of `t` in this region, adding it as an external input if it is none
  // of the region's values (what an op reading it would record).
  ValueRef value_of(const at::Tensor& t);
  // The value reference of `t` if the region produced it; nothing is added.
  std::optional<ValueRef> produced(const at::Tensor& t);
  // Output `output` of record `record` is `t` from now on (an in-place op's output, or a
  // placeholder made for a replayed record).
  void set_produced(const at::Tensor& t, int32_t record, int32_t output);

  // ---- ops outside the program (capture/outside_program.h) ----
  // Whether Python may read `t`'s memory itself (numpy(), tolist()) without waiting for the
  // graph: a real tensor no op of this iteration produced and no op of the program has written.
  bool outside_tensor(const at::Tensor& t);

 private:
  struct Produced {
    // Pins the address, not the tensor. Optional only so that table slots can start empty.
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> impl;
    ValueRef ref;
  };

  // The op input that reads a tensor: (location, argument, list index), hashed into
  // ExternalInput::first_reader only where the tensor is a new external.
  struct Reader {
    uint64_t location = 0;
    int64_t argument = -1;
    int64_t list_index = -1;
    uint64_t hash() const;
  };
  // value_of() without the lock; `reader` names the op input reading it, if known.
  ValueRef reference(const at::Tensor& t, const Reader* reader = nullptr);
  std::optional<ValueRef> find_produced(const at::Tensor& t) const;  // produced() without the lock
  void add_inputs_and_attributes(OpRecord& rec, c10::ArrayRef<c10::IValue> args);
  // Inside an OutsideProgram block: whether `op` runs for real, unrecorded (outside_program.h).
  bool runs_outside(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) const;
  bool outside_input(const at::Tensor& t) const;  // outside_tensor() without the lock
  // Notes the storages of the real tensors that `rec` (just recorded, on `args`) writes and this
  // iteration did not produce (note_program_write, capture/outside_program.h).
  void note_program_writes(const OpRecord& rec, c10::ArrayRef<c10::IValue> args);
  // `walked`: the stack was walked without the GIL for this op (LocationTracker::walk_without_gil).
  uint64_t locate(OpRecord& rec, int32_t index, torch::autograd::Node* node, bool has_python, bool walked,
                  bool* guarded);
  // Co-execution of a checked op: its inputs get their values and it runs once for real on
  // them (written arguments cloned) before the graph may run it. Rethrows what it raised.
  void check_first(const c10::OperatorHandle& op, c10::DispatchKeySet ks, OpRecord& rec, int32_t index,
                   c10::ArrayRef<c10::IValue> args);
  // The newest record's op raised: it is dropped from the trace and noted in raised().
  void drop_raised(const c10::OperatorHandle& op);
  void produce(const at::Tensor& t, int32_t record, int32_t output);
  void run_placeholder(const c10::OperatorHandle& op, const InferredOutputs& inferred, OpRecord& rec,
                       int32_t index, c10::ArrayRef<c10::IValue> args, torch::jit::Stack* stack);
  // An op with a Storage argument (set_ in unpickling) that gives a tensor without elements
  // memory from outside the program: true when it ran, unrecorded, and the tensor became an
  // input from outside (see region.cpp); false: the general path handles it.
  bool adopt_outside_memory(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);
  // Sets unsupported() (`why`; `index`: the op's record, or -1), diverging first in co-execution.
  void stop_capturing(std::string why, int32_t index);
  // Mode::CoExec: true when the op was handled (placeholders returned); false: run it for real.
  bool co_execute(const c10::OperatorHandle& op, c10::DispatchKeySet ks, OpRecord& rec, int32_t index,
                  c10::ArrayRef<c10::IValue> args, torch::jit::Stack* stack);
  // `witness`: the op ran for real with the key taken before; its outputs' layouts are learned
  // (capture/shape_inference.h, learn_layouts).
  void record_outputs(const c10::OperatorHandle& op, OpRecord& rec, int32_t index, torch::jit::Stack* stack,
                      bool report, const LayoutWitness* witness = nullptr);

  Mode mode_;
  CoExecHook* hook_ = nullptr;
  bool open_ = false;
  std::mutex mu_;  // the autograd engine may call in from its device threads
  std::optional<InterceptGuard> intercept_;  // our key in this thread's TLS include set
  LocationTracker locations_;
  Trace trace_;
  common::FlatMap<const c10::TensorImpl*, Produced> produced_;
  // The same value can come back as another TensorImpl over the same storage: autograd unpacks
  // the outputs it saved for backward into fresh tensors, after the original tensor object may
  // have died. Matched by storage (pinned, so its address stays unique) and metadata; the
  // metadata of each alias is its record's output TensorMeta, so nothing is copied here.
  struct StorageEntry {
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
    c10::SmallVector<ValueRef, 2> aliases;
  };
  common::FlatMap<const c10::StorageImpl*, StorageEntry> produced_storage_;
  common::FlatMap<const c10::TensorImpl*, int32_t> external_index_;
  std::vector<at::Tensor> externals_alive_;  // externals stay alive so their identity stays unique
  struct Creator {  // the forward op that created an autograd node
    uint64_t location = 0;
    int32_t record = -1;
  };
  common::FlatMap<uint64_t, Creator> node_location_;  // autograd sequence_nr -> its creator
  uint64_t last_noted_sequence_nr_ = UINT64_MAX;  // ops that create no node see the same number again
  const void* last_backward_node_ = nullptr;
  uint64_t backward_index_ = 0;
  c10::SmallVector<LoopFrame, 2> last_loops_;
  std::vector<uint64_t> raised_;
  int64_t handled_ = 0;
  std::string unsupported_;
};

// The region ops are routed to, or nullptr.
Region* active_region();

// In a process forked while a region was open (a DataLoader's worker processes, forked by
// iter(loader) inside the training loop): the copy of the region and our key in the forking
// thread's TLS include set are left behind, but none of the threads behind them. From then on
// this process intercepts nothing (its ops run as eager ones; terra_torch/runtime.py keeps its
// programs eager too).
void forget_regions_after_fork();
// True in such a child: its copies of the runtime's threads do not exist, so nothing joins them.
bool forked_child();

// Fault injection for error paths (terra_torch.debug.fail_at): the next op named `op` (for
// example "aten::mm") that reaches Region::handle throws instead of running, as an internal
// error of the interceptor would; an empty name disarms it. Checked with one relaxed load.
void inject_failure(const std::string& op);

}  // namespace terra::capture
