// Misuse (leaving a loop that was never entered, a fetch before any op) is a programming error
// in the caller, so it throws instead of producing a trace the TraceGraph would misread.
#include "trace/trace_recorder.h"

#include <stdexcept>
#include <utility>

namespace terra::trace {

void TraceRecorder::enter_loop(uint64_t loop_id) { loops_.push_back(LoopFrame{loop_id, 0}); }

void TraceRecorder::next_iteration() {
  if (loops_.empty()) throw std::logic_error("TraceRecorder: next_iteration outside a loop");
  ++loops_.back().iteration;
}

void TraceRecorder::exit_loop() {
  if (loops_.empty()) throw std::logic_error("TraceRecorder: exit_loop outside a loop");
  loops_.pop_back();
}

uint32_t TraceRecorder::op(const OpKey& key, std::vector<ValueRef> inputs, uint32_t num_outputs) {
  OpRecord r;
  r.key = key;
  r.loops = loops_;
  r.inputs = std::move(inputs);
  r.num_outputs = num_outputs;
  trace_.ops.push_back(std::move(r));
  return static_cast<uint32_t>(trace_.ops.size() - 1);
}

void TraceRecorder::fetch(uint32_t record, uint32_t output) {
  if (trace_.ops.empty()) throw std::logic_error("TraceRecorder: fetch before any op");
  trace_.fetches.push_back(
      FetchEvent{static_cast<uint32_t>(trace_.ops.size() - 1), record, output});
}

Trace TraceRecorder::take() {
  loops_.clear();
  return std::exchange(trace_, Trace{});
}

}  // namespace terra::trace
