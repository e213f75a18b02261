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
#include <optional>
#include <unordered_map>

#include "capture/program_location.h"
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

class Region {
 public:
  Region(Mode mode, PyFrameObject* stop_frame);
  // Mode::CoExec: `hook` (which must outlive the region) validates every op.
  Region(CoExecHook* hook, PyFrameObject* stop_frame);
  ~Region();

  // Opens the region on the calling thread (needs the GIL); close() must run on the same thread.
  void open();
  void close();
  bool is_open() const { return open_; }

  Mode mode() const { return mode_; }
  const Trace& trace() const { return trace_; }
  // The external inputs themselves, in Trace::externals order (kept alive by the region).
  const std::vector<at::Tensor>& external_tensors() const { return externals_alive_; }
  LocationTracker& locations() { return locations_; }

  // The interceptor's entry: every aten op of the region arrives here.
  void handle(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

 private:
  struct Produced {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl;  // pins the address, not the tensor
    ValueRef ref;
  };

  ValueRef reference(const at::Tensor& t);
  void add_inputs_and_attributes(OpRecord& rec, c10::ArrayRef<c10::IValue> args);
  uint64_t locate(OpRecord& rec, int32_t index, torch::autograd::Node* node, bool has_python);
  void produce(const at::Tensor& t, int32_t record, int32_t output);
  void run_placeholder(const c10::OperatorHandle& op, const InferredOutputs& inferred, OpRecord& rec,
                       int32_t index, c10::ArrayRef<c10::IValue> args, torch::jit::Stack* stack);
  // Mode::CoExec: true when the op was handled (placeholders returned); false: run it for real.
  bool co_execute(const c10::OperatorHandle& op, c10::DispatchKeySet ks, OpRecord& rec, int32_t index,
                  c10::ArrayRef<c10::IValue> args, torch::jit::Stack* stack);
  void record_outputs(const c10::OperatorHandle& op, OpRecord& rec, int32_t index, torch::jit::Stack* stack,
                      bool report);

  Mode mode_;
  CoExecHook* hook_ = nullptr;
  bool open_ = false;
  std::mutex mu_;  // the autograd engine may call in from its device threads
  std::optional<InterceptGuard> intercept_;  // our key in this thread's TLS include set
  LocationTracker locations_;
  Trace trace_;
  std::unordered_map<const c10::TensorImpl*, Produced> produced_;
  // The same value can come back as another TensorImpl over the same storage: autograd unpacks
  // the outputs it saved for backward into fresh tensors, after the original tensor object may
  // have died. Matched by storage (pinned, so its address stays unique) and metadata.
  struct StorageAlias {
    int64_t storage_offset;
    c10::SmallVector<int64_t, 6> sizes, strides;
    caffe2::TypeMeta dtype;
    ValueRef ref;
  };
  struct StorageEntry {
    explicit StorageEntry(c10::weak_intrusive_ptr<c10::StorageImpl> s) : storage(std::move(s)) {}
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    c10::SmallVector<StorageAlias, 2> aliases;
  };
  std::unordered_map<const c10::StorageImpl*, StorageEntry> produced_storage_;
  std::unordered_map<const c10::TensorImpl*, int32_t> external_index_;
  std::vector<at::Tensor> externals_alive_;  // externals stay alive so their identity stays unique
  struct Creator {  // the forward op that created an autograd node
    uint64_t location;
    int32_t record;
  };
  std::unordered_map<uint64_t, Creator> node_location_;  // autograd sequence_nr -> its creator
  const void* last_backward_node_ = nullptr;
  uint64_t backward_index_ = 0;
  c10::SmallVector<LoopFrame, 2> last_loops_;
};

// The region ops are routed to, or nullptr.
Region* active_region();

}  // namespace terra::capture
