#include "capture/collectives.h"

#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string>

#include "capture/interceptor.h"

namespace terra::capture {

bool is_collective(const c10::OperatorHandle& op) {
  const std::string& name = op.schema().name();
  // (Asked for every intercepted op in co-execution; nearly all are aten:: ops.)
  if (name.empty() || (name[0] != 'c' && name[0] != '_')) return false;
  auto starts = [&](const char* ns) { return name.compare(0, std::strlen(ns), ns) == 0; };
  return starts("c10d::") || starts("_c10d_functional::") || starts("_c10d_functional_autograd::") ||
         starts("c10d_functional::");
}

namespace {

// The functional collectives' name of a reduction (torch/csrc/distributed/c10d/Functional.cpp),
// or nothing for one they do not take (PREMUL_SUM carries a factor, the bitwise ones are rare).
std::optional<std::string> reduce_op_name(const c10::IValue& v) {
  if (!v.isCustomClass()) return std::nullopt;
  switch (v.toCustomClass<c10d::ReduceOp>()->op_) {
    case c10d::ReduceOp::SUM: return "sum";
    case c10d::ReduceOp::AVG: return "avg";
    case c10d::ReduceOp::PRODUCT: return "product";
    case c10d::ReduceOp::MIN: return "min";
    case c10d::ReduceOp::MAX: return "max";
    default: return std::nullopt;
  }
}

std::optional<std::string> group_name(const c10::IValue& v) {
  if (!v.isCustomClass()) return std::nullopt;
  const std::string& name = v.toCustomClass<c10d::ProcessGroup>()->getGroupName();
  if (name.empty()) return std::nullopt;  // not in the registry the functional ops look groups up in
  return name;
}

// Dense, strided tensors only (a sparse all_reduce has no functional form).
bool all_dense(const c10::IValue& v) {
  if (!v.isTensorList()) return false;
  for (const at::Tensor& t : v.toTensorList().vec())
    if (!t.defined() || t.layout() != c10::kStrided) return false;
  return true;
}

// A Work that is complete: its future holds the tensors (what dist.all_reduce's caller may ask
// of work.get_future()), wait() returns at once.
c10::intrusive_ptr<c10d::Work> completed_work(const c10::List<at::Tensor>& tensors) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  future->markCompleted(c10::IValue(tensors));
  return c10d::Work::create_from_future(future);
}

// What every lowered op returns: its written tensors as the schema's first return (`written`),
// and a completed Work holding `tensors`.
void return_completed(const c10::OperatorHandle& op, torch::jit::Stack* stack, c10::IValue written,
                      const c10::List<at::Tensor>& tensors) {
  torch::jit::drop(*stack, op.schema().arguments().size());
  stack->emplace_back(std::move(written));
  stack->emplace_back(completed_work(tensors));
}

c10::OperatorHandle functional(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor call(const c10::OperatorHandle& op, std::initializer_list<c10::IValue> args) {
  torch::jit::Stack stack(args);
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// Issues `collective(t)` for each tensor functionally and writes the result into it (the ops go
// through the dispatcher from the top, so the open region traces them like the user's own).
void lower(const c10::List<at::Tensor>& tensors, const std::function<at::Tensor(const at::Tensor&)>& collective) {
  static const c10::OperatorHandle wait = functional("_c10d_functional::wait_tensor");
  for (const at::Tensor& t : tensors.vec()) {
    at::Tensor result = call(wait, {collective(t)});
    const_cast<at::Tensor&>(t).copy_(result);
  }
}

// c10d::allreduce_(Tensor[] tensors, ProcessGroup process_group, ReduceOp reduce_op,
//                  Tensor? sparse_indices, bool async_op=True, int timeout=-1) -> (Tensor[], Work)
void allreduce_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  auto args = stack->end() - op.schema().arguments().size();
  const std::optional<std::string> group = group_name(args[1]);
  const std::optional<std::string> reduction = reduce_op_name(args[2]);
  if (intercepting_region() == nullptr || !group || !reduction || !args[3].isNone() || !all_dense(args[0])) {
    intercept(op, ks, stack);
    return;
  }
  static const c10::OperatorHandle all_reduce = functional("_c10d_functional::all_reduce");
  const c10::List<at::Tensor> tensors = args[0].toTensorList();
  lower(tensors, [&](const at::Tensor& t) { return call(all_reduce, {t, *reduction, *group}); });
  return_completed(op, stack, tensors, tensors);
}

// c10d::broadcast_(Tensor[] tensors, ProcessGroup process_group, int root_rank, int root_tensor,
//                  bool async_op=True, int timeout=-1) -> (Tensor[], Work)
void broadcast_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  auto args = stack->end() - op.schema().arguments().size();
  const std::optional<std::string> group = group_name(args[1]);
  if (intercepting_region() == nullptr || !group || args[3].toInt() != 0 || !all_dense(args[0])) {
    intercept(op, ks, stack);
    return;
  }
  static const c10::OperatorHandle broadcast = functional("_c10d_functional::broadcast");
  const int64_t root = args[2].toInt();
  const c10::List<at::Tensor> tensors = args[0].toTensorList();
  lower(tensors, [&](const at::Tensor& t) { return call(broadcast, {t, root, *group}); });
  return_completed(op, stack, tensors, tensors);
}

// all_gather_into_tensor of `input` flattened: the ranks' values one after the other.
at::Tensor gather_flat(const at::Tensor& input, int64_t size, const std::string& group) {
  static const c10::OperatorHandle gather = functional("_c10d_functional::all_gather_into_tensor");
  static const c10::OperatorHandle wait = functional("_c10d_functional::wait_tensor");
  return call(wait, {call(gather, {input.reshape({-1}), size, group})});
}

// c10d::_allgather_base_(Tensor output_tensor, Tensor input_tensor, ProcessGroup process_group,
//                        bool async_op=True, int timeout=-1) -> (Tensor, Work)
// (dist.all_gather_into_tensor)
void allgather_base_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  auto args = stack->end() - op.schema().arguments().size();
  const std::optional<std::string> group = group_name(args[2]);
  const at::Tensor output = args[0].toTensor();
  const at::Tensor input = args[1].toTensor();
  if (intercepting_region() == nullptr || !group || output.layout() != c10::kStrided ||
      input.layout() != c10::kStrided) {
    intercept(op, ks, stack);
    return;
  }
  const int64_t size = args[2].toCustomClass<c10d::ProcessGroup>()->getSize();
  const at::Tensor gathered = gather_flat(input, size, *group);
  const_cast<at::Tensor&>(output).copy_(gathered.view(output.sizes()));
  return_completed(op, stack, output, c10::List<at::Tensor>({output}));
}

// c10d::allgather_(Tensor[][] output_tensors, Tensor[] input_tensors, ProcessGroup process_group,
//                  bool async_op=True, int timeout=-1) -> (Tensor[][], Work)
// (dist.all_gather: one input, one output per rank, each shaped like the input)
void allgather_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  auto args = stack->end() - op.schema().arguments().size();
  const std::optional<std::string> group = group_name(args[2]);
  const int64_t size = group ? args[2].toCustomClass<c10d::ProcessGroup>()->getSize() : 0;
  auto outputs = args[0].to<c10::List<c10::List<at::Tensor>>>();
  const bool lowered = intercepting_region() != nullptr && group && all_dense(args[1]) &&
                       args[1].toTensorList().size() == 1 && outputs.size() == 1 &&
                       static_cast<int64_t>(c10::List<at::Tensor>(outputs.get(0)).size()) == size;
  if (!lowered) {
    intercept(op, ks, stack);
    return;
  }
  const at::Tensor input = args[1].toTensorList().get(0);
  const c10::List<at::Tensor> per_rank = outputs.get(0);
  for (const at::Tensor& out : per_rank.vec())
    if (!out.defined() || out.layout() != c10::kStrided || out.sizes() != input.sizes()) {
      intercept(op, ks, stack);
      return;
    }
  const at::Tensor gathered = gather_flat(input, size, *group);
  const int64_t n = input.numel();
  for (int64_t k = 0; k < size; ++k) {
    at::Tensor out = per_rank.get(k);
    out.copy_(gathered.narrow(0, k * n, n).view(input.sizes()));
  }
  return_completed(op, stack, outputs, per_rank);
}

}  // namespace

}  // namespace terra::capture

// Ops without an autograd kernel of their own (c10d's, most custom ops) reach a tensor's autograd
// key through a backend fallback, which torch registers for its own backends' autograd keys
// (aten/src/ATen/core/VariableFallbackKernel.cpp) but not for PrivateUse3's: without this one, `dist.all_reduce(placeholder)` raised NotImplementedError. The
// same fallback as torch's: an op on inputs that require grad gets a node that raises if backward
// reaches it; otherwise the op goes on below autograd, to the interceptor.
TORCH_LIBRARY_IMPL(_, AutogradPrivateUse3, m) { m.fallback(torch::autograd::basicAutogradNotImplementedFallback()); }

TORCH_LIBRARY_IMPL(c10d, PrivateUse3, m) {
  m.impl("allreduce_", torch::CppFunction::makeFromBoxedFunction<&terra::capture::allreduce_kernel>());
  m.impl("broadcast_", torch::CppFunction::makeFromBoxedFunction<&terra::capture::broadcast_kernel>());
  m.impl("allgather_", torch::CppFunction::makeFromBoxedFunction<&terra::capture::allgather_kernel>());
  m.impl("_allgather_base_", torch::CppFunction::makeFromBoxedFunction<&terra::capture::allgather_base_kernel>());
}
