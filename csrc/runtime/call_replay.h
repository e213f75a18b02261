// An optimizer's step() in co-execution without its Python (docs/RUNTIME.md, "optimizer.step() in
// co-execution").
//
// torch.optim.SGD.step issues, per parameter with a gradient, the same few in-place ops each
// iteration: `param.add_(grad, alpha=-lr)`, with momentum `buf.mul_(momentum).add_(grad, ...)`
// first. Which ops, on which tensors and with which numbers follows from the parameters, their
// gradients and momentum buffers, and the hyperparameters. In co-execution each of them went
// through Python, the dispatcher and the per-op check only to hand the graph work it already
// holds. So, as for backward() (runtime/backward_replay.h), the first step() with a given key
// runs op by op and is *recorded* as a CallMemo; every later call with the same key is
// *replayed*: the records join the region's trace, the posts go to the graph in one go, the
// tensors written get their version bumps, and no op reaches Python. Example, an MLP step:
//
//     iteration 3 (first co-executed): opt.step() -> 6 ops validated, memo recorded
//     iteration 4..: opt.step() -> replay: 6 records appended, their posts sent, 6 version bumps
//
// Numbers a call's ops receive that may change every call (Adam's step size follows from the step
// count, a scheduler sets a new learning rate) are the caller's to compute and pass; the memo
// names which fed floats they are, and keys the others (the graph has them as constants) by value.
//
// A call may return a tensor one of its ops made (torch.nn.utils.clip_grad_norm_ returns the total
// norm): a replay returns a new placeholder of it, as the op would have.
//
// The key: the cursor's path and the region's record and external counts (the iteration so far
// is the recorded one), each tensor argument (a value of this iteration by its reference, any
// other tensor by identity, None as None), and a number the caller vouches for: the same number
// only where the Python code would issue the same ops with the same Python numbers
// (terra_torch/_optimizer/: the hyperparameters, compared by value). A recorded call is kept
// only if its ops all ran on the graph, created no autograd node, read no data, and read no
// tensor from outside the iteration that is not one of its arguments.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "capture/trace_record.h"
#include "runtime/backward_replay.h"

namespace terra::runtime {

// One tensor argument of a call, as the key compares it.
struct CallArgument {
  enum class Kind : uint8_t {
    kNone,      // None (a parameter without a gradient, a momentum buffer not made yet)
    kProduced,  // a value this iteration computed: compared by its reference
    kTensor,    // any other tensor: compared by identity
  };
  Kind kind = Kind::kNone;
  capture::ValueRef ref;
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> impl;  // kTensor
};

// An external the recorded ops read: one of the call's arguments, or a constant the call made: a
// Python number the arg parser wrapped for one op (`buf.mul_(momentum)`), or a 0-dim CPU tensor
// made from Python data and never written (`torch.tensor(1.0)` in foreach Adam), made again with
// the same value (or the caller's number) in a replay.
struct CallExternal {
  int32_t external = -1;
  int32_t argument = -1;
  at::Tensor number;       // the constant's value and kind (argument < 0)
  int32_t parameter = -1;  // or the caller's number `parameter` (CallMemo::numbers)
};

// A recorded call and the key under which it replays.
struct CallMemo {
  // ---- the key ----
  uint64_t path = 0;
  size_t records_before = 0;
  size_t externals_before = 0;
  int64_t caller_key = 0;
  std::vector<CallArgument> arguments;
  // ---- what it did ----
  std::vector<capture::OpRecord> records;
  std::vector<ReplayStep> steps;  // one per record
  // Every external the records read. Those at or past externals_before were first read in the
  // call and become externals again, in the same order, in a replay.
  std::vector<CallExternal> externals_read;
  // Outputs that are an argument (an in-place op's result): (record, output, argument).
  struct ArgumentOutput {
    int32_t record;
    uint32_t output;
    int32_t argument;
  };
  std::vector<ArgumentOutput> argument_outputs;
  std::vector<int64_t> version_bumps;  // per argument (autograd's in-place kernels bump them)
  // The arguments the ops write (their known values go; a foreach op's write bumps no version in
  // co-execution, where its kernel, which bumps them, does not run).
  std::vector<int32_t> written;
  std::vector<BackwardMemo::Alias> external_aliases;
  // Numbers the caller computes per call (Adam's bias corrections follow from the step count, a
  // learning rate from the scheduler): how many it passes. A memo with numbers is trusted
  // (`confirmed`) once a second recording with the same key made the same ops and posts: each fed
  // float that differs between the two is the caller's number that differs the same way
  // (ReplayPost::parameter, CallExternal::parameter), the other fed floats are constants, and the
  // numbers that did not differ are `pinned`, part of the key by value (a learning rate the graph
  // has as a constant: it did not change while the program was traced). Until then the memo is
  // not replayed. It keeps its own numbers (recorded_numbers): a later recording in which a
  // pinned number changed (the graph feeds it now) confirms it again, with that number's places.
  // Example, SGD under StepLR: `alpha=-lr` is pinned while the graph has lr as a constant; the
  // first new lr is a divergence and a new graph that feeds it, whose memo, confirmed with lr
  // pinned, meets the next new lr and takes it as a number from then on.
  size_t numbers = 0;
  std::vector<std::pair<uint32_t, double>> pinned;  // (the caller's number, its value)
  std::vector<double> recorded_numbers;
  bool confirmed = true;
  uint64_t id = 0;  // (which memo a confirming recording compares with)
  // The tensor the call returned, an output of one of its records (clip_grad_norm_'s total norm),
  // made again as a placeholder in a replay; record -1: it returned none.
  int32_t result_record = -1;
  uint32_t result_output = 0;
  uint64_t path_after = 0;  // (as BackwardMemo::path_after)
};

// A call being recorded (PythonRunner::validate adds a step per op, claim_outputs notes outputs
// that are arguments). `ineligible`: the first reason it cannot become a memo.
struct CallRecording {
  CallMemo memo;
  std::vector<at::Tensor> arguments;  // held for the call only
  std::vector<double> numbers;
  uint64_t confirms = 0;              // the id of the unconfirmed memo this recording may confirm
  std::vector<int64_t> versions_before;
  // Every tensor the call's ops made (a write into one is into a temporary of the call: Adam's
  // `denom.add_(eps)`). Addresses only: they are compared while the call runs.
  std::vector<const c10::TensorImpl*> made;
  uint64_t sequence_before = 0;
  std::string ineligible;
};

// Memos kept per generated graph: one per optimizer and path, and a few for changed
// hyperparameters (a learning rate that steps now and then).
inline constexpr size_t kMaxCallMemos = 16;

}  // namespace terra::runtime
