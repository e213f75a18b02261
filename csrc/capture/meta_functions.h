// torch's C++ meta functions of structured ops (at::meta::addmm, ...), boxed, for shape inference.
//
// Why: torch registers meta kernels written in Python (torch/_meta_registrations.py, many of them
// decompositions from torch/_decomp) at the Meta dispatch key over the C++ ones, which stay
// registered but inactive (`torch._C._dispatch_dump("aten::addmm")` lists "Meta (inactive)").
// Called through the dispatcher, a meta tensor's addmm therefore runs Python: the first call of
// a process imports torch._dynamo (1.3-2.4 s on this machine) and every later one costs
// 0.3-1.7 ms, paid by each op of a co-executed iteration whose input metadata the shape cache has
// not seen (the first iteration, and every new batch size or sequence length).
//
// A structured op's C++ meta function is the code its CPU kernel runs to size and lay out its
// output (the CPU kernel then fills it), so calling it directly gives the CPU kernel's sizes,
// strides and dtype by construction, in microseconds. The table lists the common training ops
// (matmuls, pointwise and their backward, softmax, losses, reductions, comparisons, the
// optimizers' in-place ops, indexing, pooling), plus a few that are not structured but whose CPU
// kernels reduce to one that is or to plain C++ (relu is clamp_min; ones_like, zeros_like and
// empty_like are empty_like; zero_ returns its argument; the binary ops' Scalar overloads wrap
// the number and call the Tensor overload; _unsafe_view is view's code). Other ops (convolution, norms,
// embedding, dropout) go through the dispatcher as before. test/python/test_meta_functions.py
// compares every entry's outputs with eager's, on non-contiguous inputs too.
//
// Example: `cpp_meta_function(op)` for aten::addmm returns a kernel; with the op's arguments as
// meta tensors on a stack, `kernel->callBoxed(op, c10::DispatchKeySet(c10::DispatchKey::Meta),
// &stack)` leaves the meta output on the stack, as `op.callBoxed(stack)` would.
#pragma once

#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace terra::capture {

// `op`'s C++ meta function, boxed; nullptr when the table has none for it.
const c10::KernelFunction* cpp_meta_function(const c10::OperatorHandle& op);

// The table's ops, as "aten::add.Tensor" ("aten::addmm." for a default overload), for tests.
std::vector<std::string> cpp_meta_function_names();

}  // namespace terra::capture
