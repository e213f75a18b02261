// Python bindings of the FusedExecutor (runtime/fused_executor.h): what terra_torch/_fused.py
// needs to compile a segment (its body as plain Python data, the input layouts) and to hand the
// result back. Also used by emit_bindings.cpp's Graph.run(mode="fused").
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include <unordered_map>

#include "python/bindings.h"
#include "runtime/fused_executor.h"

namespace py = pybind11;

namespace terra::python {

namespace {

// A constant argument as the Python op overload takes it: TorchScript keeps dtypes, layouts and
// memory formats as ints, torch.ops wants torch.dtype / torch.layout / torch.memory_format.
py::object constant_argument(const c10::IValue& v, const c10::Argument& arg) {
  if (v.isInt()) {
    c10::TypePtr t = arg.real_type();
    if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
    const int64_t i = v.toInt();
    switch (t->kind()) {
      case c10::TypeKind::ScalarTypeType:
        return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(i))));
      case c10::TypeKind::LayoutType:
        return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(i))));
      case c10::TypeKind::MemoryFormatType:
        return py::reinterpret_borrow<py::object>(torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(i)));
      default:
        break;
    }
  }
  return torch::jit::toPyObject(v);
}

}  // namespace

// A segment body as plain data: {"inputs": n, "nodes": [(op, overload, [("v", id) | ("c", value)],
// [output ids])], "outputs": [ids]}; value ids count the inputs first, then node outputs.
py::dict describe_segment_body(const torch::jit::Graph& body) {
  std::unordered_map<const torch::jit::Value*, int64_t> ids;
  for (const torch::jit::Value* v : body.inputs()) ids.emplace(v, static_cast<int64_t>(ids.size()));
  py::list nodes;
  for (const torch::jit::Node* n : body.nodes()) {
    if (n->kind() == c10::prim::Constant) continue;  // read where used
    const c10::FunctionSchema& schema = n->schema();
    py::list args;
    for (size_t j = 0; j < n->inputs().size(); ++j) {
      const torch::jit::Value* in = n->input(j);
      if (auto it = ids.find(in); it != ids.end()) {
        args.append(py::make_tuple("v", it->second));
      } else {
        const std::optional<c10::IValue> c = torch::jit::toIValue(in);
        TORCH_CHECK(c.has_value(), "terra_torch: a segment input is neither a value nor a constant");
        args.append(py::make_tuple("c", constant_argument(*c, schema.arguments().at(j))));
      }
    }
    py::list outs;
    for (const torch::jit::Value* out : n->outputs()) {
      ids.emplace(out, static_cast<int64_t>(ids.size()));
      outs.append(ids.at(out));
    }
    nodes.append(py::make_tuple(schema.name(), schema.overload_name(), args, outs));
  }
  py::list outputs;
  for (const torch::jit::Value* v : body.outputs()) outputs.append(ids.at(v));
  py::dict d;
  d["inputs"] = body.inputs().size();
  d["nodes"] = nodes;
  d["outputs"] = outputs;
  d["text"] = body.toString();
  return d;
}

void init_fused(py::module_& m) {
  py::module_ r = m.attr("runtime");
  py::class_<runtime::FusedExecutor, std::shared_ptr<runtime::FusedExecutor>>(
      r, "FusedExecutor", "A generated graph whose straight-line stretches run compiled (runtime/fused_executor.h)")
      .def(
          "next_request",
          [](runtime::FusedExecutor& e, double wait_s) -> py::object {
            std::optional<runtime::CompileRequest> req;
            {
              py::gil_scoped_release no_gil;
              req = e.next_request(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(wait_s)));
            }
            if (!req) return py::none();
            auto dtype = [](c10::ScalarType t) {
              return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(t)));
            };
            py::list direct, bases, views;
            for (const runtime::CallPlan::Direct& d : req->plan.direct)
              direct.append(py::make_tuple(d.input, d.layout.sizes, d.layout.strides, dtype(d.layout.dtype),
                                           d.layout.device.str(), d.layout.wrapped));
            for (const runtime::CallPlan::Base& b : req->plan.bases)
              bases.append(py::make_tuple(b.numel, dtype(b.dtype), b.device.str()));
            for (const runtime::CallPlan::View& v : req->plan.views)
              views.append(py::make_tuple(v.input, v.base, v.sizes, v.strides, v.offset));
            py::dict plan;
            plan["direct"] = direct;
            plan["bases"] = bases;
            plan["views"] = views;
            return py::make_tuple(req->segment, describe_segment_body(*req->body), plan);
          },
          py::arg("wait_s"),
          "(segment, body, call plan) of a segment to compile, or None after wait_s")
      .def(
          "compiled",
          [](runtime::FusedExecutor& e, size_t segment, const std::string& path) {
            py::gil_scoped_release no_gil;  // loading runs the package's static initializers
            e.compiled(segment, path);
          },
          py::arg("segment"), py::arg("package_path"))
      .def("failed", &runtime::FusedExecutor::failed, py::arg("segment"), py::arg("reason"))
      .def("close", &runtime::FusedExecutor::close, py::call_guard<py::gil_scoped_release>(),
           "let every loaded package go (as a closed program does); segments report interpreted")
      .def("settling", &runtime::FusedExecutor::settling,
           "segments loaded but not yet checked, or still in their speed trial")
      .def("report",
           [](const runtime::FusedExecutor& e) {
             py::list out;
             for (const runtime::SegmentReport& s : e.report()) {
               py::dict d;
               d["ops"] = s.ops;
               d["state"] = s.state;
               d["reason"] = s.reason;
               d["compiled_runs"] = s.compiled_runs;
               d["interpreted_runs"] = s.interpreted_runs;
               d["max_difference"] = s.max_difference;
               d["compiled_us"] = s.compiled_us;  // the speed trial's medians (0 before it ends)
               d["interpreted_us"] = s.interpreted_us;
               d["first_run_us"] = s.first_run_us;
               d["package"] = s.package;
               d["inlined"] = s.inlined;  // its body runs in place of its call (waiting, or interpreted for good)
               out.append(d);
             }
             return out;
           })
      .def_property_readonly("text", [](const runtime::FusedExecutor& e) { return e.segmented().graph->toString(); })
      .def_property_readonly_static("rel_tolerance", [](py::object) { return runtime::FusedExecutor::kRelTolerance; })
      .def_property_readonly_static("abs_tolerance", [](py::object) { return runtime::FusedExecutor::kAbsTolerance; });
}

}  // namespace terra::python
