// What Python is shown of a merged program, shared by the bindings that hold one:
// _C.emit.Graph and _C.runtime.Plan (recordings) and _C.runtime.Session (a running program).
// Source labels turn a program location (the frames LocationTracker describes) into what
// pictures show ("train.py:42", "model.py:17 (backward)").
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "emit/emitted_graph.h"
#include "trace/program.h"
#include "trace/trace_graph.h"

namespace terra::python {

// Counts of the TraceGraph and its structured program (terra_torch.explain reports them).
inline pybind11::dict structure_of(const trace::TraceGraph& g, const trace::Program& structured, size_t traces) {
  size_t ops = 0, loops = 0, branch_points = 0, merge_points = 0;
  for (trace::NodeId n = 0; n < g.num_nodes(); ++n) {
    const trace::Node& node = g.node(n);
    ops += node.kind == trace::NodeKind::kOp;
    loops += node.kind == trace::NodeKind::kLoop;
    branch_points += node.children.size() > 1;
    merge_points += node.parents.size() > 1;
  }
  size_t switches = 0, whiles = 0, unrolled = 0;
  for (const trace::ProgNode& p : structured.nodes) {
    switches += p.kind == trace::ProgKind::kSwitch;
    whiles += p.kind == trace::ProgKind::kWhile;
    unrolled += p.kind == trace::ProgKind::kUnrolled;
  }
  pybind11::dict d;
  d["traces"] = traces;
  d["nodes"] = g.num_nodes();
  d["ops"] = ops;
  d["loops"] = loops;
  d["while_loops"] = whiles;
  d["unrolled_loops"] = unrolled;
  d["switches"] = switches;
  d["branch_points"] = branch_points;
  d["merge_points"] = merge_points;
  d["sites"] = structured.sites.size();
  return d;
}

// [(node, input, optional, written)] per feed slot and [(node, input, tag)] per fetch slot.
inline pybind11::list feed_table(const emit::EmittedGraph& e) {
  pybind11::list out;
  for (const auto& f : e.feeds) out.append(pybind11::make_tuple(f.node, f.input, f.optional, f.written));
  return out;
}

inline pybind11::list fetch_table(const emit::EmittedGraph& e) {
  pybind11::list out;
  for (const auto& f : e.fetches) out.append(pybind11::make_tuple(f.node, f.input, f.tag));
  return out;
}

inline std::string user_source(const std::vector<std::string>& frames, const std::string& torch_dir) {
  if (frames.empty()) return "";
  const bool backward = frames.back().starts_with("backward:");
  std::string chosen;
  for (auto it = frames.rbegin(); it != frames.rend(); ++it) {
    if (it->starts_with("backward:") || (!torch_dir.empty() && it->starts_with(torch_dir))) continue;
    chosen = *it;
    break;
  }
  if (chosen.empty()) {
    // No frame of the user's: the op came from torch alone (a backward node with no forward op
    // in the region, such as AccumulateGrad); its own description is the best label.
    chosen = frames.back();
    if (backward) return chosen.substr(std::string("backward: ").size()) + " (backward)";
  }
  // "path/file.py:12 in fn": the function name has no spaces, so the last " in " ends the path.
  const size_t in = chosen.rfind(" in ");
  if (in != std::string::npos) chosen.resize(in);
  const size_t slash = chosen.rfind('/');
  if (slash != std::string::npos) chosen.erase(0, slash + 1);
  return backward ? chosen + " (backward)" : chosen;
}

inline std::string torch_package_dir() {
  pybind11::object torch = pybind11::module_::import("torch");
  return pybind11::module_::import("os.path").attr("dirname")(torch.attr("__file__")).cast<std::string>() + "/";
}


}  // namespace terra::python
