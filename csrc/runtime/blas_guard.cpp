// The guard's kernel, its verdicts and its calibration (runtime/blas_guard.h says why).
#include "runtime/blas_guard.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/env.h"
#include "runtime/worker_threads.h"

namespace terra::runtime {

namespace {

constexpr c10::DispatchKey kGuardKey = c10::DispatchKey::FPGA;  // (blas_guard.h says why this one)

// The ops whose CPU kernels call MKL's BLAS, and the argument positions of their two factors
// (each overload of these names: in-place, out=, out_dtype). Their multiply-adds are the first
// factor's elements times the second's last size (mm: m*k*n, bmm: b*m*k*n, addmv: m*n, dot: n).
struct Factors {
  int first;
  int second;
};
const std::unordered_map<std::string_view, Factors>& products() {
  static const std::unordered_map<std::string_view, Factors> table = {
      {"mm", {0, 1}},         {"bmm", {0, 1}},      {"dot", {0, 1}},       {"vdot", {0, 1}},
      {"addmm", {1, 2}},      {"addmm_", {1, 2}},   {"_addmm_activation", {1, 2}},
      {"baddbmm", {1, 2}},    {"baddbmm_", {1, 2}}, {"addbmm", {1, 2}},    {"addbmm_", {1, 2}},
      {"addmv", {1, 2}},      {"addmv_", {1, 2}},
  };
  return table;
}

bool mkl_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kComplexFloat || t == at::kComplexDouble;
}

// ---- layouts ---------------------------------------------------------------------------------

// A call's layout as integers: the op, then per argument a tag and its values. Tensors give
// dtype, sizes, strides and their data pointer's offset within 64 bytes (the CPU allocator's
// alignment; MKL's code path may depend on alignment, never on where the storage starts).
using Layout = std::vector<int64_t>;
enum Tag : int64_t { kUndefined = -1, kTensor = -2, kDouble = -3, kInt = -4, kBool = -5, kComplex = -6, kNone = -7 };

struct LayoutHash {
  size_t operator()(const Layout& l) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : l) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

int64_t alignment_of(const at::Tensor& t) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64); }

int64_t bits_of(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

// Writes the layout of the arguments on `stack`; false where the call is not for the guard (a
// non-CPU tensor, an argument we cannot key).
bool layout_of(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first, Layout* out) {
  out->clear();
  out->push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&op.schema())));
  for (size_t i = first; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        out->push_back(kUndefined);
        continue;
      }
      if (!t.device().is_cpu() || t.layout() != at::kStrided) return false;
      out->push_back(kTensor);
      out->push_back(static_cast<int64_t>(t.scalar_type()));
      out->push_back(t.dim());
      for (int64_t s : t.sizes()) out->push_back(s);
      for (int64_t s : t.strides()) out->push_back(s);
      out->push_back(alignment_of(t));
    } else if (v.isDouble()) {
      out->push_back(kDouble);
      out->push_back(bits_of(v.toDouble()));
    } else if (v.isInt()) {
      out->push_back(kInt);
      out->push_back(v.toInt());
    } else if (v.isBool()) {
      out->push_back(kBool);
      out->push_back(v.toBool());
    } else if (v.isComplexDouble()) {
      const c10::complex<double> c = v.toComplexDouble();
      out->push_back(kComplex);
      out->push_back(bits_of(c.real()));
      out->push_back(bits_of(c.imag()));
    } else if (v.isNone()) {
      out->push_back(kNone);
    } else {
      return false;
    }
  }
  return true;
}

// "aten::addmm [32, 64] x [64, 64] float" for the reason a layout keeps torch's team.
std::string describe(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first, Factors f) {
  std::ostringstream s;
  s << op.schema().operator_name();
  const at::Tensor& a = stack[first + f.first].toTensor();
  const at::Tensor& b = stack[first + f.second].toTensor();
  s << " " << a.sizes() << " x " << b.sizes() << " " << a.scalar_type();
  return s.str();
}

// ---- verdicts --------------------------------------------------------------------------------

enum class Verdict { kUnknown, kSame, kDiffer, kLarge };

struct Verdicts {
  std::mutex mu;
  std::unordered_map<Layout, Verdict, LayoutHash> by_layout;
  BlasGuardVerdicts counts;
};
Verdicts& verdicts() {
  static auto* v = new Verdicts();  // leaked: worker threads may outlive static destruction
  return *v;
}
// A program whose shapes never repeat must not grow the table without bound: past this many
// layouts it starts again (a layout then pays its calibration once more).
constexpr size_t kMaxLayouts = 100000;

Verdict lookup(const Layout& layout) {
  Verdicts& v = verdicts();
  std::lock_guard lock(v.mu);
  auto it = v.by_layout.find(layout);
  return it == v.by_layout.end() ? Verdict::kUnknown : it->second;
}

void store(const Layout& layout, Verdict verdict, const std::string& why, int64_t ns) {
  Verdicts& v = verdicts();
  std::lock_guard lock(v.mu);
  if (v.by_layout.size() >= kMaxLayouts) v.by_layout.clear();
  if (!v.by_layout.emplace(layout, verdict).second) return;  // (another worker was first)
  v.counts.calibration_ns += ns;
  switch (verdict) {
    case Verdict::kSame: ++v.counts.same; break;
    case Verdict::kDiffer: ++v.counts.differ; break;
    case Verdict::kLarge: ++v.counts.large; break;
    case Verdict::kUnknown: break;
  }
  if (verdict == Verdict::kDiffer && v.counts.why.empty()) v.counts.why = why;
}

// ---- calibration -----------------------------------------------------------------------------

// A tensor of `t`'s dtype, sizes, strides and alignment on fresh storage of uniform random values
// in [0, 1) (the real and imaginary parts, for complex), and its base storage as a 1-d tensor.
std::pair<at::Tensor, at::Tensor> random_like(const at::Tensor& t, at::Generator& gen) {
  const int64_t item = static_cast<int64_t>(t.element_size());
  const int64_t misalign = alignment_of(t);
  TORCH_CHECK(misalign % item == 0, "its data is not aligned to its element size");
  const int64_t offset = misalign / item;
  int64_t extent = offset;
  if (t.numel() > 0) {
    extent += 1;
    for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  }
  at::Tensor base = at::rand({std::max<int64_t>(extent, 1)}, gen, t.options());
  return {base, base.as_strided(t.sizes(), t.strides(), offset)};
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

// Runs the call on random inputs of its layout with torch's MKL team and with one thread (the
// real arguments are not touched); true where every result and every argument afterwards (the
// in-place and out= forms write into theirs) holds the same bits.
bool calibrate(const c10::OperatorHandle& op, c10::DispatchKeySet below, const torch::jit::Stack& stack,
               size_t first, std::string* why) {
  try {
    // A generator of our own: the program's random stream is not advanced.
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(/*seed_in=*/20261203);
    torch::jit::Stack team, one;
    std::vector<std::pair<at::Tensor, at::Tensor>> bases;  // (torch's team, one thread)
    for (size_t i = first; i < stack.size(); ++i) {
      const c10::IValue& v = stack[i];
      if (v.isTensor() && v.toTensor().defined()) {
        auto [base, view] = random_like(v.toTensor(), gen);
        at::Tensor copy = base.clone();
        team.emplace_back(view);
        one.emplace_back(copy.as_strided(view.sizes(), view.strides(), view.storage_offset()));
        bases.emplace_back(std::move(base), std::move(copy));
      } else {
        team.push_back(v);
        one.push_back(v);
      }
    }
    {
      BlasTeamGuard torchs_team(0);  // (0: the process's setting, the team eager runs with)
      op.redispatchBoxed(below, &team);
    }
    {
      BlasTeamGuard one_thread(1);
      op.redispatchBoxed(below, &one);
    }
    bool same = team.size() == one.size();
    for (size_t i = 0; same && i < team.size(); ++i) {
      if (team[i].isTensor() != one[i].isTensor()) same = false;
      else if (team[i].isTensor()) same = same_bits(team[i].toTensor(), one[i].toTensor());
    }
    for (size_t i = 0; same && i < bases.size(); ++i) same = same_bits(bases[i].first, bases[i].second);
    if (!same) *why = "other bits with one MKL thread than with torch's team";
    return same;
  } catch (const std::exception& e) {
    *why = std::string("raised on random inputs: ") + std::string(e.what()).substr(0, 200);
    return false;
  }
}

// ---- the kernel ------------------------------------------------------------------------------

thread_local BlasGuardCalls t_calls;

// Keys below ours: the backend kernel of the call.
c10::DispatchKeySet below_guard(c10::DispatchKeySet ks) {
  return ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kGuardKey);
}

void guard_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::DispatchKeySet below = below_guard(ks);
  const auto& table = products();
  const size_t n = op.schema().arguments().size();
  const size_t first = stack->size() - n;
  const std::string_view name(op.schema().name());
  const auto entry = table.find(name.substr(name.find("::") + 2));
  const Factors f = entry->second;  // (only the ops of the table have this kernel)
  const at::Tensor& a = (*stack)[first + f.first].toTensor();
  const at::Tensor& b = (*stack)[first + f.second].toTensor();
  thread_local Layout layout;  // (reused: no allocation per call)
  if (!a.defined() || !b.defined() || !mkl_dtype(a.scalar_type()) || !layout_of(op, *stack, first, &layout)) {
    op.redispatchBoxed(below, stack);  // not MKL's, or not a layout we key: as it comes
    return;
  }
  Verdict verdict = lookup(layout);
  if (verdict == Verdict::kUnknown) {
    const Layout key = layout;  // (a calibration's nested products reuse `layout`)
    const int64_t macs = a.numel() * (b.dim() >= 2 ? b.size(-1) : 1);
    std::string why;
    const auto t0 = std::chrono::steady_clock::now();
    if (macs > kMaxOneThreadMacs) {
      verdict = Verdict::kLarge;
    } else {
      verdict = calibrate(op, below, *stack, first, &why) ? Verdict::kSame : Verdict::kDiffer;
    }
    const int64_t ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    store(key, verdict, verdict == Verdict::kDiffer ? describe(op, *stack, first, f) + ": " + why : "", ns);
  }
  if (verdict == Verdict::kSame) {
    ++t_calls.one_thread;
    BlasTeamGuard one_thread(1);
    op.redispatchBoxed(below, stack);
  } else {
    ++t_calls.team;  // (the thread's team as it is: torch's, or one thread inside a calibrated call)
    op.redispatchBoxed(below, stack);
  }
}

}  // namespace

bool install_blas_guard() {
  static const bool installed = [] {
    if (!can_limit_blas_team() || common::switched_off("TERRA_BLAS_GUARD")) return false;
    auto& dispatcher = c10::Dispatcher::singleton();
    // Another library's kernels on this key: leave it alone (the worker keeps torch's team).
    if (dispatcher.hasBackendFallbackForDispatchKey(kGuardKey) ||
        !dispatcher.getAllOpNamesForDispatchKey(kGuardKey).empty())
      return false;
    // Every op without a kernel of ours goes straight on to the next key.
    static torch::Library fallthrough(torch::Library::IMPL, "_", kGuardKey, __FILE__, __LINE__);
    fallthrough.fallback(torch::CppFunction::makeFallthrough());
    static torch::Library lib(torch::Library::IMPL, "aten", kGuardKey, __FILE__, __LINE__);
    const auto& table = products();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.getNamespace() != std::optional<std::string_view>("aten")) continue;
      const std::string base = name.name.substr(6);
      const auto entry = table.find(base);
      if (entry == table.end()) continue;
      auto op = dispatcher.findOp(name);
      if (!op || !op->hasSchema()) continue;
      const auto& args = op->schema().arguments();
      const Factors f = entry->second;
      auto is_tensor = [&](int i) {
        return i < static_cast<int>(args.size()) && args[i].type()->kind() == c10::TypeKind::TensorType;
      };
      if (!is_tensor(f.first) || !is_tensor(f.second)) continue;  // (an overload of another shape)
      const std::string qualified = name.overload_name.empty() ? base : base + "." + name.overload_name;
      lib.impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&guard_kernel>());
    }
    return true;
  }();
  return installed;
}

BlasGuardScope::BlasGuardScope(bool enable) : saved_(c10::impl::tls_local_dispatch_key_set()) {
  active_ = enable && at::get_num_threads() > 1 && install_blas_guard();
  if (!active_) return;
  auto local = saved_;
  local.included_ = local.included_ | c10::DispatchKeySet(kGuardKey);
  c10::impl::_force_tls_local_dispatch_key_set(local);
}

BlasGuardScope::~BlasGuardScope() {
  if (active_) c10::impl::_force_tls_local_dispatch_key_set(saved_);
}

BlasGuardCalls blas_guard_calls_on_this_thread() { return t_calls; }

BlasGuardVerdicts blas_guard_verdicts() {
  Verdicts& v = verdicts();
  std::lock_guard lock(v.mu);
  return v.counts;
}

}  // namespace terra::runtime
