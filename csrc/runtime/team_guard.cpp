// The guard's kernel, its verdicts and its calibration (runtime/team_guard.h says why).
#include "runtime/team_guard.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string_view>
#include <utility>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/env.h"
#include "runtime/worker_threads.h"

namespace terra::runtime {

namespace {

constexpr c10::DispatchKey kGuardKey = c10::DispatchKey::FPGA;  // (team_guard.h says why this one)

// torch's OpenMP team on this thread when its TeamGuardScope began (a calibration's run with
// torch's teams sets it explicitly: a call nested in a one-thread call sees a team of one).
thread_local int t_torchs_team = 1;

// The guarded ops (each overload of these names: in-place, out=, out_dtype) and how their work
// is counted. Matrix products (their CPU kernels call MKL's BLAS, which opens a parallel region
// for every call): multiply-adds, the first factor's elements times the second's last size (mm:
// m*k*n, bmm: b*m*k*n, addmv: m*n, dot: n). The others (their CPU kernels open ATen parallel
// regions at small sizes: VML's functions above 2048 elements, the norms per channel or row,
// softmax per row, the fused optimizers per tensor): the elements of their tensor arguments.
struct Guarded {
  int first = -1;  // the factors' argument positions (a matrix product), or -1
  int second = -1;
};
const std::unordered_map<std::string_view, Guarded>& guarded_ops() {
  static const std::unordered_map<std::string_view, Guarded> table = [] {
    std::unordered_map<std::string_view, Guarded> t = {
        {"mm", {0, 1}},      {"bmm", {0, 1}},      {"dot", {0, 1}},    {"vdot", {0, 1}},
        {"addmm", {1, 2}},   {"addmm_", {1, 2}},   {"_addmm_activation", {1, 2}},
        {"baddbmm", {1, 2}}, {"baddbmm_", {1, 2}}, {"addbmm", {1, 2}}, {"addbmm_", {1, 2}},
        {"addmv", {1, 2}},   {"addmv_", {1, 2}},
    };
    static const char* const by_elements[] = {
        // VML (ATen/cpu/vml.h), and their in-place forms
        "sqrt", "sqrt_", "exp", "exp_", "expm1", "expm1_", "log", "log_", "log1p", "log1p_", "log2", "log2_",
        "log10", "log10_", "sin", "sin_", "cos", "cos_", "tan", "tan_", "tanh", "tanh_", "asin", "asin_",
        "acos", "acos_", "atan", "atan_", "sinh", "sinh_", "cosh", "cosh_", "erf", "erf_", "erfc", "erfc_",
        "erfinv", "erfinv_", "lgamma", "lgamma_", "ceil", "ceil_", "floor", "floor_", "round", "round_",
        "trunc", "trunc_",
        // per channel, row or tensor
        "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training", "native_layer_norm", "native_layer_norm_backward",
        "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
        "_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_",
        "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
    };
    for (const char* name : by_elements) t.emplace(name, Guarded{});
    return t;
  }();
  return table;
}

bool floating(c10::ScalarType t) { return c10::isFloatingType(t) || c10::isComplexType(t); }
bool mkl_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kComplexFloat || t == at::kComplexDouble;
}

// ---- layouts ---------------------------------------------------------------------------------

// A call's layout as integers: the op and torch's team, then per argument a tag and its values. Tensors give
// dtype, sizes, strides and their data pointer's offset within 64 bytes (the CPU allocator's
// alignment; a kernel's vector path may depend on alignment, never on where the storage starts).
// Also the call's work (Call::work) and whether every tensor is a CPU one of a floating dtype.
using Layout = std::vector<int64_t>;
enum Tag : int64_t {
  kUndefined = -1, kTensor = -2, kDouble = -3, kInt = -4, kBool = -5, kComplex = -6, kNone = -7,
  kTensorList = -8, kIntList = -9, kDoubleList = -10,
};

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

class LayoutWriter {
 public:
  explicit LayoutWriter(Layout* out) : out_(out) {}
  int64_t elements = 0;  // of every tensor argument

  // False for a tensor the guard leaves alone: not a dense CPU one.
  bool tensor(const at::Tensor& t) {
    if (!t.defined()) {
      out_->push_back(kUndefined);
      return true;
    }
    if (!t.device().is_cpu() || t.layout() != at::kStrided) return false;
    out_->push_back(kTensor);
    out_->push_back(static_cast<int64_t>(t.scalar_type()));
    out_->push_back(t.dim());
    for (int64_t s : t.sizes()) out_->push_back(s);
    for (int64_t s : t.strides()) out_->push_back(s);
    out_->push_back(alignment_of(t));
    elements += t.numel();
    return true;
  }

  bool value(const c10::IValue& v) {
    if (v.isTensor()) return tensor(v.toTensor());
    if (v.isTensorList()) {
      const auto list = v.toTensorList();
      out_->push_back(kTensorList);
      out_->push_back(static_cast<int64_t>(list.size()));
      for (const at::Tensor& t : list)
        if (!tensor(t)) return false;
    } else if (v.isDouble()) {
      push(kDouble, bits_of(v.toDouble()));
    } else if (v.isInt()) {
      push(kInt, v.toInt());
    } else if (v.isBool()) {
      push(kBool, v.toBool());
    } else if (v.isComplexDouble()) {
      const c10::complex<double> c = v.toComplexDouble();
      push(kComplex, bits_of(c.real()));
      out_->push_back(bits_of(c.imag()));
    } else if (v.isNone()) {
      out_->push_back(kNone);
    } else if (v.isIntList()) {
      const auto list = v.toIntList();
      push(kIntList, static_cast<int64_t>(list.size()));
      for (int64_t x : list) out_->push_back(x);
    } else if (v.isDoubleList()) {
      const auto list = v.toDoubleList();
      push(kDoubleList, static_cast<int64_t>(list.size()));
      for (double x : list) out_->push_back(bits_of(x));
    } else {
      return false;
    }
    return true;
  }

 private:
  void push(int64_t tag, int64_t value) {
    out_->push_back(tag);
    out_->push_back(value);
  }
  Layout* out_;
};

// Writes the layout of the arguments on `stack` and returns the call's work (multiply-adds or
// elements, see Guarded); -1 where the call is not for the guard (a tensor that is not a dense
// CPU one, an argument we cannot key).
int64_t layout_of(const c10::OperatorHandle& op, Guarded g, const torch::jit::Stack& stack, size_t first,
                  Layout* out) {
  out->clear();
  out->push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&op.schema())));
  out->push_back(t_torchs_team);  // (a verdict compares one thread with this team, no other)
  LayoutWriter writer(out);
  for (size_t i = first; i < stack.size(); ++i)
    if (!writer.value(stack[i])) return -1;
  if (g.first < 0) return writer.elements;
  const at::Tensor& a = stack[first + g.first].toTensor();
  const at::Tensor& b = stack[first + g.second].toTensor();
  if (!a.defined() || !b.defined() || !mkl_dtype(a.scalar_type())) return -1;  // (not MKL's)
  return a.numel() * (b.dim() >= 2 ? b.size(-1) : 1);
}

// "aten::addmm [32, 64] [64, 64] ... Float" for the reason a layout keeps torch's teams: the
// sizes of the tensor arguments and the first one's dtype.
std::string describe(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first) {
  std::ostringstream s;
  s << op.schema().operator_name();
  std::optional<c10::ScalarType> dtype;
  for (size_t i = first; i < stack.size(); ++i) {
    if (!stack[i].isTensor() || !stack[i].toTensor().defined()) continue;
    const at::Tensor& t = stack[i].toTensor();
    s << " " << t.sizes();
    if (!dtype) dtype = t.scalar_type();
  }
  if (dtype) s << " " << *dtype;
  return s.str();
}

// ---- verdicts --------------------------------------------------------------------------------

enum class Verdict { kUnknown, kSame, kDiffer, kLarge };

struct Verdicts {
  std::mutex mu;
  std::unordered_map<Layout, Verdict, LayoutHash> by_layout;
  TeamGuardVerdicts counts;
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
// in [0, 1) (the real and imaginary parts, for complex; zeros for other dtypes), and its base
// storage as a 1-d tensor.
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
  const int64_t n = std::max<int64_t>(extent, 1);
  // (Integer and bool tensors are indices, targets or masks: zeros are valid ones.)
  at::Tensor base = floating(t.scalar_type()) ? at::rand({n}, gen, t.options()) : at::zeros({n}, t.options());
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

// `v` with each defined tensor in it (a tensor, or the tensors of a list) replaced by f(tensor);
// any other value as it is.
template <typename F>
c10::IValue map_tensors(const c10::IValue& v, F&& f) {
  auto one = [&](const at::Tensor& t) { return t.defined() ? f(t) : t; };
  if (v.isTensor()) return one(v.toTensor());
  if (v.isTensorList()) {
    std::vector<at::Tensor> list;
    for (const at::Tensor& t : v.toTensorList()) list.push_back(one(t));
    return list;
  }
  return v;
}

bool same_values(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() && b.isTensor()) return same_bits(a.toTensor(), b.toTensor());
  if (a.isTensorList() && b.isTensorList()) {
    const auto x = a.toTensorList(), y = b.toTensorList();
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i)
      if (!same_bits(x[i], y[i])) return false;
    return true;
  }
  return a.isTensor() == b.isTensor() && a.isTensorList() == b.isTensorList();  // (None, scalars: not results we compare)
}

// Runs the call on random inputs of its layout with torch's teams and with one thread (the real
// arguments are not touched); true where every result and every argument afterwards (the
// in-place and out= forms write into theirs) holds the same bits.
bool calibrate(const c10::OperatorHandle& op, c10::DispatchKeySet below, const torch::jit::Stack& stack,
               size_t first, std::string* why) {
  try {
    // A generator of our own: the program's random stream is not advanced.
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(/*seed_in=*/20261203);
    torch::jit::Stack team, one;
    std::vector<at::Tensor> bases, copies;
    // Random copies of the arguments (their bases kept to compare afterwards), then the same
    // values on a clone of each base, in the same order.
    for (size_t i = first; i < stack.size(); ++i)
      team.push_back(map_tensors(stack[i], [&](const at::Tensor& t) {
        auto [base, view] = random_like(t, gen);
        bases.push_back(std::move(base));
        return view;
      }));
    for (const at::Tensor& base : bases) copies.push_back(base.clone());
    size_t next = 0;
    for (const c10::IValue& v : team)
      one.push_back(map_tensors(v, [&](const at::Tensor& t) {
        return copies.at(next++).as_strided(t.sizes(), t.strides(), t.storage_offset());
      }));
    {
      const TeamSizeGuard torchs(t_torchs_team, 0);  // (MKL's 0: the process's setting, as eager runs)
      op.redispatchBoxed(below, &team);
    }
    {
      const TeamSizeGuard one_thread(1, 1);
      op.redispatchBoxed(below, &one);
    }
    bool same = team.size() == one.size();
    for (size_t i = 0; same && i < team.size(); ++i) same = same_values(team[i], one[i]);
    for (size_t i = 0; same && i < bases.size(); ++i) same = same_bits(bases[i], copies[i]);
    if (!same) *why = "other bits with one thread than with torch's teams";
    return same;
  } catch (const std::exception& e) {
    *why = std::string("raised on random inputs: ") + std::string(e.what()).substr(0, 200);
    return false;
  }
}

// ---- the kernel ------------------------------------------------------------------------------

thread_local TeamGuardCalls t_calls;

// Keys below ours: the backend kernel of the call.
c10::DispatchKeySet below_guard(c10::DispatchKeySet ks) {
  return ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kGuardKey);
}

// One kernel per way of counting work (the factors' positions, or -1: elements), so that a call
// needs no lookup of its op in guarded_ops().
template <int First, int Second>
void guard_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  constexpr Guarded g{First, Second};
  const c10::DispatchKeySet below = below_guard(ks);
  const size_t first = stack->size() - op.schema().arguments().size();
  thread_local Layout layout;  // (reused: no allocation per call)
  const int64_t work = layout_of(op, g, *stack, first, &layout);
  if (work < 0) {
    op.redispatchBoxed(below, stack);  // not a call we key: as it comes
    return;
  }
  Verdict verdict = lookup(layout);
  if (verdict == Verdict::kUnknown) {
    const Layout key = layout;  // (a calibration's nested calls reuse `layout`)
    std::string why;
    const auto t0 = std::chrono::steady_clock::now();
    if (work > (g.first >= 0 ? kMaxOneThreadMacs : kMaxOneThreadElements)) {
      verdict = Verdict::kLarge;
    } else {
      verdict = calibrate(op, below, *stack, first, &why) ? Verdict::kSame : Verdict::kDiffer;
    }
    const int64_t ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    store(key, verdict, verdict == Verdict::kDiffer ? describe(op, *stack, first) + ": " + why : "", ns);
  }
  if (verdict == Verdict::kSame) {
    ++t_calls.one_thread;
    const TeamSizeGuard one_thread(1, 1);
    op.redispatchBoxed(below, stack);
  } else {
    ++t_calls.team;  // (the thread's teams as they are: torch's, or one inside a one-thread call)
    op.redispatchBoxed(below, stack);
  }
}

// An op that is not guarded but would run its composite kernel here (install_team_guard).
void go_on_below(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  op.redispatchBoxed(below_guard(ks), stack);
}

// The guard_kernel instance for an entry of guarded_ops() (whose factors are at 0, 1 or 1, 2).
torch::CppFunction kernel_for(Guarded g) {
  if (g.first < 0) return torch::CppFunction::makeFromBoxedFunction<&guard_kernel<-1, -1>>();
  TORCH_INTERNAL_ASSERT((g.first == 0 && g.second == 1) || (g.first == 1 && g.second == 2));
  return g.first == 0 ? torch::CppFunction::makeFromBoxedFunction<&guard_kernel<0, 1>>()
                      : torch::CppFunction::makeFromBoxedFunction<&guard_kernel<1, 2>>();
}

}  // namespace

bool install_team_guard() {
  static const bool installed = [] {
    if (!can_limit_blas_team() || common::switched_off("TERRA_TEAM_GUARD")) return false;
    auto& dispatcher = c10::Dispatcher::singleton();
    // Another library's kernels on this key: leave it alone (the worker keeps torch's team).
    if (dispatcher.hasBackendFallbackForDispatchKey(kGuardKey) ||
        !dispatcher.getAllOpNamesForDispatchKey(kGuardKey).empty())
      return false;
    // Every op without a kernel of ours goes straight on to the next key.
    static torch::Library fallthrough(torch::Library::IMPL, "_", kGuardKey, __FILE__, __LINE__);
    fallthrough.fallback(torch::CppFunction::makeFallthrough());
    static torch::Library lib(torch::Library::IMPL, "aten", kGuardKey, __FILE__, __LINE__);
    const auto& table = guarded_ops();
    std::unordered_set<c10::OperatorName> guarded;
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.getNamespace() != std::optional<std::string_view>("aten")) continue;
      const std::string base = name.name.substr(6);
      const auto entry = table.find(base);
      if (entry == table.end()) continue;
      auto op = dispatcher.findOp(name);
      if (!op || !op->hasSchema()) continue;
      const auto& args = op->schema().arguments();
      const Guarded g = entry->second;
      auto is_tensor = [&](int i) {
        return i < static_cast<int>(args.size()) && args[i].type()->kind() == c10::TypeKind::TensorType;
      };
      if (g.first >= 0 && (!is_tensor(g.first) || !is_tensor(g.second))) continue;  // (another shape)
      const std::string qualified = name.overload_name.empty() ? base : base + "." + name.overload_name;
      lib.impl(qualified.c_str(), kernel_for(g));
      guarded.insert(name);
    }
    // FPGA is among the keys a CompositeExplicitAutograd(NonFunctional) kernel is registered
    // for (c10's autogradother_backends), and an op's own kernel there beats the fallthrough
    // above: every op with such a kernel and a CPU one (add, mul, sum, log_softmax, mse_loss:
    // the structured ops) ran the composite one on the worker, the default-backend wrapper of
    // the structured op (meta, then an out= call, twice the dispatch; F.mse_loss's warned "An
    // output with one or more elements was resized" every iteration), other code than eager's.
    // A kernel of ours, which goes on below this key, wins over the alias (a per-op fallthrough
    // is not supported: c10 asserts). Ops whose only kernel is the composite one keep it: it is
    // what the CPU key runs too.
    static std::unordered_map<std::string, std::unique_ptr<torch::Library>> libraries;
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (guarded.count(name)) continue;
      auto op = dispatcher.findOp(name);
      if (!op || !op->hasSchema()) continue;
      if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
          !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
        continue;
      if (!op->hasKernelForDispatchKey(c10::DispatchKey::CPU) && !op->hasKernelForDispatchKey(c10::DispatchKey::CUDA))
        continue;
      const auto ns = name.getNamespace();
      if (!ns) continue;
      const std::string ns_str(*ns);
      auto& ns_lib = libraries[ns_str];
      if (!ns_lib) ns_lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns_str, kGuardKey, __FILE__, __LINE__);
      std::string unqualified = name.name.substr(ns_str.size() + 2);
      if (!name.overload_name.empty()) unqualified += "." + name.overload_name;
      ns_lib->impl(unqualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&go_on_below>());
    }
    return true;
  }();
  return installed;
}

TeamGuardScope::TeamGuardScope(bool enable) : saved_(c10::impl::tls_local_dispatch_key_set()) {
  const int team = at::get_num_threads();
  active_ = enable && team > 1 && install_team_guard();
  if (!active_) return;
  previous_team_ = std::exchange(t_torchs_team, team);
  auto local = saved_;
  local.included_ = local.included_ | c10::DispatchKeySet(kGuardKey);
  c10::impl::_force_tls_local_dispatch_key_set(local);
}

TeamGuardScope::~TeamGuardScope() {
  if (!active_) return;
  c10::impl::_force_tls_local_dispatch_key_set(saved_);
  t_torchs_team = previous_team_;
}

TeamGuardCalls team_guard_calls_on_this_thread() { return t_calls; }

TeamGuardVerdicts team_guard_verdicts() {
  Verdicts& v = verdicts();
  std::lock_guard lock(v.mu);
  return v.counts;
}

}  // namespace terra::runtime
