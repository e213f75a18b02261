// Ops a training loop issues that are not its program: a DataLoader assembling the next batch.
//
// Under terra_torch.wrap the region spans the loop's body, so `next(loader_iter)` runs inside it:
// a map-style dataset indexes its tensors once per sample (`TensorDataset.__getitem__` is a
// `select` per tensor) and the collate function stacks them, 66 ops for a batch of 32 pairs.
// Recorded, each of them took the per-op path, every index was a fed Python int that changed
// every step, and the graph ran the batch's assembly one op at a time, woken by each post: an MLP
// trained from a shuffled DataLoader co-executed at 0.54x eager (docs/BENCHMARKS.md, session 40:
// 1.55x with this). None of it is the program's:
// the dataset's tensors are data the program never writes, and eager runs the same kernels on
// the same values wherever they run.
//
// So the stand-ins of DataLoader.__iter__ and of its iterators' __next__ (terra_torch/
// _data_loading.py) open an OutsideProgram block on the calling thread, and inside it
// Region::handle runs an op for real where Python issues it, unrecorded, when nothing the graph
// owes can reach it (Region::runs_outside): its tensors are real (no placeholder, no value this
// iteration produced) and none shares storage with a tensor the program's ops have written (a
// parameter, an optimizer's state, a dataset tensor the loop updates in place), it writes only
// tensors made inside the block, and it draws no random numbers the graph draws too (the default
// generator: those are recorded, in program order). Every other op is recorded as before; its
// result is then a value of the program, and the block's later ops on it are recorded too. The
// batch a block returns is an ordinary tensor the model reads as an input from outside.
//
// Example, `for x, y in loader:` over a TensorDataset with shuffle=True:
//     iter(loader)             epoch start: the sampler's seed (`random_` on the default
//                              generator) recorded, its read waits for the graph
//     next(it): x[i], y[i]...  32 x 2 selects and 2 stacks: real, unrecorded, no wait
//     model(x)                 the program's first op reads x as an input from outside
#pragma once

#include <c10/core/Storage.h>

namespace terra::capture {

// Marks the calling thread as running code outside the program while it lives (nests).
class OutsideProgram {
 public:
  OutsideProgram();
  ~OutsideProgram();
  OutsideProgram(const OutsideProgram&) = delete;
  OutsideProgram& operator=(const OutsideProgram&) = delete;
};

// Asked by Region::handle for every op: an inline read of the thread's depth.
namespace detail {
extern thread_local int outside_program_depth;
}
inline bool outside_program_on_this_thread() { return detail::outside_program_depth > 0; }

// Storage an op run outside the program made (its results): the block's later in-place writes
// into it stay outside (a dataset normalising the sample it just cloned). Forgotten when the
// outermost block ends.
void note_made_outside(const c10::StorageImpl* storage);
bool made_outside(const c10::StorageImpl* storage);

// Storage of every input from outside that a recorded op of a program wrote (parameters,
// optimizer state, a dataset tensor the loop updates in place), process-wide and over all
// iterations: the graph may still owe such a write when the loader reads that memory in a later
// iteration, so those reads stay the program's. Not per Region: a program's iterations run in
// several regions (tracing, co-execution, a new one while Python still holds the last).
// Pinned weakly (an address is not reused while listed); pruned of dead entries as it grows.
void note_program_write(const c10::Storage& storage);
bool program_wrote(const c10::StorageImpl* storage);

}  // namespace terra::capture
