// Backward without the autograd engine on the Python side (docs/RUNTIME.md, "backward() in
// co-execution").
//
// In a co-executed iteration the engine would run every backward op through the interceptor only
// for the PythonRunner to validate it and hand out a placeholder nobody looks at: the graph
// computes the gradients anyway. Where the traced backward ran no Python, what the engine does is
// a deterministic function of the validated forward (the path the cursor took, the same records
// and externals) and of the leaves' gradient state (which `.grad` are None): the same backward
// ops, the same posts, and at the end each leaf's `.grad` either a new tensor or the old one
// accumulated in place. So the first such backward() runs op by op and is *recorded* as a
// BackwardMemo; every later call with the same key is *replayed*: the memo's records join the
// region's trace, its posts go to the graph in one go, every leaf gets the `.grad` eager would
// give it (a new placeholder, or the same tensor object, version bumped), and the engine never
// runs. Example, an MLP step under `terra_torch.wrap`:
//
//     iteration 3 (first co-executed): loss.backward() -> engine, 99 ops validated, memo recorded
//     iteration 4..: loss.backward() -> replay: 99 records appended, 150 posts, 6 leaf grads set,
//                    0 ops intercepted
//
// The conditions (AutogradReach): no hook anywhere on the reachable graph (tensor, grad_fn,
// retain_grad, post-accumulate-grad), no Python autograd.Function, no anomaly mode, and the
// recorded run created no autograd node (checkpoint recomputation does) and needed no data. Where
// one fails the call takes the per-op path, and the reason is kept for explain().
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <string>
#include <vector>

#include "capture/trace_record.h"
#include "trace/node.h"
#include "trace/op_record.h"

namespace torch::autograd {
struct Node;
}

namespace terra::capture {
class Region;
}

namespace terra::runtime {

// One call of the autograd engine, as torch.autograd.backward makes it.
struct BackwardCall {
  std::vector<at::Tensor> roots;  // the tensors backward() differentiates
  std::vector<at::Tensor> grads;  // their incoming gradients (undefined: none)
  bool keep_graph = false;        // retain_graph
  bool create_graph = false;
  bool has_inputs = false;        // backward(inputs=...)
  bool accumulate_grad = true;    // false for torch.autograd.grad
};

// What the engine would reach from a call's roots: every autograd node, and the leaves (the
// variables of the AccumulateGrad nodes) in the order a depth-first walk meets them. `python`
// names the first thing that would run Python code during the backward (empty: nothing does); the
// walk stops there unless `whole_graph` (the data-parallel lowering asks which leaves a backward
// reaches, hooks or not: terra_torch/_data_parallel.py).
struct AutogradReach {
  std::vector<torch::autograd::Node*> nodes;  // valid while the roots are alive
  std::vector<at::Tensor> leaves;
  std::string python;
};
AutogradReach reach(const BackwardCall& call, bool whole_graph = false);
// The same into `out`, whose lists keep their memory from call to call: a fresh list of a few
// hundred nodes per backward() was a large allocation, which makes glibc consolidate every small
// block freed since (placeholders): 1% of the Python thread on the quick suite's gpt (perf).
void reach_into(const BackwardCall& call, AutogradReach& out, bool whole_graph = false);

// DDP's reducer hooks every parameter's AccumulateGrad node (C++ post hooks). While no DDP
// forward has prepared the reducer, each hook returns at once, or only updates the reducer's own
// bookkeeping: terra_torch.wrap(DDP(model)) keeps it so (its forward runs the module directly and
// reduces gradients itself, terra_torch/_data_parallel.py). `idle`: the leaves' C++ lambda hooks
// are wrapped so that they run with interception suspended and do not stop a replay (any other
// hook still does); false: unwrapped again, before the reducer works again or is destroyed (it
// deletes its hooks by address).
void tolerate_idle_reducer_hooks(const std::vector<at::Tensor>& leaves, bool idle);

// Ends the graph's life as the engine would after a backward without retain_graph: the saved
// tensors of every reached node are released (a second backward through it raises eager's
// "Trying to backward through the graph a second time").
void release_saved(const AutogradReach& reach);

// What one post of a recorded backward op was, with its tensor named by where it came from.
struct ReplayPost {
  enum class Kind : uint8_t {
    kDecision,  // channel key and value, as posted (case selects, gates)
    kFeed,      // feed slot `key` gets the region's external `external`
    kFeedNone,  // optional feed slot `key` gets "none" (the input was computed in the iteration)
  };
  Kind kind = Kind::kDecision;
  int64_t key = 0;
  int64_t value = 0;
  int32_t external = -1;
  // A fed float a call replay takes from its caller (runtime/call_replay.h, CallMemo::numbers):
  // the caller's number `parameter`, not `value`.
  int32_t parameter = -1;
};

// One backward op as the PythonRunner validated it: the cursor step and the posts after it.
struct ReplayStep {
  trace::OpKey key;
  std::vector<trace::LoopFrame> loops;
  trace::NodeId node = trace::kNoNode;
  std::vector<ReplayPost> posts;
  uint32_t publishes = 0;  // values of the output sequence the node publishes
};

// An external input first read in the backward, named so that a replay finds this iteration's
// tensor: the leaf itself, the gradient it had when backward() was called, or a Python number a
// forward op read (autograd saved the arg parser's 0-dim tensor; the region keeps copies of those,
// so the backward's read is a new external holding the same number as forward external
// `forward_external`).
struct BackwardExternal {
  int32_t leaf = -1;
  bool grad = false;
  int32_t forward_external = -1;
};

// What backward() did to one leaf's `.grad`.
struct LeafOutcome {
  enum class Kind : uint8_t {
    kUnchanged,  // no gradient reached it (or it stayed None)
    kNew,        // `.grad` is output (record, output) of the backward, a new tensor
    kInPlace,    // the existing `.grad` was written in place: output (record, output) is it
  };
  Kind kind = Kind::kUnchanged;
  int32_t record = -1;  // index into BackwardMemo::records
  int32_t output = -1;
  int64_t version_bumps = 0;
};

// A recorded backward() and the key under which it replays.
struct BackwardMemo {
  // ---- the key ----
  uint64_t path = 0;          // hash of the nodes the cursor matched and their sizes so far
  size_t records_before = 0;  // region records and externals when backward() was called
  size_t externals_before = 0;
  std::vector<capture::ValueRef> roots, grads;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> leaves;
  std::vector<uint8_t> leaf_has_grad;
  bool keep_graph = false;
  // ---- what it did ----
  std::vector<capture::OpRecord> records;
  std::vector<ReplayStep> steps;  // one per record
  std::vector<BackwardExternal> new_externals;  // externals_before + i
  std::vector<LeafOutcome> outcomes;            // per leaf
  // Externals that the region resolves to an output of the backward afterwards, by storage:
  // addmm's backward transposes the transposed weight back, a view of the parameter with its
  // own layout, so the optimizer's write to the parameter reads that output (region.h,
  // StorageEntry). The replay makes the same resolution hold.
  struct Alias {
    int32_t external;
    int32_t record;  // index into records
    int32_t output;
  };
  std::vector<Alias> external_aliases;
  // Forward records whose backward ops read fed numbers, with their arguments then: the memo
  // replays those numbers only while the arguments are the same (part of the key).
  std::vector<std::pair<int32_t, std::vector<c10::IValue>>> origin_attributes;
  // The path once the recorded ops had run one by one (their nodes and sizes hashed): a replay
  // leaves it so, and a later memo's key (the optimizer's step after this backward) is the same
  // whether this backward was recorded or replayed.
  uint64_t path_after = 0;
};

// Externals the region resolves to an output of records from `begin` on, by storage, after a
// recorded call (BackwardMemo::Alias; its record is counted from `begin`).
std::vector<BackwardMemo::Alias> aliases_after(capture::Region& region, size_t begin);

// A backward() the engine is running op by op, being recorded (PythonRunner::validate adds a step
// per op). `ineligible`: the first reason it cannot become a memo.
struct BackwardRecording {
  BackwardMemo memo;  // its key is filled in when the call starts
  AutogradReach reach;
  std::vector<at::Tensor> grads_before;  // per leaf
  std::vector<int64_t> versions_before;
  uint64_t sequence_before = 0;  // autograd's sequence number: a recomputation would move it
  std::vector<int32_t> scalar_origins;  // forward records of backward ops with fed numbers
  std::string ineligible;
};

// Memos kept per generated graph: a program has one backward per path through its forward (and
// per gradient state: None after zero_grad(set_to_none=True), or accumulated). A backward inside a
// graph loop has one per path up to it, the trips before included (quick-suite trip_count: 13).
// The lookup compares each memo's path hash before anything else.
inline constexpr size_t kMaxBackwardMemos = 64;

}  // namespace terra::runtime
