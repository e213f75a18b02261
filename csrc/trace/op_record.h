// The trace of one iteration, as the capture layer hands it over. It is plain data (structs and
// vectors, no torch types) so that the TraceGraph can be built and tested without torch, and so
// that the capture layer can fill it with push_back and nothing else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "trace/hash.h"

namespace terra::trace {

// What two ops are compared on (Terra, "equality criteria"): operator, attributes, location.
// Inputs are deliberately not part of it: the same program point may read different producers
// on different paths, and that must not split the node.
struct OpKey {
  uint64_t op = 0;        // interned operator name (with overload)
  uint64_t attrs = 0;     // hash of the canonical non-tensor arguments
  uint64_t location = 0;  // program location id, without loop iteration numbers
  friend bool operator==(const OpKey&, const OpKey&) = default;
};

struct OpKeyHash {
  size_t operator()(const OpKey& k) const noexcept {
    return static_cast<size_t>(hash_combine(hash_combine(mix64(k.op), k.attrs), k.location));
  }
};

// One enclosing program loop. A new instance of a loop starts when the loop id changes at this
// depth, when an enclosing frame changes, or when the iteration index goes down.
struct LoopFrame {
  uint64_t loop_id = 0;
  uint32_t iteration = 0;
  friend bool operator==(const LoopFrame&, const LoopFrame&) = default;
};

// Where an op input comes from: output `output` of record `index` of the same trace (which must
// precede the consumer), or the external feed with id `index`.
struct ValueRef {
  enum class Kind : uint8_t { kOutput, kFeed };
  Kind kind = Kind::kOutput;
  uint32_t index = 0;
  uint32_t output = 0;

  static ValueRef output_of(uint32_t record, uint32_t output = 0) {
    return {Kind::kOutput, record, output};
  }
  static ValueRef feed(uint32_t feed_id) { return {Kind::kFeed, feed_id, 0}; }
  friend bool operator==(const ValueRef&, const ValueRef&) = default;
};

struct OpRecord {
  OpKey key;
  std::vector<LoopFrame> loops;  // enclosing loops, outermost first
  std::vector<ValueRef> inputs;
  uint32_t num_outputs = 1;
  int32_t origin = -1;  // backward ops: the forward record whose autograd node ran them
};

// "Python read output `output` of record `record`", while the iteration stood just after record
// `after` (record <= after).
struct FetchEvent {
  uint32_t after = 0;
  uint32_t record = 0;
  uint32_t output = 0;
  friend bool operator==(const FetchEvent&, const FetchEvent&) = default;
};

struct Trace {
  std::vector<OpRecord> ops;
  std::vector<FetchEvent> fetches;
};

}  // namespace terra::trace
