#include "runtime/scalar_arithmetic.h"

#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace terra::runtime {

namespace {

enum class Arith { kAdd, kSub, kMul, kEq, kNe, kLt, kLe, kGt, kGe };

bool is_comparison(Arith a) { return a >= Arith::kEq; }

// An op taken: what it computes, and whether it writes self (add_) or returns a new tensor (add).
struct ArithOp {
  Arith arith;
  bool in_place;
};

// The ops taken, by handle (an OperatorHandle compares by its entry; looked up once).
std::optional<ArithOp> arith_of(const c10::OperatorHandle& op) {
  struct Known {
    c10::OperatorHandle handle;
    ArithOp what;
  };
  static const std::vector<Known> known = [] {
    std::vector<Known> out;
    auto add = [&](const char* name, const char* overload, Arith a) {
      const std::string n(name);
      if (auto h = c10::Dispatcher::singleton().findOp({name, overload})) out.push_back({*h, {a, n.back() == '_'}});
    };
    // (Comparisons in place write self's dtype, not bool: left to ATen.)
    static constexpr std::pair<const char*, Arith> kTaken[] = {
        {"aten::add_", Arith::kAdd}, {"aten::sub_", Arith::kSub}, {"aten::mul_", Arith::kMul},
        {"aten::add", Arith::kAdd},  {"aten::sub", Arith::kSub},  {"aten::mul", Arith::kMul},
        {"aten::eq", Arith::kEq},    {"aten::ne", Arith::kNe},    {"aten::lt", Arith::kLt},
        {"aten::le", Arith::kLe},    {"aten::gt", Arith::kGt},    {"aten::ge", Arith::kGe}};
    for (const char* overload : {"Tensor", "Scalar"})
      for (const auto& [name, arith] : kTaken) add(name, overload, arith);
    return out;
  }();
  for (const Known& k : known)
    if (k.handle == op) return k.what;
  return std::nullopt;
}

bool one_element_cpu(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.layout() == c10::kStrided && t.numel() == 1 && t.has_storage() &&
         !t.is_conj() && !t.is_neg() && !t.is_quantized() && t.data_ptr() != nullptr;
}

// A one-element tensor's value, read from its memory (item() would go through the dispatcher).
std::optional<c10::Scalar> value_at(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return c10::Scalar(*t.const_data_ptr<double>());
    case at::kFloat: return c10::Scalar(static_cast<double>(*t.const_data_ptr<float>()));
    case at::kLong: return c10::Scalar(*t.const_data_ptr<int64_t>());
    default: return std::nullopt;
  }
}

// The other operand, where TensorIterator would convert it to self's dtype: a Python number (a
// Scalar or a wrapped-number tensor) of a kind that does not promote self's dtype, or a
// one-element tensor of self's dtype and shape.
std::optional<c10::Scalar> other_operand(const at::Tensor& self, const c10::IValue& v) {
  const bool integral_self = self.scalar_type() == at::kLong;
  auto number = [&](const c10::Scalar& s) -> std::optional<c10::Scalar> {
    if (!s.isFloatingPoint() && !s.isIntegral(/*includeBool=*/false)) return std::nullopt;  // bool, complex, symbolic
    if (integral_self && !s.isIntegral(false)) return std::nullopt;  // int64 * 0.5 promotes: ATen refuses in place
    return s;
  };
  if (v.isScalar()) return number(v.toScalar());
  if (!v.isTensor()) return std::nullopt;
  const at::Tensor& t = v.toTensor();
  if (!one_element_cpu(t)) return std::nullopt;
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
    const std::optional<c10::Scalar> s = value_at(t);
    return s ? number(*s) : std::nullopt;
  }
  if (t.scalar_type() != self.scalar_type() || t.sizes() != self.sizes()) return std::nullopt;
  return value_at(t);
}

// The number as TensorIterator casts it to T (static_cast, as c10::fetch_and_cast does).
template <typename T>
T cast_to(const c10::Scalar& s) {
  return s.isIntegral(false) ? static_cast<T>(s.toLong()) : static_cast<T>(s.toDouble());
}

template <typename T>
T apply(Arith a, T x, T y) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;  // wraps as the kernel's does, without signed overflow
    const U ux = static_cast<U>(x), uy = static_cast<U>(y);
    switch (a) {
      case Arith::kAdd: return static_cast<T>(ux + uy);
      case Arith::kSub: return static_cast<T>(ux - uy);
      case Arith::kMul: return static_cast<T>(ux * uy);
      default: break;  // (comparisons: compare())
    }
  } else {
    switch (a) {
      case Arith::kAdd: return x + y;
      case Arith::kSub: return x - y;
      case Arith::kMul: return x * y;
      default: break;  // (comparisons: compare())
    }
  }
  return x;
}

// ATen's comparison kernels compare in the common dtype, both operands cast to it (lt_kernel,
// aten/src/ATen/native/cpu/BinaryOpsKernel.cpp): NaN compares unequal to everything.
template <typename T>
bool compare(Arith a, T x, T y) {
  switch (a) {
    case Arith::kEq: return x == y;
    case Arith::kNe: return x != y;
    case Arith::kLt: return x < y;
    case Arith::kLe: return x <= y;
    case Arith::kGt: return x > y;
    case Arith::kGe: return x >= y;
    default: return false;
  }
}

// out = self (op) other; `out` may be self (then T is its dtype), or a bool for a comparison.
template <typename T>
void update(const at::Tensor& out, const at::Tensor& self, Arith a, const c10::Scalar& other) {
  if (is_comparison(a)) *out.data_ptr<bool>() = compare(a, *self.const_data_ptr<T>(), cast_to<T>(other));
  else *out.data_ptr<T>() = apply(a, *self.const_data_ptr<T>(), cast_to<T>(other));
}

}  // namespace

bool run_scalar_arithmetic(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  const std::optional<ArithOp> what = arith_of(op);
  if (!what) return false;
  const Arith arith = what->arith;
  const size_t nargs = op.schema().arguments().size();  // self, other[, alpha]
  if (stack.size() != nargs || !stack[0].isTensor()) return false;
  const at::Tensor& self = stack[0].toTensor();
  const at::ScalarType dtype = self.scalar_type();
  if (!one_element_cpu(self) || (dtype != at::kFloat && dtype != at::kDouble && dtype != at::kLong)) return false;
  // (A functional op's self that is itself a Python number would promote by other rules.)
  if (!what->in_place && self.unsafeGetTensorImpl()->is_wrapped_number()) return false;
  if (nargs == 3) {
    if (!stack[2].isScalar()) return false;
    const c10::Scalar alpha = stack[2].toScalar();
    // (An integral tensor refuses a floating alpha, even 1.0.)
    const bool one = alpha.isIntegral(false) ? alpha.toLong() == 1 : alpha.isFloatingPoint() && dtype != at::kLong && alpha.toDouble() == 1.0;
    if (!one) return false;
  }
  const std::optional<c10::Scalar> other = other_operand(self, stack[1]);
  if (!other) return false;
  // The functional op's result: a new tensor of self's sizes and dtype (bool for a comparison; the
  // other operand neither broadcasts nor promotes), laid out as TensorIterator lays out a
  // one-element output.
  const at::ScalarType out_dtype = is_comparison(arith) ? at::kBool : dtype;
  const at::Tensor out = what->in_place
                             ? self
                             : at::Tensor(at::detail::empty_cpu(self.sizes(), out_dtype, /*pin_memory=*/false, std::nullopt));
  switch (dtype) {
    case at::kFloat: update<float>(out, self, arith, *other); break;
    case at::kDouble: update<double>(out, self, arith, *other); break;
    default: update<int64_t>(out, self, arith, *other); break;
  }
  c10::IValue result(out);  // (an in-place op returns self)
  stack.clear();
  stack.push_back(std::move(result));
  return true;
}

std::optional<c10::Scalar> one_element_value(const at::Tensor& t) {
  return one_element_cpu(t) ? value_at(t) : std::nullopt;
}

}  // namespace terra::runtime
