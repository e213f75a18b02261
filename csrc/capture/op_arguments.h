// Facts about an op's arguments that the capture layer, the emitter and the runtime all ask:
// which arguments it writes, and which non-tensor arguments are lists of Python floats. Written
// once here (capture is the lowest layer that knows operators).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <algorithm>

namespace terra::capture {

// Batch-norm kernels whose schemas do not say that they write their running statistics
// (`native_batch_norm(Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, Tensor?
// running_var, bool training, ...)`; cudnn_batch_norm and miopen_batch_norm alike): in training
// they update arguments 3 and 4 in place. Read after the forward, `bn.running_mean.sum()` was
// taken for a value nothing had written and computed from memory the graph had not updated yet;
// running statistics over memory Python writes without an op were fed to the graph as a copy,
// which the update then went to (emit/written_feeds.cpp).
bool writes_running_statistics(const c10::FunctionSchema& schema);
inline constexpr size_t kRunningMeanArgument = 3, kRunningVarArgument = 4, kBatchNormTrainingArgument = 5;

// The op's schema says it writes one of its arguments (in-place, out=, foreach ops on lists).
// (Not the batch norms above: the emitter runs them as it always has, in program order.)
inline bool writes_an_argument(const c10::FunctionSchema& schema) {
  for (const c10::Argument& a : schema.arguments())
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) return true;
  return false;
}

// Calls f(tensor) for every tensor the op writes among `args` (its arguments, or a stack laid out
// like them), list elements one by one, in schema order; then a training batch norm's running
// statistics.
template <typename F>
void for_each_written(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, F&& f) {
  const auto& params = op.schema().arguments();
  for (size_t i = 0; i < params.size() && i < args.size(); ++i) {
    const c10::AliasInfo* alias = params[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    if (args[i].isTensor()) {
      f(args[i].toTensor());
    } else if (args[i].isTensorList()) {
      for (const at::Tensor& t : args[i].toTensorList().vec()) f(t);
    }
  }
  if (args.size() > kBatchNormTrainingArgument && args[kBatchNormTrainingArgument].isBool() &&
      args[kBatchNormTrainingArgument].toBool() && writes_running_statistics(op.schema()))
    for (const size_t i : {kRunningMeanArgument, kRunningVarArgument})
      if (args[i].isTensor() && args[i].toTensor().defined()) f(args[i].toTensor());
}

// float[], or a Scalar[] argument holding floats only (the foreach optimizers' per-parameter step
// sizes): a value of the program like a float, not part of the op's identity.
inline bool is_float_list(const c10::IValue& v) {
  if (v.isDoubleList()) return true;
  if (!v.isList()) return false;
  const auto& list = v.toListRef();
  return !list.empty() && std::all_of(list.begin(), list.end(), [](const c10::IValue& e) { return e.isDouble(); });
}

}  // namespace terra::capture
