// Python bindings of the capture layer (csrc/capture): regions, modes and trace records.
#include <torch/extension.h>

#include "python/bindings.h"

namespace terra::python {

void init_capture(pybind11::module_& m) {}

}  // namespace terra::python
