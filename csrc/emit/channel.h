// The channel between the Python side and a running graph (docs/RUNTIME.md, "The protocol"): the
// terra:: operators in generated graphs (case_select, loop_cond, feed, feed_or_none, fetch) do
// nothing themselves but ask the ChannelSource that is current on the executing thread. The
// co-execution runtime installs a concurrent source; tests install a scripted one.
#pragma once

#include <ATen/core/Tensor.h>

namespace terra::emit {

class ChannelSource {
 public:
  virtual ~ChannelSource() = default;
  // Which case the switch at `site` takes (0-based, in the Program's case order).
  virtual int64_t case_select(int64_t site) = 0;
  // After an iteration of the loop at `site`: run another one?
  virtual bool loop_cond(int64_t site) = 0;
  // The external tensor for feed `slot`. An undefined tensor means "not external this time":
  // only feed_or_none slots may receive one (the graph then uses its own value).
  virtual at::Tensor feed(int64_t slot) = 0;
  // Python reads `value` at fetch `slot`.
  virtual void fetch(int64_t slot, const at::Tensor& value) = 0;
  // Co-execution graphs only (EmitOptions::coexec). The op after this one writes to a tensor
  // Python can observe, or draws random numbers: wait until Python has validated it.
  virtual void gate(int64_t /*node*/) {}
  // The next value of the program's output sequence (one per op output, in program order):
  // the Python side's placeholder for it reads it from here. Undefined for ops without outputs.
  virtual void publish(int64_t /*tag*/, const at::Tensor& /*value*/) {}
  // Co-execution graphs: the Python float an op receives at scalar slot `slot` this time.
  virtual double feed_scalar(int64_t slot);
  // Co-execution graphs: the next value of an int, bool or int-list scalar slot (a list is its
  // length, then its elements, on the same slot). Slots are numbered with the float ones.
  virtual int64_t feed_int(int64_t slot);
};

// The source the terra:: ops of this thread talk to, or nullptr. Thread-local because a graph
// runs on the thread that calls the executor; a worker thread must install its own.
ChannelSource* current_channel();

// Installs a source for the current thread for the lifetime of the scope.
class ChannelScope {
 public:
  explicit ChannelScope(ChannelSource* source);
  ~ChannelScope();
  ChannelScope(const ChannelScope&) = delete;
  ChannelScope& operator=(const ChannelScope&) = delete;

 private:
  ChannelSource* saved_;
};

// Operator names, as they appear in graphs.
inline constexpr const char* kCaseSelectOp = "terra::case_select";
// Case-select sites from here on pick among the producers of a selected read (value_flow.h);
// the ones below are the Program's switches. (The runtime's gate and scalar keys lie above.)
inline constexpr int64_t kSelectSiteBase = int64_t(1) << 39;
inline constexpr const char* kLoopCondOp = "terra::loop_cond";
inline constexpr const char* kFeedOp = "terra::feed";
inline constexpr const char* kFeedOrNoneOp = "terra::feed_or_none";
inline constexpr const char* kFetchOp = "terra::fetch";
inline constexpr const char* kGateOp = "terra::gate";
inline constexpr const char* kPublishOp = "terra::publish";
inline constexpr const char* kFeedScalarOp = "terra::feed_scalar";
inline constexpr const char* kFeedIntOp = "terra::feed_int";
inline constexpr const char* kFeedBoolOp = "terra::feed_bool";
inline constexpr const char* kFeedIntListOp = "terra::feed_int_list";
inline constexpr const char* kFeedFloatListOp = "terra::feed_float_list";
inline constexpr const char* kFeedNumberListOp = "terra::feed_number_list";  // the same as Scalar[]
// Every op that takes a value Python posts (in co-execution each waits for Python to reach it).
inline constexpr const char* kFeedOps[] = {kFeedOp,      kFeedOrNoneOp,  kFeedScalarOp,    kFeedIntOp,
                                           kFeedBoolOp,  kFeedIntListOp, kFeedFloatListOp, kFeedNumberListOp};
// Not a dispatcher op: a JIT operator that calls the operator it names boxed (channel_ops.cpp).
inline constexpr const char* kBoxedCallOp = "terra::boxed_call";

}  // namespace terra::emit
