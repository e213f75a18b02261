// Python bindings of graph generation (csrc/emit) and the executor interface.
#include <pybind11/pybind11.h>

#include "python/bindings.h"

namespace terra::python {

void init_emit(pybind11::module_& m) { m.def_submodule("emit", "TorchScript graph generation"); }

}  // namespace terra::python
