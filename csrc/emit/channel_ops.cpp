// Registers the terra:: channel operators that generated graphs call, and the thread-local
// ChannelSource they talk to.
//
// Every schema uses AliasAnalysisKind::CONSERVATIVE (torch/csrc/jit/ir/ir.cpp): a
// conservative op in a non-aten namespace counts as having side effects (Node::hasSideEffects),
// so dead-code elimination keeps it, constant propagation does not run it at compile time even
// with a constant site id, CSE does not merge two of them, and alias analysis treats its tensor
// arguments as written and its results as wildcards, so no mutation moves across it.
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/custom_operator.h>
#include <torch/library.h>

#include "emit/channel.h"

namespace terra::emit {

namespace {

thread_local ChannelSource* t_current = nullptr;

ChannelSource& require(const char* op) {
  TORCH_CHECK(t_current != nullptr, "terra_torch: ", op,
              " ran with no ChannelSource installed on this thread (a generated graph must run "
              "inside a ChannelScope)");
  return *t_current;
}

int64_t case_select(int64_t site) { return require(kCaseSelectOp).case_select(site); }
bool loop_cond(int64_t site) { return require(kLoopCondOp).loop_cond(site); }

at::Tensor feed(int64_t slot) {
  at::Tensor t = require(kFeedOp).feed(slot);
  TORCH_CHECK(t.defined(), "terra_torch: feed slot ", slot, " received no tensor");
  return t;
}

std::optional<at::Tensor> feed_or_none(int64_t slot) {
  at::Tensor t = require(kFeedOrNoneOp).feed(slot);
  if (!t.defined()) return std::nullopt;
  return t;
}

void gate(int64_t node) { require(kGateOp).gate(node); }

double feed_scalar(int64_t slot) { return require(kFeedScalarOp).feed_scalar(slot); }

int64_t feed_int(int64_t slot) { return require(kFeedIntOp).feed_int(slot); }
bool feed_bool(int64_t slot) { return require(kFeedBoolOp).feed_int(slot) != 0; }

// A list arrives as its length followed by its elements, all on the slot's one queue; `element`
// reads one (feed_int, or feed_scalar for a float's bits) and `add` keeps it.
template <typename Add>
void feed_list(const char* op, int64_t slot, bool floats, Add add) {
  ChannelSource& source = require(op);
  const int64_t n = source.feed_int(slot);
  TORCH_CHECK(n >= 0, "terra_torch: list slot ", slot, " of ", op, " received the length ", n);
  for (int64_t i = 0; i < n; ++i) {
    if (floats) add(source.feed_scalar(slot));
    else add(source.feed_int(slot));
  }
}

std::vector<int64_t> feed_int_list(int64_t slot) {
  std::vector<int64_t> out;
  feed_list(kFeedIntListOp, slot, false, [&](auto v) { out.push_back(static_cast<int64_t>(v)); });
  return out;
}

std::vector<double> feed_float_list(int64_t slot) {
  std::vector<double> out;
  feed_list(kFeedFloatListOp, slot, true, [&](auto v) { out.push_back(static_cast<double>(v)); });
  return out;
}

// The same for a Scalar[] parameter. Boxed: an unboxed kernel cannot return a list of Scalars.
void feed_number_list(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const int64_t slot = stack->back().toInt();
  stack->pop_back();
  c10::impl::GenericList out(c10::NumberType::get());
  feed_list(kFeedNumberListOp, slot, true, [&](auto v) { out.push_back(c10::IValue(static_cast<double>(v))); });
  stack->emplace_back(std::move(out));
}

void publish(int64_t tag, const std::optional<at::Tensor>& value) {
  require(kPublishOp).publish(tag, value.has_value() ? *value : at::Tensor());
}

// With no source installed this is a no-op: that is the case while a capture region records a
// terra::fetch marker (the interceptor runs the real kernel after recording it).
void fetch(int64_t slot, const at::Tensor& value) {
  if (t_current != nullptr) t_current->fetch(slot, value);
}

}  // namespace

ChannelSource* current_channel() { return t_current; }

double ChannelSource::feed_scalar(int64_t slot) {
  TORCH_CHECK(false, "terra_torch: this channel cannot feed scalar slot ", slot, " (co-execution graphs only)");
}

int64_t ChannelSource::feed_int(int64_t slot) {
  TORCH_CHECK(false, "terra_torch: this channel cannot feed int slot ", slot, " (co-execution graphs only)");
}

namespace {

// terra::boxed_call(str name, str overload, Any[] args) -> Any: an operator TorchScript's schema
// matching refuses for the recorded argument types (aten::full with a bool fill value: a
// TorchScript `Scalar` is int, float or complex, never bool) still runs, called through its
// c10::OperatorHandle boxed, with exactly the IValues the dispatcher boxed in eager. One result
// comes back as itself, none as None, several as a tuple (the emitter casts and unpacks them).
// A fixed schema, not varargs: torch registers varargs JIT operators only for its own prim ops
// (torch/csrc/jit/runtime/operator.cpp, registerOperator).
void call_boxed(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  c10::List<c10::IValue> args = torch::jit::pop(stack).toList();
  for (const c10::IValue& a : args) stack.push_back(a);
  op.callBoxed(stack);
  const size_t n = op.schema().returns().size();
  if (n == 0) {
    stack.emplace_back();
  } else if (n > 1) {
    std::vector<c10::IValue> results(std::make_move_iterator(stack.end() - n), std::make_move_iterator(stack.end()));
    torch::jit::drop(stack, n);
    stack.emplace_back(c10::ivalue::Tuple::create(std::move(results)));
  }
}

// The operator is looked up by its name at every call, through a process-wide table: an Operation
// made once per node from the node's constant name would be wrong, because TorchScript's
// interpreter keeps one Operation per operator name and input count for a whole graph
// (torch/csrc/jit/runtime/interpreter/code_impl.h, add_to_operator_table), so every
// terra::boxed_call of a graph would run the first one's operator (aten::full called as
// aten::bitwise_and.Scalar: "Expected Tensor but got Device").
c10::OperatorHandle find_op(const std::string& name, const std::string& overload) {
  static std::mutex mu;
  static std::unordered_map<std::string, c10::OperatorHandle> table;
  const std::string key = name + "." + overload;
  std::lock_guard<std::mutex> lock(mu);
  auto it = table.find(key);
  if (it == table.end())
    it = table.emplace(key, c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str())).first;
  return it->second;
}

torch::jit::Operation boxed_operation(const torch::jit::Node*) {
  return [](torch::jit::Stack& stack) {
    c10::IValue args = torch::jit::pop(stack);
    const c10::IValue overload = torch::jit::pop(stack);
    const c10::IValue name = torch::jit::pop(stack);
    stack.push_back(std::move(args));
    call_boxed(find_op(name.toStringRef(), overload.toStringRef()), stack);
  };
}

// Conservative alias analysis in a non-aten namespace: never folded, merged or removed, and
// nothing moves across it.
torch::jit::RegisterOperators boxed_call_registration({torch::jit::Operator(
    std::string(kBoxedCallOp) + "(str name, str overload, Any[] args) -> Any", boxed_operation,
    c10::AliasAnalysisKind::CONSERVATIVE)});

}  // namespace

ChannelScope::ChannelScope(ChannelSource* source) : saved_(t_current) { t_current = source; }
ChannelScope::~ChannelScope() { t_current = saved_; }

}  // namespace terra::emit

TORCH_LIBRARY(terra, m) {
  using c10::AliasAnalysisKind;
  // No tensor arguments: a catch-all kernel is the only one the dispatcher can pick.
  m.def(torch::schema("case_select(int site) -> int", AliasAnalysisKind::CONSERVATIVE),
        &terra::emit::case_select);
  m.def(torch::schema("loop_cond(int site) -> bool", AliasAnalysisKind::CONSERVATIVE), &terra::emit::loop_cond);
  m.def(torch::schema("feed(int slot) -> Tensor", AliasAnalysisKind::CONSERVATIVE), &terra::emit::feed);
  m.def(torch::schema("feed_or_none(int slot) -> Tensor?", AliasAnalysisKind::CONSERVATIVE),
        &terra::emit::feed_or_none);
  m.def(torch::schema("gate(int node) -> ()", AliasAnalysisKind::CONSERVATIVE), &terra::emit::gate);
  m.def(torch::schema("feed_scalar(int slot) -> float", AliasAnalysisKind::CONSERVATIVE), &terra::emit::feed_scalar);
  m.def(torch::schema("feed_int(int slot) -> int", AliasAnalysisKind::CONSERVATIVE), &terra::emit::feed_int);
  m.def(torch::schema("feed_bool(int slot) -> bool", AliasAnalysisKind::CONSERVATIVE), &terra::emit::feed_bool);
  m.def(torch::schema("feed_int_list(int slot) -> int[]", AliasAnalysisKind::CONSERVATIVE),
        &terra::emit::feed_int_list);
  m.def(torch::schema("feed_float_list(int slot) -> float[]", AliasAnalysisKind::CONSERVATIVE),
        &terra::emit::feed_float_list);
  m.def(torch::schema("feed_number_list(int slot) -> Scalar[]", AliasAnalysisKind::CONSERVATIVE),
        torch::CppFunction::makeFromBoxedFunction<&terra::emit::feed_number_list>());
  // A catch-all kernel: publish only ever runs inside generated graphs, never in a capture region.
  m.def(torch::schema("publish(int tag, Tensor? value) -> ()", AliasAnalysisKind::CONSERVATIVE),
        &terra::emit::publish);
  // fetch has a tensor argument and gets backend kernels only (below): a catch-all kernel would
  // win over the capture layer's PrivateUse3 fallback, and a terra::fetch called inside a
  // capture region must be recorded (terra_torch.graph uses it to mark the values Python reads).
  m.def(torch::schema("fetch(int slot, Tensor value) -> ()", AliasAnalysisKind::CONSERVATIVE));
}

// fetch returns nothing, so autograd has nothing to do; the fallthrough also covers
// AutogradPrivateUse3, which has no fallback of its own while a capture region is open.
TORCH_LIBRARY_IMPL(terra, Autograd, m) { m.impl("fetch", torch::CppFunction::makeFallthrough()); }
TORCH_LIBRARY_IMPL(terra, CPU, m) { m.impl("fetch", &terra::emit::fetch); }
TORCH_LIBRARY_IMPL(terra, CUDA, m) { m.impl("fetch", &terra::emit::fetch); }
TORCH_LIBRARY_IMPL(terra, Meta, m) { m.impl("fetch", &terra::emit::fetch); }
