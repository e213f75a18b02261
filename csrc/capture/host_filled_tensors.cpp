#include "capture/host_filled_tensors.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <initializer_list>

#include "capture/region.h"
#include "capture/terra_key.h"
#include "capture/interceptor.h"
#include "capture/placeholder.h"
#include "common/scoped_flag.h"

namespace terra::capture {

namespace {

thread_local bool t_host_factories = false;

struct HostFactories : common::ScopedFlag {
  HostFactories() : common::ScopedFlag(t_host_factories) {}
};

// Gives the tensor arguments at `positions` their values (the kernel reads them on the host),
// then runs the op's composite kernel with host factories on.
void run_composite(std::initializer_list<size_t> positions, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                   torch::jit::Stack* stack) {
  const size_t nargs = op.schema().arguments().size();
  if (Region* region = intercepting_region()) {
    c10::SmallVector<c10::IValue, 4> read;
    for (const size_t i : positions) read.push_back((*stack)[stack->size() - nargs + i]);
    region->materialize(read);
  }
  HostFactories host;
  // The composite kernel sits in every Autograd slot (CompositeImplicitAutograd); ours shadows
  // it in AutogradPrivateUse3 only. AutogradCPU's slot holds the same function for any device.
  const c10::DispatchKeySet composite =
      ks.remove_backend(kTerraBackendBit) | c10::DispatchKeySet(c10::DispatchKey::AutogradCPU);
  op.redispatchBoxed(composite, stack);
}

// Each use named: which arguments its composite kernel reads on the host.
void ctc_loss_lists(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  run_composite({}, op, ks, stack);  // (the lengths are Python ints already)
}
void ctc_loss_tensors(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  run_composite({2, 3}, op, ks, stack);  // input_lengths, target_lengths
}
// `p.data = new` (torch's set_data, VariableHooks::set_data) asks this op whether `p` may take
// `new`'s storage and metadata. A placeholder has no storage to take yet: it gets its value, and
// once it has one it is an ordinary tensor of its device (PlaceholderImpl::adopt), as `new` would
// be in eager. Old-style SGD, `p.data = p.data - lr * p.grad.data`, raised "incompatible tensor
// type" in co-execution.
void has_compatible_shallow_copy_type(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                                      torch::jit::Stack* stack) {
  const size_t nargs = op.schema().arguments().size();
  if (Region* region = intercepting_region()) {
    const c10::SmallVector<c10::IValue, 2> both(stack->end() - nargs, stack->end());
    region->materialize(both);
    region->note_data_replaced(both[0].toTensor(), both[1].toTensor());
  }
  for (size_t i = stack->size() - nargs; i < stack->size(); ++i) adopt_if_backed((*stack)[i].toTensor());
  run_composite({}, op, ks, stack);
}
void pad_packed_sequence(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  run_composite({1}, op, ks, stack);  // batch_sizes
}

}  // namespace

bool host_factories_on_this_thread() { return t_host_factories; }

}  // namespace terra::capture

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse3, m) {
  m.impl("ctc_loss.IntList", torch::CppFunction::makeFromBoxedFunction<&terra::capture::ctc_loss_lists>());
  m.impl("ctc_loss.Tensor", torch::CppFunction::makeFromBoxedFunction<&terra::capture::ctc_loss_tensors>());
  m.impl("_pad_packed_sequence", torch::CppFunction::makeFromBoxedFunction<&terra::capture::pad_packed_sequence>());
  m.impl("_has_compatible_shallow_copy_type",
         torch::CppFunction::makeFromBoxedFunction<&terra::capture::has_compatible_shallow_copy_type>());
}
