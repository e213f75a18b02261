// The vocabulary of the TraceGraph that other layers hold on to: node ids are stable while traces
// are merged, so the graph emitter and the runtime can keep referring to nodes by number.
#pragma once

#include <cstdint>
#include <vector>

#include "trace/op_record.h"

namespace terra::trace {

using NodeId = uint32_t;
using GraphId = uint32_t;
inline constexpr NodeId kNoNode = UINT32_MAX;
inline constexpr GraphId kNoGraph = UINT32_MAX;

enum class NodeKind : uint8_t { kStart, kEnd, kOp, kLoop };

// What a trace element is matched on. A loop node stands for one program loop, so it matches on
// the loop id alone (kept in key.location); the end node matches the end of a path.
struct MatchKey {
  NodeKind kind = NodeKind::kOp;
  OpKey key;

  static MatchKey op(const OpKey& k) { return {NodeKind::kOp, k}; }
  static MatchKey loop(uint64_t loop_id) { return {NodeKind::kLoop, OpKey{0, 0, loop_id}}; }
  static MatchKey end() { return {NodeKind::kEnd, OpKey{}}; }
  friend bool operator==(const MatchKey&, const MatchKey&) = default;
};

inline uint64_t hash_of(const MatchKey& k) {
  return hash_combine(OpKeyHash{}(k.key), static_cast<uint64_t>(k.kind));
}

// One producer an input slot was seen to read. Per node, each slot keeps every distinct producer
// observed (on different paths a slot can read different producers).
struct Source {
  enum class Kind : uint8_t { kNode, kFeed };
  Kind kind = Kind::kNode;
  bool loop_carried = false;  // producer ran in an earlier iteration of a shared loop
  uint32_t id = 0;            // producer NodeId, or feed id
  uint32_t output = 0;
  friend bool operator==(const Source&, const Source&) = default;
};

// Python read output `output` of this node while the iteration stood at node `at`.
struct FetchPoint {
  uint32_t output = 0;
  NodeId at = kNoNode;
  friend bool operator==(const FetchPoint&, const FetchPoint&) = default;
};

// One executed instance of a loop: in trace `trace` it ran `count` iterations that issued ops.
struct TripRecord {
  uint32_t trace = 0;
  uint32_t count = 0;
};

struct Node {
  NodeId id = kNoNode;
  NodeKind kind = NodeKind::kOp;
  GraphId graph = kNoGraph;  // the (sub)graph this node belongs to
  OpKey key;                 // loop nodes: key.location is the loop id
  GraphId body = kNoGraph;   // loop nodes: the body graph
  std::vector<NodeId> children;  // control successors, in insertion order
  std::vector<NodeId> parents;
  uint32_t num_outputs = 0;
  uint32_t visits = 0;  // how often merged traces passed here
  std::vector<std::vector<Source>> inputs;  // per input slot
  std::vector<FetchPoint> fetches;
  std::vector<TripRecord> trips;  // loop nodes: every instance seen
  uint32_t fixed_trips = 0;       // loop nodes: the one count all instances had, 0 if they differ

  uint64_t loop_id() const { return key.location; }
  MatchKey match_key() const { return {kind, key}; }
};

// The top-level graph, or the body of one loop node: its own start and end node.
struct SubGraph {
  GraphId id = kNoGraph;
  NodeId start = kNoNode;
  NodeId end = kNoNode;
  NodeId loop = kNoNode;       // owning loop node; kNoNode for the top level
  std::vector<NodeId> nodes;   // all nodes, start and end included, in creation order
};

}  // namespace terra::trace
