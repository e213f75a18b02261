// Declarations of the per-component binding functions that module.cpp calls.
#pragma once

#include <pybind11/pybind11.h>

namespace terra::python {

void init_capture(pybind11::module_& m);
void init_profile(pybind11::module_& m);
void init_emit(pybind11::module_& m);     // python/emit_bindings.cpp
void init_runtime(pybind11::module_& m);
void init_fused(pybind11::module_& m);    // python/fused_bindings.cpp (after init_runtime)
void init_session(pybind11::module_& m);  // python/session_bindings.cpp (after init_runtime)  // python/runtime_bindings.cpp  // python/profile_bindings.cpp (pybind11 only, no torch)

}  // namespace terra::python
