// Segments: the straight-line stretches of aten ops in a generated graph, cut out so that each
// can run as one compiled function (runtime/fused_executor.h runs them; terra_torch/_fused.py
// compiles them with AOTInductor).
//
// A worked example. The emitted graph of an MLP step (terra_torch.graph.build) holds
//
//     %10 = terra::feed(0)                      <- a channel op: ends any stretch
//     %21 = aten::addmm(%12, %18, %10, 1, 1)
//     %26 = aten::relu(%21)
//     %44 = aten::_log_softmax(%26, 1, False)
//     %9  = terra::feed(5)                      <- ends the stretch (in co-execution)
//
// and cut_segments() turns the three aten ops into
//
//     %l  = prim::ListConstruct(%12, %18, %10)
//     %s  = terra::segment(0, %l)               <- segment 0's body: the three ops
//     %44 = prim::ListUnpack(%s)                <- only the values used after the stretch
//
// What a segment may hold, and why (each rule in fusible() / split_escaping_aliases() / replace()):
// - aten ops with tensor results only, whose other arguments are constants: a compiled function
//   is specialized to them. The one exception is a scalar operand (scalar_operands(), below): a
//   number computed each iteration, such as Adam's step size in `addcdiv_(p, m, d, value=-lr/bc)`,
//   enters the segment as a 0-dim tensor (`prim::NumToTensor` before the call, `aten::Float` in
//   the body, so the interpreted body runs the op as it was);
// - no random ops: compiled code draws other numbers than eager's kernels;
// - results used after the segment alias there what they alias in eager: the body returns the
//   values it computes; an in-place op's result stands for its argument (written in place by
//   the compiled code, or returned by the body), and a view (t(), view, ...) is made again after
//   the call from what it views, so that an optimizer's later write through it reaches the
//   parameter. Any other aliasing result used after the segment ends the segment there.
// terra::publish and terra::fetch ops between the stretch's ops (co-execution graphs publish
// every output; a fetch is a value Python reads, as `.item()` of Adam's step counter) move after
// the segment call: no other channel op is crossed, so nothing Python posts is waited for before
// them, and a waiting Python only waits until the segment has run. A fetch followed by in-place
// writes reads a copy taken where it was.
// Nodes that read no tensor data and have no effect (constants, `x is None`, an If choosing
// between tensors, arithmetic on numbers, and feeds where they are ready) do not end a stretch
// unless they read what it computes: they stay in place, before the call. In a replayed
// single-tensor Adam step this is what lets the per-parameter updates join one segment.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace torch::jit {
struct Graph;
struct Node;
}

namespace terra::emit {

inline constexpr const char* kSegmentOp = "terra::segment";

// One cut-out stretch: a graph whose inputs are the tensors the stretch reads from before it
// and whose outputs are its values used after it.
struct Segment {
  std::shared_ptr<torch::jit::Graph> body;
  size_t num_ops = 0;  // aten ops in the body (views included)
};

struct SegmentedGraph {
  std::shared_ptr<torch::jit::Graph> graph;  // the input graph with terra::segment(k, inputs) calls
  std::vector<Segment> segments;             // indexed by k
};

struct SegmentOptions {
  // Stretches with fewer ops that compute (views and aliases not counted) stay in place: a
  // compiled call costs more than an interpreted op or two.
  size_t min_compute_ops = 2;
  // Every terra::feed has its tensor before the graph starts (a replay, a direct graph): feeds
  // then stay in place without ending a stretch. Not in co-execution, where a feed waits for
  // Python to reach its op, and Python may wait for a value of the stretch before it does.
  bool feeds_ready = false;
};

// An op argument that may be a number computed at run time inside a segment (the Scalar
// `value` of addcdiv_, `alpha` of add_, ...): terra_torch/_fused.py rewrites each op of this
// table into tensor ops that take the number as a 0-dim tensor. `overload` "" is the default.
struct ScalarOperand {
  const char* op;
  const char* overload;
  const char* argument;
};
const std::vector<ScalarOperand>& scalar_operands();

// Is input `input` of `n` a float that scalar_operands() lets a segment take at run time?
bool is_scalar_operand(const torch::jit::Node* n, size_t input);

// Cuts every stretch of `graph` (a copy; the argument is not changed). The segments k with
// `in_place[k]` keep their ops where they are (their bodies are made all the same, so that every
// segment has the number and body it has without `in_place`): the FusedExecutor cuts again so
// once segments stay interpreted for good, and those then cost what their ops cost (a call of a
// small interpreted segment cost as much as its ops: the list of inputs, the boxed call, a new
// interpreter state, the list of results, views made again after the call).
SegmentedGraph cut_segments(const std::shared_ptr<torch::jit::Graph>& graph, const SegmentOptions& options = {},
                            const std::vector<bool>& in_place = {});

}  // namespace terra::emit
