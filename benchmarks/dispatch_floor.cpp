// The cost floor of intercepting aten ops with a boxed dispatcher kernel, the mechanism
// csrc/capture/interceptor.cpp uses: what any per-op recording or placeholder scheme built on
// it pays before it records anything. Built and driven by benchmarks/dispatch_floor.py.
//
// PrivateUse2, not terra's PrivateUse3: the two can be loaded side by side, and nothing else
// here claims PrivateUse2.
#include <Python.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <optional>

namespace {

enum Mode : int {
  kReturnInput = 0,    // drop the arguments, return the first one
  kReturnInputGil,     // ... after taking and giving back the GIL (locations need it)
  kFreshTensor,        // ... a fresh dataless TensorImpl instead (what a placeholder costs)
  kRealKernel,         // redispatch to the real kernel, boxed (what recording costs)
  kRealKernelGil,      // ... after taking and giving back the GIL
};

int g_mode = kReturnInput;
std::optional<c10::impl::LocalDispatchKeySet> g_saved;

constexpr c10::BackendComponent kBit = c10::BackendComponent::PrivateUse2Bit;

void touch_gil() {
  PyGILState_STATE state = PyGILState_Ensure();
  PyGILState_Release(state);
}

void floor_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const size_t nargs = op.schema().arguments().size();
  if (g_mode == kReturnInputGil || g_mode == kRealKernelGil) touch_gil();
  if (g_mode >= kRealKernel) {
    // As terra's run_real: our bit off in TLS while the kernel runs, keys below BackendSelect.
    const c10::impl::LocalDispatchKeySet saved = c10::impl::tls_local_dispatch_key_set();
    c10::impl::LocalDispatchKeySet local = saved;
    local.included_ = local.included_.remove_backend(kBit);
    c10::impl::_force_tls_local_dispatch_key_set(local);
    auto below = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);
    op.redispatchBoxed(below.remove_backend(kBit), stack);
    c10::impl::_force_tls_local_dispatch_key_set(saved);
    return;
  }
  at::Tensor input = (*stack)[stack->size() - nargs].toTensor();
  at::Tensor out = input;
  if (g_mode == kFreshTensor) {
    c10::Storage storage(c10::Storage::use_byte_size_t(), input.nbytes(), c10::DataPtr(nullptr, input.device()),
                         /*allocator=*/nullptr, /*resizable=*/false);
    auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse2),
                                                     input.dtype());
    impl->set_sizes_and_strides(input.sizes(), input.strides(), 0);
    out = at::Tensor(std::move(impl));
  }
  torch::jit::drop(*stack, nargs);
  stack->push_back(std::move(out));
}

}  // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse2, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&floor_kernel>()); }

// Ops with a CompositeExplicitAutograd(NonFunctional) kernel would run it on this backend key
// instead of the fallback (terra's install_interceptor registers direct kernels for the same
// reason): direct kernels for the ops the benchmark chain uses.
TORCH_LIBRARY_IMPL(aten, PrivateUse2, m) {
  m.impl("add.Tensor", torch::CppFunction::makeFromBoxedFunction<&floor_kernel>());
  m.impl("mul.Tensor", torch::CppFunction::makeFromBoxedFunction<&floor_kernel>());
  m.impl("relu", torch::CppFunction::makeFromBoxedFunction<&floor_kernel>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("on", [](int mode) {
    g_mode = mode;
    g_saved = c10::impl::tls_local_dispatch_key_set();
    c10::impl::LocalDispatchKeySet local = *g_saved;
    local.included_ = local.included_ | c10::DispatchKeySet(c10::DispatchKey::PrivateUse2);
    c10::impl::_force_tls_local_dispatch_key_set(local);
  });
  m.def("off", [] { c10::impl::_force_tls_local_dispatch_key_set(*g_saved); });
}
