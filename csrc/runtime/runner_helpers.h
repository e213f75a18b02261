// Small helpers the PythonRunner's files share (python_runner.cpp, op_check.cpp, graph_link.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <string>

#include "capture/trace_record.h"
#include "trace/hash.h"

namespace terra::runtime::detail {

inline std::string op_name(const capture::OpRecord& rec) { return c10::toString(rec.op.operator_name()); }

// The tensor an input of the record refers to, from the op's arguments.
inline at::Tensor argument_tensor(c10::ArrayRef<c10::IValue> args, const capture::OpInput& in) {
  if (in.argument < 0 || static_cast<size_t>(in.argument) >= args.size()) return {};
  const c10::IValue& a = args[in.argument];
  if (in.list_index < 0) return a.isTensor() ? a.toTensor() : at::Tensor();
  if (a.isTensorList()) return a.toTensorList().get(in.list_index);
  if (a.isOptionalTensorList()) {
    const c10::IValue& e = a.toListRef()[in.list_index];
    return e.isTensor() ? e.toTensor() : at::Tensor();
  }
  return {};
}

// Sizes are not part of a node's key: the path hash a backward memo is keyed by mixes them in.
inline uint64_t hash_sizes(uint64_t h, const at::Tensor& t) {
  if (!t.defined()) return h;
  for (const int64_t d : t.sizes()) h = trace::hash_combine(h, static_cast<uint64_t>(d));
  return trace::hash_combine(h, static_cast<uint64_t>(t.dim()));
}

}  // namespace terra::runtime::detail
