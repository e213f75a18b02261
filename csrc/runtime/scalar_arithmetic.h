// One-element arithmetic without the dispatcher: how KnownValues::follow and ::resolve run the in-place
// add/sub/mul that advance an optimizer's step counter (`step_t += 1` in every single-tensor
// torch.optim step) on its copy of the counter, and the functional add/sub/mul of running
// averages (`avg = 0.9 * avg + 0.1 * loss` once the loss was read).
//
// Through the dispatcher that one-element op cost ~3 us on the Python thread, 5% of a co-executed
// Adam MLP step (perf, benchmarks.coexec_profile), and 84% of that was TensorIterator's setup
// (structured_add_Tensor::meta), not the dispatch: a cheaper way into ATen's kernel would not
// have helped, so the three ops that make step counters are done here instead. Here it is a
// load, one IEEE operation and a store (callgrind, benchmarks.callgrind_step: KnownValues::follow
// 82k -> 9k instructions per step).
//
// Bit for bit ATen's: the result is computed in the tensor's own dtype (float, double or int64)
// from the other operand converted to that dtype, as TensorIterator's type promotion does for a
// Python number or a same-dtype tensor. With alpha == 1 ATen's `a + alpha * b` (fused or not) is
// the single rounding of a + b, and a - b is a + (-1) * b. Integers wrap as the kernel's do.
// Anything else (another alpha, dtype, device, layout or shape, a broadcast, a conjugate or
// negative bit) is not taken: the caller runs the op as before. The functional ops return a new
// contiguous tensor of self's sizes and dtype, as TensorIterator does when neither operand
// broadcasts nor promotes (the same conditions); their result was 2.5% of the Python thread on
// the branches benchmark program through the dispatcher.
//
// Comparisons (eq, ne, lt, le, gt, ge; functional only) are taken on the same conditions and give
// a new bool tensor of self's sizes: the `loss < avg` and `x.mean() > 0` of a program's branches,
// which KnownValues::resolve runs on the Python side when the program reads them (through the
// dispatcher that one comparison cost more than the rest of the read: 5.5% of the Python thread
// on the trip_count benchmark program, perf).
//
//   stack: [self copy, other, (alpha)]  ->  [self copy]      (in place: self's bytes updated)
//   stack: [self copy, other, (alpha)]  ->  [new tensor]     (functional)
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>

namespace terra::runtime {

// Runs op on `stack` (arguments in, the returned self out) when it is one of the ops above on
// operands it takes; false, the stack untouched, where it is not.
bool run_scalar_arithmetic(const c10::OperatorHandle& op, torch::jit::Stack& stack);

// A one-element CPU tensor's value (double, float or int64), read from its memory without the
// dispatcher; nullopt for anything else (item() would answer it through the dispatcher).
std::optional<c10::Scalar> one_element_value(const at::Tensor& t);

}  // namespace terra::runtime
