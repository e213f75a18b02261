// The decisions each control edge implies, precomputed once per program so that the runtime
// Cursor pays a hash lookup per op instead of a walk through the program tree.
#pragma once

#include "trace/block_graph.h"
#include "trace/program.h"
#include "trace/trace_graph.h"

namespace terra::trace {

// Fills program.out_begin, program.out_edges and program.decision_pool from the finished program tree.
void build_decision_table(const TraceGraph& graph, const BlockGraph& blocks, Program& program);

}  // namespace terra::trace
