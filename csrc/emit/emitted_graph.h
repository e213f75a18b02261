// What graph generation hands to the runtime: the TorchScript graph plus the meaning of its feed
// and fetch slots, so the Python side knows which tensor to send to which feed and which fetch
// delivers the value it waits for. Kept free of torch headers: the runtime's cursor code can use
// the tables without pulling in the JIT.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "trace/hash.h"
#include "trace/node.h"

namespace torch::jit {
struct Graph;
}

namespace terra::emit {

// Feed slot k (the argument of terra::feed / terra::feed_or_none) delivers the external tensor
// read by input `input` of TraceGraph node `node`, once per execution of that node.
struct FeedSlot {
  trace::NodeId node = trace::kNoNode;
  uint32_t input = 0;
  bool optional = false;  // feed_or_none: Python sends "none" when the input was not external
  // The graph may write the fed memory, directly or through a view (emit/written_feeds.h):
  // fed as it is, never as a copy.
  bool written = true;
};

// Fetch slot k delivers the tensor read by input `input` of the read node `node` (an
// aten::_local_scalar_dense, or a terra::fetch marker whose first attribute is `tag`).
struct FetchSlot {
  trace::NodeId node = trace::kNoNode;
  uint32_t input = 0;
  int64_t tag = -1;  // the marker's tag; -1 for other reads
};

struct EmitStats {
  size_t ops = 0;        // aten nodes emitted (before optimization)
  size_t switches = 0;   // prim::If chains made for switches
  size_t loops = 0;      // prim::Loop nodes
  size_t unrolled = 0;   // loops unrolled
  size_t boxed = 0;      // ops TorchScript's schema matching refused, called boxed (terra::boxed_call)
  size_t nodes_after_passes = 0;
  double emit_ms = 0;      // building the graph
  double optimize_ms = 0;  // passes and lint
};

struct EmittedGraph {
  std::shared_ptr<torch::jit::Graph> graph;
  std::vector<FeedSlot> feeds;
  std::vector<FetchSlot> fetches;
  EmitStats stats;
  // Co-execution graphs: per TraceGraph node, how many values of the output sequence one
  // execution publishes (0 for reads and nodes without ops), and whether it waits at a gate.
  std::vector<uint32_t> node_publishes;
  std::vector<uint8_t> node_gated;
  // The check keys (capture::check_key) of the checked ops this graph gates: Python may let
  // such an op raise without stopping the graph (it has not run it).
  std::unordered_set<uint64_t> gated_checks;
  // Emitted inside a prim::Loop: its iterations share one copy, so a reader elsewhere sees only
  // the latest execution (the PythonRunner checks that Python reads that one too).
  std::vector<uint8_t> node_in_loop;
  // Python scalars among a node's attributes (floats, ints, bools, int lists: view sizes,
  // select indices, learning rates): fed per execution through scalar slot `slot` when they
  // varied between the traces, or baked in as `constant` (slot -1), which Python must then
  // still pass. Both in the encoding of scalar_bits (captured_program.h): a float as its bits,
  // an int or bool as itself, an int list as its elements.
  enum class ScalarKind : uint8_t { kFloat, kInt, kBool, kIntList, kFloatList };
  // Lists travel as their length followed by their elements, on the slot's one queue.
  static bool is_list(ScalarKind k) { return k == ScalarKind::kIntList || k == ScalarKind::kFloatList; }
  struct ScalarUse {
    uint32_t attribute;
    int64_t slot;
    ScalarKind kind;
    std::vector<int64_t> constant;
  };
  std::unordered_map<trace::NodeId, std::vector<ScalarUse>> node_scalars;
  // torch.Generator arguments, baked in as constants: (attribute, the generator's impl). The graph
  // draws from that object in program order (RNG ops are gated), so Python must pass it again.
  std::unordered_map<trace::NodeId, std::vector<std::pair<uint32_t, const void*>>> node_generators;
  // Inputs (key(node, input)) where the node-level check (the producer is one the TraceGraph
  // saw there) does not prove that Python reads the value the graph reads: several producers
  // reach the input, or the producers lie in unrolled loops, whose copies the graph tells apart.
  // Per consumer copy (copy_hash of the trip indices of its unrolled loops), the producer copies
  // the graph's variable holds (value_flow.h); it reads whichever of them ran last. Python's
  // input must come from one of them and be the latest-run one.
  struct ReadProducer {
    trace::NodeId node;
    uint32_t output;
    bool any;       // every copy of the node
    uint64_t copy;  // else: copy_hash of the one copy
  };
  std::unordered_map<uint64_t, std::unordered_map<uint64_t, std::vector<ReadProducer>>> checked_reads;
  // Per node: emitted inside an unrolled loop, so its executions are told apart by copy.
  std::vector<uint8_t> node_copied;
  // Names a copy (value_flow.h: trip indices of the unrolled loops around a node, outermost
  // first) in one word; 0 for a node outside unrolled loops.
  static uint64_t copy_hash(const std::vector<uint32_t>& copy) {
    if (copy.empty()) return 0;
    uint64_t h = 0x7e11a5eedULL;
    for (const uint32_t trip : copy) h = trace::hash_combine(h, trip);
    return h == 0 ? 1 : h;
  }
  // Selected reads (value_flow.h): per key(node, input) and copy, the case-select site the graph
  // waits at and the producer copies it picks among; Python posts the index of the one it read.
  struct Selection {
    int64_t site;
    std::vector<ReadProducer> producers;  // none is `any`
    // The index of (node, output) from copy `copy` among the producers; -1 if it is not one.
    int64_t index_of(trace::NodeId node, uint32_t output, uint64_t copy) const {
      for (size_t i = 0; i < producers.size(); ++i)
        if (producers[i].node == node && producers[i].output == output && producers[i].copy == copy)
          return static_cast<int64_t>(i);
      return -1;
    }
  };
  std::unordered_map<uint64_t, std::unordered_map<uint64_t, Selection>> selected_reads;  // copy: copy_hash
  // Co-execution graphs: nodes the emitter could not express, with the reason. The graph stops
  // at a gate Python never opens there; the PythonRunner diverges when the cursor reaches one,
  // so only the paths through such a node run eagerly (from it on), never the whole program.
  std::unordered_map<trace::NodeId, std::string> unsupported;
  size_t num_selections = 0;
  size_t num_scalar_slots = 0;

  // -1 when (node, input) has no feed slot.
  int64_t feed_slot(trace::NodeId node, uint32_t input) const {
    const auto it = feed_index.find(key(node, input));
    return it == feed_index.end() ? -1 : static_cast<int64_t>(it->second);
  }
  int64_t fetch_slot(trace::NodeId node, uint32_t input) const {
    const auto it = fetch_index.find(key(node, input));
    return it == fetch_index.end() ? -1 : static_cast<int64_t>(it->second);
  }

  // The tag a co-execution graph publishes output k of node n with (k = 255: an op without outputs).
  static int64_t publish_tag(trace::NodeId node, uint32_t output) {
    return (static_cast<int64_t>(node) << 8) | static_cast<int64_t>(output);
  }

  static uint64_t key(trace::NodeId node, uint32_t input) {
    return (static_cast<uint64_t>(node) << 32) | input;
  }
  std::unordered_map<uint64_t, uint32_t> feed_index;
  std::unordered_map<uint64_t, uint32_t> fetch_index;
};

}  // namespace terra::emit
