// How the co-execution runtime steers a capture region (Mode::CoExec). The capture layer knows
// ops, records and placeholders; the runtime knows the TraceGraph, the channel and the values
// the graph computed. This interface is the seam, so capture stays free of runtime headers.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <cstdint>

#include "capture/trace_record.h"

namespace terra::capture {

class Region;

class CoExecHook {
 public:
  enum class Verdict {
    kPlaceholder,  // the op matched: return placeholders, then report them with outputs()
    kRunReal,      // the op matched and needs data: its inputs are materialized, run it for real
    kDiverged,     // the op did not match: the graph is stopped and every live placeholder is
                   // materialized; the rest of the region records real ops
  };
  virtual ~CoExecHook() = default;

  // The question asked of an op that runs on placeholders (neither host nor needing data): does
  // it match the graph? `rec` has its inputs, attributes, location and loops; `num_outputs`: the
  // tensors it returns (lists flattened), `fewest_elements` the fewest elements one of them has
  // (INT64_MAX: none). kPlaceholder: return placeholders, then report them with outputs().
  // kDiverged: run it for real. (The runtime takes the values it knows of its arguments first,
  // runtime/known_values.h: the graph may write their memory once the op is posted; and it keeps
  // a way to compute small outputs on the Python side, for which it asks the sizes.)
  virtual Verdict admit(const Region& region, const OpRecord& rec, int32_t index, c10::ArrayRef<c10::IValue> args,
                        size_t num_outputs, int64_t fewest_elements) = 0;
  // An op that runs for real because it needs data (`needs_data`: it reads values or has a
  // data-dependent shape; `host`: it takes and gives no tensors), after it ran: does it match?
  virtual Verdict validate(const Region& region, const OpRecord& rec, int32_t index, c10::ArrayRef<c10::IValue> args,
                           size_t num_outputs, bool needs_data, bool host) = 0;
  // Before an op that needs data runs for real (ahead of validate(), so that an op raising in
  // the user's program leaves no step of the graph behind): give its inputs their values.
  virtual void materialize_inputs(c10::ArrayRef<c10::IValue> args) = 0;
  // The outputs of a matched op, flattened (undefined where the op returned none). After admit(),
  // the values Python knew of its arguments are followed to them.
  virtual void outputs(int32_t index, c10::ArrayRef<at::Tensor> outputs) = 0;

  // Errors only the data can raise (capture/value_checks.h). Whether the op `rec`, not flagged
  // `checked` by the capture layer, must still be checked first: it raised at this location in
  // an earlier iteration.
  virtual bool check_first(const OpRecord& rec) = 0;
  // A checked op raised before validate(): kPlaceholder if the graph can go on without it (it
  // waits at the op's gate, and Python's next op picks the path), else kDiverged (the graph is
  // stopped and the rest of the region records real ops).
  virtual Verdict check_raised(const Region& region, const OpRecord& rec, int32_t index) = 0;

  // The op at record `index` cannot be co-executed (`why`): a divergence there.
  virtual void refuse(int32_t index, std::string why) = 0;

  // `t`, a placeholder of this iteration without elements, received memory from outside the
  // program (Region::adopt_outside_memory): it is an input from outside now, linked to no value.
  virtual void outside_memory(const at::Tensor& t) = 0;
  // torch's set_data is about to give the real tensor `self` the storage of `from` (which has its
  // value): the graph must first run every op posted so far (an op it has not run yet would read
  // `self` through the same TensorImpl, and find the new storage), and both are inputs from
  // outside from then on, linked to no value (Region::note_data_replaced).
  virtual void storage_replaced(const at::Tensor& self, const at::Tensor& from) = 0;

  // A read Python may answer itself (runtime/known_values.h): `out` is `args` with every tensor
  // replaced by its known value; false if some tensor has none. Then the op runs on them instead
  // of waiting for the graph.
  virtual bool known_read_arguments(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                    torch::jit::Stack& out) = 0;

  // An op ran outside the program, unrecorded (capture/outside_program.h): counted for explain().
  virtual void ran_outside() {}
};

}  // namespace terra::capture
