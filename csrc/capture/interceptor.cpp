#include "capture/interceptor.h"

#include <torch/library.h>

#include <memory>
#include <mutex>
#include <unordered_map>

#include "capture/draw_side.h"
#include "capture/host_filled_tensors.h"
#include "capture/placeholder.h"
#include "capture/region.h"
#include "capture/terra_key.h"

namespace terra::capture {

// The open region, unless this op must go through untouched. Code that steps outside every
// TorchDispatchMode (torch.tensor() filling its buffer, a mode's own handler) excludes the Python
// key; we step aside for it too, so that we see exactly the ops a TorchDispatchMode would.
// Ops a kernel issues while the region runs it for real (or while the region does its own work)
// are the kernel's business, not the program's: they run untouched (Region::handling_on_this_thread).
Region* intercepting_region() {
  Region* region = active_region();
  if (region == nullptr || c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Python) ||
      Region::handling_on_this_thread())
    return nullptr;
  return region;
}

void intercept(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (Region* region = intercepting_region()) {
    region->handle(op, ks, stack);
    return;
  }
  const size_t nargs = op.schema().arguments().size();
  TORCH_CHECK(!has_unbacked_placeholder(c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - nargs, nargs)),
              "terra_torch: ",
              c10::toString(op.operator_name()),
              " received a placeholder tensor outside the capture region that produced it");
  run_real(op, ks, stack);
}

namespace {

void terra_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  intercept(op, ks, stack);
}

// What torch's generated BackendSelect kernel does for a factory: the backend follows from the
// dtype/layout/device arguments. (Our BackendSelect kernel replaces torch's for these ops.)
c10::DispatchKeySet factory_keyset(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& arguments = op.schema().arguments();
  auto args = stack.end() - arguments.size();
  std::optional<c10::ScalarType> dtype;
  std::optional<c10::Layout> layout;
  std::optional<c10::Device> device;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& v = args[i];
    if (v.isNone()) continue;
    const std::string& name = arguments[i].name();
    if (name == "dtype") dtype = v.toScalarType();
    else if (name == "layout") layout = v.toLayout();
    else if (name == "device") device = v.toDevice();
  }
  return c10::DispatchKeySet(c10::computeDispatchKey(dtype, layout, device));
}

// BackendSelect kernels of factories with no tensor argument redispatch with a key set built
// from the device argument alone, dropping TLS includes: without this kernel, torch.zeros() and
// torch.randn() would escape every capture region.
void factory_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  // Unlike terra_kernel, reaching this kernel does not mean our key is on: check the TLS (it is
  // off inside real kernels, under SuspendGuard).
  // Nor inside a composite kernel that fills a fresh tensor through its data pointer
  // (capture/host_filled_tensors.h).
  bool on = c10::impl::tls_local_dispatch_key_set().included_.has_backend(kTerraBackendBit) &&
            !host_factories_on_this_thread();
  if (Region* region = on ? intercepting_region() : nullptr) {
    // Python draws from a generator the graph never drew from itself: for real, unrecorded
    // (capture/draw_side.h).
    const size_t nargs = op.schema().arguments().size();
    if (region->mode() != Mode::Placeholder &&
        python_draws(op, c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - nargs, nargs))) {
      run_real(op, ks, stack);
      return;
    }
    region->handle(op, ks, stack);
    return;
  }
  op.redispatchBoxed(factory_keyset(op, *stack), stack);
}

bool has_tensor_argument(const c10::FunctionSchema& schema) {
  for (const auto& arg : schema.arguments())
    if (type_contains_tensor(arg.type())) return true;
  return false;
}

}  // namespace

bool type_contains_tensor(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType) return true;
  for (const c10::TypePtr& inner : type->containedTypes())
    if (type_contains_tensor(inner)) return true;
  return false;
}

void run_real(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  SuspendGuard suspend;
  // Keep the keys below BackendSelect (Dense and friends) and the real backend bits.
  auto below = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);
  below = below.remove_backend(kTerraBackendBit);
  auto backend_bits = below & c10::DispatchKeySet(c10::DispatchKeySet::RAW, c10::full_backend_mask);
  op.redispatchBoxed(backend_bits.empty() ? factory_keyset(op, *stack) : below, stack);
}

namespace {

// Silences "Overriding a previously registered kernel" for the BackendSelect kernels we replace
// on purpose; any other warning still reaches the previous handler.
class QuietOverrideHandler : public c10::WarningHandler {
 public:
  explicit QuietOverrideHandler(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") == std::string::npos)
      next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

// Ops on sparse and quantized tensors inside a region, and factories of them: as for nested
// tensors, our backend bit makes the dispatcher pick their PrivateUse3 keys, which have no
// kernels of torch's. The first one ends the region's capture (Region::stop_at_unsupported_layout:
// the program then runs eagerly, with the reason); it and every op after it run as the device's
// own kernels. nn.Embedding(sparse=True) under terra_torch.function raised NotImplementedError in
// its first backward (`_sparse_coo_tensor_with_dims_and_tensors` on SparsePrivateUse3): wrap()
// asks its modules beforehand, a step function has none to ask.
template <const char* kLayout>
void unsupported_layout_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (Region* region = intercepting_region()) region->stop_at_unsupported_layout(op, kLayout);
  SuspendGuard suspend;
  op.redispatchBoxed(ks.remove_backend(kTerraBackendBit), stack);
}
constexpr char kSparse[] = "sparse";
constexpr char kSparseCsr[] = "sparse compressed";
constexpr char kQuantized[] = "quantized";

torch::Library& backend_select_library() {
  static torch::Library lib(torch::Library::IMPL, "aten", c10::DispatchKey::BackendSelect, __FILE__, __LINE__);
  return lib;
}

}  // namespace

size_t install_interceptor() {
  // Ops with a CompositeExplicitAutograd kernel (zeros, full, t, detach, ...) would run that
  // kernel on our backend key and we would only see its pieces; a TorchDispatchMode sees the op
  // itself. A direct kernel on our key wins over the composite one (dispatch table precedence).
  static std::once_flag once;
  static size_t count = 0;
  static std::unordered_map<std::string, std::unique_ptr<torch::Library>> libraries;
  std::call_once(once, [] {
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      auto op = dispatcher.findOp(name);
      if (!op || !op->hasSchema()) continue;
      bool composite = op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
                       op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
      if (!composite) continue;
      auto ns = name.getNamespace();
      if (!ns) continue;
      std::string ns_str(*ns);
      std::string unqualified = name.name.substr(ns_str.size() + 2);
      if (!name.overload_name.empty()) unqualified += "." + name.overload_name;
      // The same precedence keeps the composite kernel from the sparse and quantized keys, whose
      // fallbacks (unsupported_layout_kernel) would otherwise never run for such ops: AccumulateGrad's
      // clone of a sparse gradient ran the dense composite clone and raised "Cannot access storage
      // of SparseTensorImpl".
      const std::pair<c10::DispatchKey, torch::CppFunction (*)()> keys[] = {
          {kTerraKey, [] { return torch::CppFunction::makeFromBoxedFunction<&terra_kernel>(); }},
          {c10::DispatchKey::SparsePrivateUse3,
           [] { return torch::CppFunction::makeFromBoxedFunction<&unsupported_layout_kernel<kSparse>>(); }},
          {c10::DispatchKey::SparseCsrPrivateUse3,
           [] { return torch::CppFunction::makeFromBoxedFunction<&unsupported_layout_kernel<kSparseCsr>>(); }},
          {c10::DispatchKey::QuantizedPrivateUse3,
           [] { return torch::CppFunction::makeFromBoxedFunction<&unsupported_layout_kernel<kQuantized>>(); }},
      };
      for (const auto& [key, kernel] : keys) {
        if (op->hasKernelForDispatchKey(key)) continue;
        auto& lib = libraries[ns_str + "/" + c10::toString(key)];
        if (!lib) lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns_str, key, __FILE__, __LINE__);
        lib->impl(unqualified.c_str(), kernel());
        if (key == kTerraKey) ++count;
      }
    }
    // Factories: take over their BackendSelect kernels (see factory_kernel).
    QuietOverrideHandler quiet(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    for (const c10::OperatorName& name : dispatcher.getAllOpNamesForDispatchKey(c10::DispatchKey::BackendSelect)) {
      auto op = dispatcher.findOp(name);
      if (!op || !op->hasSchema() || has_tensor_argument(op->schema())) continue;
      if (name.getNamespace() != std::optional<std::string_view>("aten")) continue;
      auto& lib = backend_select_library();
      std::string unqualified = name.name.substr(6);
      if (!name.overload_name.empty()) unqualified += "." + name.overload_name;
      lib.impl(unqualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&factory_kernel>());
      ++count;
    }
  });
  return count;
}

}  // namespace terra::capture

TORCH_LIBRARY_IMPL(_, PrivateUse3, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&terra::capture::terra_kernel>());
}

namespace {

// Ops on nested tensors inside a region: our backend bit in the TLS include set makes the
// dispatcher pick NestedTensorPrivateUse3, which has no kernels. They run as the device's
// nested kernels, untouched (a region that meets a nested tensor records nothing more,
// Region::unsupported).
void nested_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  terra::capture::SuspendGuard suspend;
  op.redispatchBoxed(ks.remove_backend(terra::capture::kTerraBackendBit), stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(_, NestedTensorPrivateUse3, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&nested_kernel>());
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse3, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&terra::capture::unsupported_layout_kernel<terra::capture::kSparse>>());
}
TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse3, m) {
  m.fallback(
      torch::CppFunction::makeFromBoxedFunction<&terra::capture::unsupported_layout_kernel<terra::capture::kSparseCsr>>());
}
TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse3, m) {
  m.fallback(
      torch::CppFunction::makeFromBoxedFunction<&terra::capture::unsupported_layout_kernel<terra::capture::kQuantized>>());
}
