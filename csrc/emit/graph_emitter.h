// Graph generation (docs/ARCHITECTURE.md): the structured Program of a TraceGraph becomes
// one TorchScript IR graph. Op nodes become aten nodes rebuilt from their schema; switches become
// prim::If driven by terra::case_select; loops become prim::Loop driven by terra::loop_cond (or
// are unrolled); external tensors enter through terra::feed / terra::feed_or_none and values the
// Python side reads leave through terra::fetch.
//
// Shape of the result (what the runtime relies on):
//  * one graph, no graph inputs or outputs: everything enters by feeds and leaves by fetches;
//  * feed slot = (node, input): a fed input pulls one tensor per execution of its op, so the
//    same external tensor used by three ops is fed three times; an input that saw both
//    external tensors and graph values uses feed_or_none and an If picks the graph value on none;
//  * fetch slot = (read node, input): ops whose results Python reads (.item(), bool(t), an
//    explicit terra::fetch marker) become fetches of their tensor inputs and are not emitted;
//  * switch k: `case_select(site)` then a chain of prim::If on `== 0`, `== 1`, ...; values a case
//    produces leave the If as outputs, prim::Uninitialized standing in on the other paths;
//  * kWhile: prim::Loop(INT64_MAX, true, carried...) whose body ends with loop_cond(site);
//  * kUnrolled: the body emitted trip_count times.
//
// Limitations: an input reads, among the producer copies recorded for it, the one that ran last
// (value_flow.h); a Python-level choice between two values with no op in between (`y if flag
// else z` on a path that is otherwise identical) is invisible and reads the later one. Inside a
// prim::Loop all iterations share one copy, so iteration i of one loop cannot read iteration i
// of an earlier loop (that needs lists; unrolled loops are exact). Scalar attributes are baked in
// as constants; Python scalars the arg parser wraps into tensors are feeds. RNG ops draw from the
// generator current when the graph runs.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "emit/captured_program.h"
#include "emit/emitted_graph.h"
#include "trace/program.h"

namespace terra::emit {

struct EmitOptions {
  bool optimize = true;  // run optimize_graph on the result
  bool lint = true;      // Graph::lint() the result (after the passes, with optimize)
  // The co-execution form (docs/RUNTIME.md, "Placeholders and the output sequence"): every op
  // publishes each output (terra::publish), ops with side effects wait for Python at a
  // terra::gate first, and reads become nothing (Python takes the published values).
  bool coexec = false;
};

// `structured` must be assign_cases(program.graph()). An op whose overload TorchScript's schema
// matching would not pick for the recorded arguments is called boxed (terra::boxed_call). Ops it
// cannot express at all (an attribute TorchScript has no constant for, a torch.Generator that is
// another object in different records) throw std::runtime_error, except in the co-execution
// form, where they are listed in EmittedGraph::unsupported and only their paths run eagerly;
// std::logic_error on internal inconsistencies.
EmittedGraph emit_graph(const CapturedProgram& program, const trace::Program& structured,
                        const EmitOptions& options = {});

// emit_graph found loops whose per-iteration values are read after later iterations ran
// (value_flow.h, stale_loops): they must be flattened before the graph can be generated.
class LoopsToFlatten : public std::runtime_error {
 public:
  explicit LoopsToFlatten(std::vector<uint64_t> ids);
  std::vector<uint64_t> loop_ids;
};

// The generation every caller wants: assign cases, emit, and where emit_graph asks for it,
// flatten loops and start again. `structured` receives the Program the result was emitted from.
EmittedGraph emit_program(CapturedProgram& program, std::optional<trace::Program>& structured,
                          const EmitOptions& options = {});

// The standard passes (dead-code elimination, constant propagation, common-subexpression
// elimination) followed by lint; they respect alias analysis, so in-place ops keep their order.
void optimize_graph(std::shared_ptr<torch::jit::Graph>& graph, bool lint = true);

}  // namespace terra::emit
