// Case assignment (Terra, "Graph generation"): turns a TraceGraph, an arbitrary DAG per loop
// level, into a structured program of blocks, switch-cases and loops, and precomputes for every
// control edge the decisions the PythonRunner must send when its trace takes that edge.
#pragma once

#include "trace/program.h"
#include "trace/trace_graph.h"

namespace terra::trace {

// Every op and loop node of `graph` appears exactly once in the result. Throws std::logic_error
// only on an internal inconsistency.
Program assign_cases(const TraceGraph& graph);

}  // namespace terra::trace
