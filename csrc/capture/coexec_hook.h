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

  // `rec` has its inputs, attributes, location and loops. `num_outputs`: tensors the op returns
  // (lists flattened). `needs_data`: the op cannot run on placeholders (it reads values or has
  // a data-dependent shape). `host`: it takes and gives no tensors.
  virtual Verdict validate(const Region& region, const OpRecord& rec, int32_t index, c10::ArrayRef<c10::IValue> args,
                           size_t num_outputs, bool needs_data, bool host) = 0;
  // Before an op that needs data runs for real (ahead of validate(), so that an op raising in
  // the user's program leaves no step of the graph behind): give its inputs their values.
  virtual void materialize_inputs(c10::ArrayRef<c10::IValue> args) = 0;
  // The outputs of a matched op, flattened (undefined where the op returned none).
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

  // Values Python knows itself (runtime/known_values.h). `out`: `args` with every tensor replaced
  // by its known value; false if some tensor has none. A read (`read`: the op needs data) whose
  // arguments are all known runs on them instead of waiting for the graph. Asked before
  // validate() posts the op: a fresh tensor is read from its memory, which the graph writes once
  // the op's gate is posted.
  virtual bool known_arguments(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, bool read,
                               torch::jit::Stack& out) = 0;
  // After an op answered with placeholders whose arguments were all known (`known`): its outputs'
  // values follow from them.
  virtual void follow_known(const c10::OperatorHandle& op, torch::jit::Stack& known,
                            c10::ArrayRef<at::Tensor> outputs) = 0;
  // An op answered with placeholders that Python could not follow: the known values of the
  // tensors it writes are gone (a version counter does not always say so: a foreach kernel bumps
  // its tensors' versions from inside, where co-execution never runs it).
  virtual void forget_written(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) = 0;
};

}  // namespace terra::capture
