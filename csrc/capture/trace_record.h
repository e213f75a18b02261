// What the capture layer records for each intercepted aten op: the TraceGraph's only input.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <vector>

#include "capture/program_location.h"

namespace terra::capture {

// Sizes, strides and the rest that a placeholder must reproduce.
struct TensorMeta {
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::kCPU);
  c10::SmallVector<int64_t, 6> sizes;  // inline up to 6 dims: no allocation per output
  c10::SmallVector<int64_t, 6> strides;
  int64_t storage_offset = 0;
  bool requires_grad = false;
  // The math bits: a conjugate or negative view (autograd's backward of `mul` on complex tensors
  // takes `other.conj()`) has its base's storage and layout; without them a later read of the
  // base was taken for a read of the view (Region::find_produced), and SGD updated conj(p).
  bool conj = false;
  bool neg = false;
  bool operator==(const TensorMeta& o) const {
    return dtype == o.dtype && device == o.device && sizes == o.sizes && strides == o.strides &&
           storage_offset == o.storage_offset && requires_grad == o.requires_grad && conj == o.conj && neg == o.neg;
  }
};

// Where a tensor input came from: output `output` of record `record`, or external input `external`.
struct ValueRef {
  int32_t record = -1;
  int32_t output = -1;
  int32_t external = -1;
  bool is_external() const { return external >= 0; }
};

struct OpInput {
  int32_t argument;    // position in the schema's arguments
  int32_t list_index;  // index inside a Tensor[] argument, -1 for a plain Tensor
  ValueRef value;
};

// A tensor the region did not produce: a parameter, a batch, a constant.
struct ExternalInput {
  TensorMeta meta;
  // The TensorImpl, kept alive by the recorder while the region is open. Traces read back from
  // a file (capture/trace_json.h) hold a token here that is no address: never dereference it.
  const void* identity = nullptr;
  // The first op input that read it, hash_combine(location, argument, list index): a name
  // that, unlike the address, is the same in another iteration or process (0: not known).
  uint64_t first_reader = 0;
  bool wrapped_number = false;  // a Python scalar the arg parser wrapped (one object per op)
};

struct OpRecord {
  c10::OperatorHandle op;
  // Inline capacities cover nearly every op, so that recording one allocates nothing.
  c10::SmallVector<c10::IValue, 4> attributes;  // non-tensor arguments, in schema order
  c10::SmallVector<int16_t, 4> attribute_arguments;  // schema position of each attribute
  uint64_t attributes_hash = 0;
  c10::SmallVector<OpInput, 3> inputs;
  c10::SmallVector<TensorMeta, 1> outputs;  // tensor outputs, lists flattened
  uint64_t location = 0;
  c10::SmallVector<LoopFrame, 2> loops;
  bool backward = false;               // run by the autograd engine
  // Backward ops: the record of the forward op whose autograd node runs them (-1: not known).
  // Its loop frames tell which iteration of a flattened loop this backward op belongs to.
  int32_t origin = -1;
  bool needs_materialization = false;  // data-dependent output: a placeholder cannot stand in
  // An op whose kernel checks its arguments' values (capture/value_checks.h), issued where an
  // except clause of the program covers it: co-execution checks it before the graph runs it.
  bool checked = false;
};

struct Trace {
  std::vector<OpRecord> ops;
  std::vector<ExternalInput> externals;
};

}  // namespace terra::capture
