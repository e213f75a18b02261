// Python bindings of the profile record store (csrc/profile). Includes pybind11 only, no torch
// header, so this TU compiles in seconds.
#include <pybind11/pybind11.h>

#include "python/bindings.h"

namespace terra::python {

void init_profile(pybind11::module_& m) { m.def_submodule("profile", "convolution profile records"); }

}  // namespace terra::python
