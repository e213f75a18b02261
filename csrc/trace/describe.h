// Human-readable dumps of a TraceGraph and of a Program, for test failure messages, debugging
// and the examples in docs/TRACEGRAPH.md.
#pragma once

#include <string>

#include "trace/program.h"
#include "trace/trace_graph.h"

namespace terra::trace {

std::string describe(const TraceGraph& graph);
std::string describe(const Program& program);

}  // namespace terra::trace
