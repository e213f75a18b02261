// Python bindings of the capture layer (csrc/capture): regions, modes and trace records.
// Records are converted to plain Python tuples here; terra_torch/debug.py gives them names.
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include "capture/interceptor.h"
#include "capture/placeholder.h"
#include <optional>

#include "capture/outside_program.h"
#include "capture/region.h"
#include "capture/terra_key.h"
#include "capture/meta_functions.h"
#include "capture/shape_inference.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace terra::python {

namespace {

using capture::Mode;
using capture::Region;

py::tuple meta_tuple(const capture::TensorMeta& m) {
  // (A torch.dtype: toPyObject gives a ScalarType as the int TorchScript stores it. None for an
  // undefined output, a gradient a backward op did not compute.)
  py::object dtype = m.dtype == c10::ScalarType::Undefined
                         ? py::none()
                         : py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(m.dtype)));
  return py::make_tuple(dtype, std::vector<int64_t>(m.sizes.begin(), m.sizes.end()),
                        std::vector<int64_t>(m.strides.begin(), m.strides.end()), m.storage_offset,
                        m.device.str(), m.requires_grad);
}

py::list ops_of(const Region& region) {
  py::list out;
  for (const capture::OpRecord& rec : region.trace().ops) {
    py::list attributes;
    for (const c10::IValue& v : rec.attributes) attributes.append(torch::jit::toPyObject(v));
    py::list inputs;
    for (const capture::OpInput& in : rec.inputs) {
      if (in.value.is_external())
        inputs.append(py::make_tuple(in.argument, in.list_index, "external", in.value.external, -1));
      else
        inputs.append(py::make_tuple(in.argument, in.list_index, "op", in.value.record, in.value.output));
    }
    py::list outputs;
    for (const capture::TensorMeta& m : rec.outputs) outputs.append(meta_tuple(m));
    py::list loops;
    for (const capture::LoopFrame& l : rec.loops) loops.append(py::make_tuple(l.loop_id, l.iteration));
    out.append(py::make_tuple(c10::toString(rec.op.operator_name()), py::tuple(attributes), rec.attributes_hash,
                              py::tuple(inputs), py::tuple(outputs), rec.location, py::tuple(loops),
                              rec.backward, rec.needs_materialization));
  }
  return out;
}

}  // namespace

void init_capture(py::module_& m) {
  m.def("install_interceptor", &capture::install_interceptor,
        "Give CompositeExplicitAutograd ops a direct kernel on terra's key; returns how many");
  m.def("is_placeholder", &capture::is_placeholder);
  m.def("forget_regions_after_fork", &capture::forget_regions_after_fork,
        "In a forked child: intercept nothing from now on (os.register_at_fork, terra_torch/runtime.py)");
  m.def("bind_placeholder", &capture::bind_placeholder, "Give a placeholder its value (materialization)");
  m.def("placeholder_error", [](const at::Tensor& t) -> std::string {
    auto* impl = dynamic_cast<capture::PlaceholderImpl*>(t.unsafeGetTensorImpl());
    TORCH_CHECK(impl != nullptr, "terra_torch: placeholder_error needs a placeholder tensor");
    return std::string("Cannot access the data of a ") + impl->tensorimpl_type_name();
  });
  m.def("shape_cache_size", &capture::shape_cache_size);
  m.def("shape_cache_counts", [] {
    const capture::ShapeCacheCounts c = capture::shape_cache_counts();
    py::dict d;
    d["entries"] = c.entries;
    d["cpp_meta"] = c.cpp_meta;
    d["dispatched"] = c.dispatched;
    d["corrected"] = c.corrected;
    d["cpp_meta_ops"] = capture::cpp_meta_function_names();
    return d;
  }, "What the shape cache's misses ran (C++ meta functions called directly, or the dispatcher's Meta "
        "kernel), and the ops that have a C++ meta function here.");
  m.def("inject_failure", &capture::inject_failure, py::arg("op"),
        "The next op whose name starts with `op` that the interceptor handles raises (empty: disarm)");

  // `with _C.suspended():` runs Python code with interception off on this thread (reads of
  // tensor memory that torch implements with internal ops, which are no ops of the program).
  struct Suspended {
    std::optional<capture::SuspendGuard> guard;
  };
  py::class_<Suspended>(m, "suspended")
      .def(py::init<>())
      .def("__enter__", [](Suspended& s) { s.guard.emplace(); })
      .def("__exit__", [](Suspended& s, py::args) { s.guard.reset(); });

  // `with _C.outside_program():` code the program runs that is not the program (a DataLoader
  // assembling a batch): its ops run for real, unrecorded, where nothing the graph owes can reach
  // them (capture/outside_program.h).
  struct Outside {
    std::optional<capture::OutsideProgram> block;
  };
  py::class_<Outside>(m, "outside_program")
      .def(py::init<>())
      .def("__enter__", [](Outside& o) { o.block.emplace(); })
      .def("__exit__", [](Outside& o, py::args) { o.block.reset(); });
  m.def("outside_program_active", &capture::outside_program_on_this_thread);

  py::class_<Region, std::shared_ptr<Region>>(m, "Region")
      .def(py::init([](const std::string& mode, py::object stop_frame) {
             TORCH_CHECK(mode == "record" || mode == "placeholder",
                         "terra_torch: capture mode must be 'record' or 'placeholder', got '", mode, "'");
             auto* frame = stop_frame.is_none() ? nullptr : reinterpret_cast<PyFrameObject*>(stop_frame.ptr());
             return std::make_shared<Region>(mode == "record" ? Mode::Record : Mode::Placeholder, frame);
           }),
           py::arg("mode"), py::arg("stop_frame") = py::none())
      .def("open", &Region::open)
      .def("ignore_outermost_loops", [](Region& r) { r.locations().ignore_outermost_loops(true); },
           "The outermost frame runs the training loop: its loops are not program loops")
      .def("close", &Region::close)
      .def(
          "note_memory_exported", [](Region& r, const at::Tensor& t) { r.note_data_replaced(t, t); }, py::arg("tensor"),
          "`tensor`'s memory was handed to Python as an array, which may write it without an op: its next "
          "reads are inputs from outside, fed with its memory (Region::note_data_replaced)")
      .def("unsupported", &Region::unsupported)
      .def_property_readonly("is_open", &Region::is_open)
      .def("outside_tensor", &Region::outside_tensor, py::arg("tensor"),
           "Whether Python may read the tensor's memory without waiting for the graph (capture/outside_program.h)")
      .def_property_readonly("handled", &Region::handled,
                             "Ops the interceptor brought to this region (replayed records are not among them)")
      .def("ops", &ops_of)
      .def("externals",
           [](const Region& r) {
             py::list out;
             for (const auto& e : r.trace().externals)
               out.append(py::make_tuple(meta_tuple(e.meta), reinterpret_cast<uintptr_t>(e.identity)));
             return out;
           })
      .def("describe_location", [](Region& r, uint64_t id) { return r.locations().describe(id); });
}

}  // namespace terra::python
