// The dispatcher hook: a boxed fallback on terra's key (see terra_key.h) plus direct kernels for
// ops whose CompositeExplicitAutograd kernel would otherwise decompose them before we see them.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace terra::capture {

// Registers the direct kernels; the fallback itself is registered when the library loads.
// Idempotent. Returns the number of operators that got a direct kernel.
size_t install_interceptor();

// Whether a schema type is, or holds, a Tensor (Tensor, Tensor?, Tensor[], Tensor?[], ...).
bool type_contains_tensor(const c10::TypePtr& type);

class Region;

// The open region if this op is to be intercepted on this thread (not while a real kernel the
// region runs issues its own ops, nor outside every TorchDispatchMode); else nullptr.
Region* intercepting_region();

// What terra's key does with an op: the open region handles it, or it runs for real. For direct
// kernels on the key that handle some calls themselves and pass the rest on.
void intercept(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

// Runs the real kernel of `op` below terra's key, with interception suspended.
void run_real(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

}  // namespace terra::capture
