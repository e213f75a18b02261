// Turning a program location (the frames LocationTracker describes) into the short source
// label pictures show ("train.py:42", "model.py:17 (backward)"). Shared by the bindings that
// draw TraceGraphs: _C.emit.Graph (recordings) and _C.runtime.Session (a running program).
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

namespace terra::python {

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
