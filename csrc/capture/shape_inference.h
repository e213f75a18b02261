// Output metadata of an op without running it: the op is called once on meta tensors and the
// answer cached under (operator, input metadata, non-tensor arguments), so that an op seen
// before costs a hash lookup.
#pragma once

#include <limits>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>
#include <vector>

#include "capture/trace_record.h"

namespace terra::capture {

struct OutputSpec {
  enum class Kind { Fresh, SameAsArgument, ViewOfArgument } kind = Kind::Fresh;
  int argument = -1;  // for SameAsArgument (in-place / out=) and ViewOfArgument
  TensorMeta meta;
  // SameAsArgument whose sizes, strides or offset the op changes (transpose_, squeeze_,
  // as_strided_, resize_): `meta` is the argument's metadata after it. (The argument's metadata
  // before is part of the cache key, so this is decided once per entry, not per op.)
  bool restrides = false;
  // The math bits the meta kernel gave the output (z.conj(), x._neg_view()): a placeholder
  // carries them as the real tensor would, so torch's Conjugate/Negative fallbacks resolve it
  // before ops that need it resolved, as they did while tracing, and a value bound to it later
  // reads as conjugated.
  bool conj = false;
  bool neg = false;
};

struct ReturnSpec {
  bool is_list = false;
  std::vector<OutputSpec> tensors;  // one entry for a Tensor return, n for Tensor[]
};

struct InferredOutputs {
  std::vector<ReturnSpec> returns;
  // Set when no placeholder can stand in: data-dependent shapes (nonzero, unique), non-tensor
  // results (item), or ops without a meta kernel. `reason` says which.
  bool needs_materialization = false;
  std::string reason;
  bool restrides = false;  // some output restrides its argument (OutputSpec::restrides)
  // The tensors it returns (lists flattened), and the fewest elements one of them has
  // (INT64_MAX: none): counted once when the entry is made, not per op (CoExecHook::admit).
  size_t num_outputs = 0;
  int64_t fewest_elements = std::numeric_limits<int64_t>::max();
};

// `args` are the op's arguments as they sit on the dispatcher stack (placeholders or real).
const InferredOutputs& infer_outputs(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args);

// Layouts from real runs. torch's meta kernels do not always lay outputs out as the CPU kernels
// do: a convolution whose input or weight is channels_last gives a channels_last output on CPU
// but a contiguous one on meta (torch/_meta_registrations.py picks channels_last from the input
// alone, and only for CUDA from the weight); linalg.svd's Vh is column-major on CPU, row-major on
// meta. A placeholder with the meta layout made Python decide differently from eager
// (`flatten` became a view, which then raised in the graph) and changed which kernels ran.
// While tracing, ops without a C++ meta function (meta_functions.h, whose layouts are the CPU
// kernels' by construction) note what the real kernel gave under the cache's key; the cache
// takes that layout for their fresh outputs (those that alias no argument) whenever the sizes
// agree, and for other sizes under the same input layouts the real run's order of dimensions
// (where its output was dense). Usage, around a real run (Region::handle):
//     auto witness = layout_witness(op, args);   // before: the key of the arguments as they are
//     run_real(...);
//     if (witness) learn_layouts(*witness, outputs);
struct LayoutWitness {
  std::vector<int64_t> key;
  // The arguments' layouts without sizes: the order of dimensions a real run gave is taken for
  // metadata no real run has had yet (a new batch size seen first in co-execution).
  std::vector<int64_t> pattern;
};
// nullopt for ops whose outputs need no witness (a C++ meta function, an alias, a written argument)
// or whose layout under this key is learned already.
std::optional<LayoutWitness> layout_witness(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args);
// `outputs`: every tensor output, lists flattened, in order.
void learn_layouts(const LayoutWitness& witness, c10::ArrayRef<at::Tensor> outputs);

// Number of cached entries (for tests and the benchmark).
size_t shape_cache_size();

// What the cache's misses ran, since the process started: an op's C++ meta function called
// directly (capture/meta_functions.h), or the op through the dispatcher's Meta key (a meta
// kernel torch registered, often written in Python).
struct ShapeCacheCounts {
  size_t entries = 0;
  size_t cpp_meta = 0;
  size_t dispatched = 0;
  size_t corrected = 0;  // entries whose layout a real run corrected (learn_layouts)
};
ShapeCacheCounts shape_cache_counts();

}  // namespace terra::capture
