// Graph generation (BRIEF "How it works", step 3): the structured Program of a TraceGraph becomes
// one TorchScript IR graph. Op nodes become aten nodes rebuilt from their schema; switches become
// prim::If driven by terra::case_select; loops become prim::Loop driven by terra::loop_cond (or
// are unrolled); external tensors enter through terra::feed / terra::feed_or_none and values the
// Python side reads leave through terra::fetch. See docs/EMIT.md.
#pragma once

#include <memory>

#include "emit/captured_program.h"
#include "emit/emitted_graph.h"
#include "trace/program.h"

namespace terra::emit {

struct EmitOptions {
  bool optimize = true;  // run optimize_graph on the result
};

// `structured` must be assign_cases(program.graph()). Throws std::runtime_error for ops it cannot
// express (an attribute TorchScript has no constant for, such as a Generator; an overload the
// JIT resolves differently), std::logic_error on internal inconsistencies.
EmittedGraph emit_graph(const CapturedProgram& program, const trace::Program& structured,
                        const EmitOptions& options = {});

// The standard passes (dead-code elimination, constant propagation, common-subexpression
// elimination) followed by lint; they respect alias analysis, so in-place ops keep their order.
void optimize_graph(std::shared_ptr<torch::jit::Graph>& graph);

}  // namespace terra::emit
