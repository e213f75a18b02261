// A small helper for filling a Trace the way an interceptor sees a program: ops arrive one by one
// and loops are entered, advanced and left around them. The capture layer may use it or fill the
// plain structs directly; the tests and benchmarks use it to write programs down readably.
#pragma once

#include <cstdint>
#include <vector>

#include "trace/op_record.h"

namespace terra::trace {

class TraceRecorder {
 public:
  // Loop structure: enter (iteration 0), advance to the next iteration, leave.
  void enter_loop(uint64_t loop_id);
  void next_iteration();
  void exit_loop();

  // Appends an op under the current loops; returns its record index.
  uint32_t op(const OpKey& key, std::vector<ValueRef> inputs = {}, uint32_t num_outputs = 1);
  // Python read output `output` of `record`, now (after the latest op).
  void fetch(uint32_t record, uint32_t output = 0);

  size_t size() const { return trace_.ops.size(); }
  const Trace& trace() const { return trace_; }
  Trace take();

 private:
  Trace trace_;
  std::vector<LoopFrame> loops_;
};

}  // namespace terra::trace
