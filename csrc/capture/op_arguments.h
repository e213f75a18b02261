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

// The op writes one of its arguments (in-place, out=, foreach ops on lists).
inline bool writes_an_argument(const c10::OperatorHandle& op) {
  for (const c10::Argument& a : op.schema().arguments())
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) return true;
  return false;
}

// Calls f(tensor) for every tensor the op writes among `args` (its arguments, or a stack laid out
// like them), list elements one by one, in schema order.
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
