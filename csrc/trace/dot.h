// Graphviz rendering of a TraceGraph together with the Program case assignment made of it, so a
// user can see which paths terra_torch recorded, where they split and join, and which loops it
// folded (issue 8, "Seeing what terra_torch does"). The trace layer knows nodes only by key
// hashes, so the caller supplies the words (operator names, source lines) through callbacks;
// that keeps this file torch-free and testable on hand-built traces.
#pragma once

#include <functional>
#include <string>

#include "trace/program.h"
#include "trace/trace_graph.h"

namespace terra::trace {

// What to write on op and loop nodes. Either callback may be empty, and either may return "" for
// a node it knows nothing about; the renderer then falls back to the node's key numbers.
struct DotNames {
  std::function<std::string(NodeId)> label;   // e.g. "aten::mul.Tensor"; loops: what the loop is
  std::function<std::string(NodeId)> source;  // e.g. "train.py:42"
};

struct DotOptions {
  std::string title;  // drawn above the graph when not empty
};

// DOT text of `graph` as structured by `program` (which must be assign_cases(graph)).
//
// Drawing conventions, chosen so that the program's decisions can be read off the picture:
//  * op nodes are boxes "n<id> <label>\n<source>"; ops whose output Python reads are marked;
//  * a node with several successors is followed by a diamond "switch s<site>" whose out-edges
//    carry the case each edge selects ("case k", "skip"); a node with several predecessors is
//    preceded by a "merge" node, so every join of paths is visible;
//  * a loop is a cluster "loop n<id>" (while with its loop-cond site, or unrolled) with its trip
//    counts; inside, the body runs from "iter" to "iter end", and a dashed edge goes back;
//    edges into the loop enter at "iter", edges after it leave from "iter end" (labelled
//    "exit" for a while loop, whose exit is a decision).
// Output depends only on the inputs (nodes in creation order, children in insertion order).
std::string to_dot(const TraceGraph& graph, const Program& program, const DotNames& names = {},
                   const DotOptions& options = {});

}  // namespace terra::trace
