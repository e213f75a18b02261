// Reads the Python side answers itself (docs/RUNTIME.md, "Known values").
//
// Optimizers keep their step counters in small CPU tensors and read them every step:
// torch.optim.Adam's single-tensor path does `step_t += 1` and then `step_t.item()` for every
// parameter (torch/optim/adam.py, _get_value). In co-execution each `.item()` would wait until the
// graph has run everything Python issued before it, so Python and the graph take turns instead of
// overlapping. But the value follows from values Python already knows: the counter was read once,
// and `+= 1` is an op Python can run itself on a one-element tensor in a microsecond.
//
// So the PythonRunner keeps a *known value* beside small CPU tensors (at most kMaxKnownElements
// elements): a private copy, valid while the tensor's version counter says nobody wrote it since.
//   - a read that waited for the graph (the first `.item()`) makes its small CPU inputs known;
//   - an op whose tensor inputs are all known (or Python numbers) and whose outputs are small CPU
//     tensors is also run on the copies, so its outputs become known (in-place ops: the written
//     tensor's copy is updated and its version moves with autograd's bump);
//   - a read whose inputs are all known runs on the copies and does not wait.
// The graph still runs every op (its values are the real ones); the copies only answer reads, and
// the same kernels on the same bits give the same bits. Anything else that writes such a tensor
// bumps its version (autograd's in-place ops, an eager iteration), so its copy is ignored from then
// on, until a read that waits makes it known again. Random ops are never run on copies.
//
// Example (Adam, iteration 10, one parameter):
//     step_t += 1        -> placeholder path; the copy of step_t (known since iteration 3) += 1
//     step_t.item()      -> 11.0 from the copy; no wait
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <optional>
#include <unordered_map>

#include "common/flat_map.h"

namespace terra::runtime {

inline constexpr int64_t kMaxKnownElements = 4;

class KnownValues {
 public:
  // `t` has its current value (it was just materialized): remember a copy if it is small.
  void learn(const at::Tensor& t);
  // `args` with every tensor replaced by its known value (a Python number stands for itself);
  // false if some tensor argument has none (or a list of tensors is passed).
  bool substitute(c10::ArrayRef<c10::IValue> args, torch::jit::Stack& out) const;
  // A tensor a co-executed op writes (the graph writes it later): it is never fresh.
  void note_written(const at::Tensor& t);
  // After an op Python answered with placeholders, whose arguments substitute() replaced in
  // `known`: runs it on them (below autograd, without interception) and keeps the results as
  // the values of `outputs` (the op's outputs, flattened) if they are all small CPU tensors, and
  // of `written` (the tensors the op writes in place, list elements flattened, in schema order).
  void follow(const c10::OperatorHandle& op, torch::jit::Stack& known, c10::ArrayRef<at::Tensor> written,
              c10::ArrayRef<at::Tensor> outputs);
  // `t` is written by an op Python does not follow.
  void forget(const at::Tensor& t) {
    if (!t.defined()) return;
    if (!known_.empty()) known_.erase(t.unsafeGetTensorImpl());
    note_written(t);
  }
  // Forgets everything (the graph failed: what it had not computed never happened).
  void clear() {
    known_.clear();
    unsettled_.clear();
  }
  // The ops that wrote known tensors have returned through autograd: their versions are final.
  // Called before every op, and at the end of an iteration.
  void settle();
  // Dead entries may have piled up (checked once per iteration).
  bool wants_pruning() const { return known_.size() > 64 || written_.size() > 4096; }
  // Drops the entries of tensors that died.
  void prune();
  bool empty() const { return known_.empty(); }
  size_t size() const { return known_.size(); }

 private:
  struct Known {
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> impl;
    at::Tensor value;
    int64_t version = 0;  // the tensor's version counter when `value` was its value
    bool settled = true;  // false between an op that wrote it and the next op (settle())
  };
  static bool small_cpu(const at::Tensor& t);
  static at::Tensor copy_of(const at::Tensor& t);  // a private copy, made below autograd
  const Known* find(const at::Tensor& t) const;
  bool fresh(const at::Tensor& t) const;
  bool was_written(const void* storage) const;

  common::FlatMap<const c10::TensorImpl*, Known> known_;
  // The storage of every tensor a co-executed op wrote, views included, held weakly: a storage
  // that died frees its address for a fresh tensor. Bounded; past the bound nothing is fresh.
  static constexpr size_t kMaxWritten = 1 << 20;
  std::unordered_map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>> written_;
  std::vector<const c10::TensorImpl*> unsettled_;
  bool written_overflow_ = false;
};

}  // namespace terra::runtime
