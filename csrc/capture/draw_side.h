// Which side draws a random op's numbers: Python, where it calls the op, in program order, until
// the graph has drawn from that generator; from then on the graph, also in program order.
//
// A generator's draws must keep program order: the same numbers in the same order as eager. The
// graph draws for the random ops it runs (dropout's bernoulli, `randn_like` noise), later than
// Python issues them and gated behind Python's validation (docs/RUNTIME.md, "Random generator
// state"). If Python also drew from that generator where it calls an op, its draw could come
// before a graph draw that comes first in the program. So once the graph draws from a generator,
// every later draw from it is the graph's (note_graph_draws, at each recorded op). But as long as
// the graph has never drawn from it, nothing the graph owes can be overtaken: Python draws itself,
// for real and unrecorded, and the result is an ordinary tensor, an input from outside for later
// ops, as if torch.tensor() had made it (capture/interceptor.cpp, factory_kernel; and in an
// outside-program block, Region::runs_outside). This covers
//   - the program's own generators: torch.utils.data.RandomSampler makes and seeds a new one every
//     epoch (`generator.manual_seed(seed)`, no aten op) and turns `randperm(n, generator=g)` into
//     a list at once; baked into the graph as a constant, a new object every epoch was a new path
//     every epoch, and a reseed between two draws reached the graph too late;
//   - the device's default generator in a program whose graph draws nothing: nanoGPT's batch
//     function `ix = torch.randint(len(data) - block, (batch,))`, whose indices Python reads at
//     once (`data[i:i + block] for i in ix`). Recorded, every step's first read of `ix` waited for
//     the graph to finish the previous step (benchmarks/idioms_bench.py, get_batch).
// Only factories (no tensor arguments: randperm, randn, rand, randint, normal with float mean and
// std) are drawn on Python's side outside such blocks; ops with tensor arguments (bernoulli,
// multinomial, an in-place normal_) are recorded, and so make the graph draw from then on.
// A generator's side is decided per process and never goes back: the draws of a graph built
// once (or read back from a kept program, warm start) may run at any later time. A default
// generator is identified by its device type.
//
// Example, a model with dropout, trained on nanoGPT-style batches:
//     iteration 0 (traced): ix = torch.randint(...)     Python draws (nothing recorded drew yet)
//                           F.dropout(h, 0.1)           recorded: the CPU default is the graph's
//     iteration 1..:        ix = torch.randint(...)     recorded, drawn by the graph in order
// and without dropout, `randint` stays Python's in every iteration: `ix` is a real tensor.
//
// TERRA_PYTHON_DRAWS=0 leaves every default generator to the graph (the behaviour before session
// 41), to compare the two.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>

namespace terra::capture {

struct OpRecord;

// Whether Python draws the numbers of `op` on `args` itself: `op` is a random op
// (nondeterministic_seeded) and its generator (an explicit one, or the default generator of the
// device it draws on) is one the graph has not drawn from in this process.
bool python_draws(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args);

// `op` on `args` is recorded (the graph will run it): if it draws, its generator is the graph's
// from now on.
void note_graph_draws(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args);

// The same for a record read back from a kept program (warm start), whose arguments are gone:
// its generator is taken to be the default generator of its outputs' device.
void note_graph_draws(const OpRecord& rec);

}  // namespace terra::capture
