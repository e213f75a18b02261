// Which side draws from a torch.Generator the program passes explicitly: Python, in program
// order, unless the graph has drawn from that generator before.
//
// The graph draws from the device's default generator, gated behind Python's validation
// (docs/RUNTIME.md, "Random generator state"). An explicit generator is the program's own object,
// and programs handle it from Python: torch.utils.data.RandomSampler makes a new one every epoch
// and seeds it (`generator.manual_seed(seed)`, no aten op), data synthesis reseeds one per step,
// and the numbers usually go straight back to Python (`randperm(n, generator=g).tolist()`).
// Baked into the graph as a constant, a new object every epoch was a new path every epoch (one
// eager iteration per epoch of every DataLoader(shuffle=True) loop), and a reseed between two
// draws reached the graph too late.
//
// So a factory (an op without tensor arguments: randperm, randn, rand, randint, normal with
// float mean and std) that draws from such a generator runs for real where Python calls it,
// unrecorded: its result is an ordinary tensor that later ops read as an input from outside, as
// if torch.tensor() had made it (capture/interceptor.cpp, factory_kernel). Ops with tensor
// arguments (bernoulli, multinomial, an in-place normal_) are recorded as before and the graph
// draws for them; once it has drawn from a generator, every later draw from it goes to the
// graph too (note_graph_draws), so that the draws keep program order on one side.
//
// Example, one epoch of a DataLoader(shuffle=True) loop:
//     seed = int(torch.empty((), dtype=torch.int64).random_().item())  recorded: the default
//                                                                       generator, the graph's
//     generator.manual_seed(seed); torch.randperm(n, generator=generator).tolist()
//                                                                       real, unrecorded: no wait
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>

namespace terra::capture {

// Whether `args` (an op's arguments) hold a generator Python draws from itself: not a device's
// default generator, and not one the graph has drawn from in this process.
bool python_draws(c10::ArrayRef<c10::IValue> args);

// A recorded op takes `arg`: if it is an explicit generator, the graph draws from it from now on.
void note_graph_draws(const c10::IValue& arg);

}  // namespace terra::capture
