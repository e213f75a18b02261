// Reference semantics of a Program: which ops it runs for a given sequence of decisions. The
// graph emitter must build a graph that behaves like this; tests use it to check that the
// decisions the Cursor derives from a trace make the program run exactly that trace.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "trace/program.h"
#include "trace/trace_graph.h"

namespace terra::trace {

struct ReplayResult {
  bool ok = false;
  std::vector<NodeId> ops;     // op nodes in execution order
  size_t decisions_used = 0;
  std::string error;           // why not ok
};

// ok only if every decision is consumed and each names the site the program is at.
ReplayResult replay(const Program& program, std::span<const Decision> decisions);

// The decisions a PythonRunner would send for `trace` (via a Cursor), or false if the program
// does not accept it.
bool decisions_for(const Program& program, const Trace& trace, std::vector<Decision>& out);

}  // namespace terra::trace
