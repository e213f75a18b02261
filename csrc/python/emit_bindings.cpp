// Python bindings of graph generation (csrc/emit) and the executor interface (csrc/runtime):
// the _C.emit submodule that terra_torch/graph.py wraps. Records come in as capture regions;
// graphs come out as text, slot tables, and a way to run them on a recorded iteration.
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <map>
#include <memory>
#include <sstream>

#include "capture/region.h"
#include "emit/captured_program.h"
#include "emit/graph_emitter.h"
#include "emit/scripted_channel.h"
#include "python/bindings.h"
#include "runtime/executor.h"
#include "trace/case_assignment.h"
#include "trace/describe.h"
#include "trace/replay.h"

namespace py = pybind11;

namespace terra::python {

namespace {

using capture::Region;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The traces merged so far and the regions they came from (kept alive: they own the external
// tensors a replay feeds).
struct BuilderState {
  emit::CapturedProgram program;
  std::vector<std::shared_ptr<Region>> regions;
};

class PyGraph {
 public:
  PyGraph(std::shared_ptr<BuilderState> state, bool optimize) : state_(std::move(state)) {
    auto t0 = std::chrono::steady_clock::now();
    structured_ = trace::assign_cases(state_->program.graph());
    timings_["assign_cases_ms"] = ms_since(t0);
    emitted_ = emit::emit_graph(state_->program, structured_, {.optimize = optimize});
    timings_["emit_ms"] = emitted_.stats.emit_ms;
    timings_["optimize_ms"] = emitted_.stats.optimize_ms;  // passes + lint (lint alone if not optimizing)
    num_traces_ = state_->program.num_traces();
  }

  std::string text() const { return emitted_.graph->toString(); }

  py::list feeds() const {
    py::list out;
    for (const auto& f : emitted_.feeds) out.append(py::make_tuple(f.node, f.input, f.optional));
    return out;
  }

  py::list fetches() const {
    py::list out;
    for (const auto& f : emitted_.fetches) out.append(py::make_tuple(f.node, f.input, f.tag));
    return out;
  }

  py::dict stats() const {
    py::dict d;
    d["ops"] = emitted_.stats.ops;
    d["switches"] = emitted_.stats.switches;
    d["loops"] = emitted_.stats.loops;
    d["unrolled"] = emitted_.stats.unrolled;
    d["nodes"] = emitted_.stats.nodes_after_passes;
    d["tracegraph_nodes"] = state_->program.graph().num_nodes();
    for (const auto& [k, v] : timings_) d[py::str(k)] = v;
    return d;
  }

  py::list decisions(uint32_t index) const {
    check_index(index);
    std::vector<trace::Decision> ds;
    if (!trace::decisions_for(structured_, state_->program.trace(index), ds))
      throw std::runtime_error("terra_torch: the generated program does not accept trace " + std::to_string(index));
    py::list out;
    for (const auto& d : ds) out.append(py::make_tuple(d.site, d.value));
    return out;
  }

  // Runs the graph with trace `index`'s decisions and external tensors (or `externals`, indexed
  // like the region's). Returns [(fetch slot, tensor)] in fetch order.
  py::list run(uint32_t index, std::optional<std::vector<at::Tensor>> externals, const std::string& mode) {
    check_index(index);
    const Region& region = *state_->regions[index];
    std::vector<at::Tensor> feeds = externals ? std::move(*externals) : emit::external_tensors(region);
    emit::ScriptedChannel script =
        emit::script_for_trace(state_->program, index, structured_, emitted_, region.trace(), feeds);
    runtime::Executor& exec = executor(mode);
    {
      py::gil_scoped_release no_gil;
      emit::ChannelScope scope(&script);
      exec.run({});
    }
    const std::string left = script.leftovers();
    TORCH_CHECK(left.empty(), "terra_torch: the graph did not consume its whole script: ", left);
    py::list out;
    for (const auto& [slot, t] : script.fetched()) out.append(py::make_tuple(slot, t));
    return out;
  }

  std::string describe_program() const { return trace::describe(structured_); }
  std::string describe_tracegraph() const { return trace::describe(state_->program.graph()); }

 private:
  void check_index(uint32_t index) const {
    TORCH_CHECK(index < num_traces_, "terra_torch: trace ", index, " was added after this graph was built");
  }

  runtime::Executor& executor(const std::string& mode) {
    auto& slot = executors_[mode];
    if (!slot) {
      TORCH_CHECK(mode == "interpreter" || mode == "graph_executor",
                  "terra_torch: executor mode must be 'interpreter' or 'graph_executor', got '", mode, "'");
      slot = std::make_unique<runtime::TorchScriptExecutor>(
          emitted_.graph, mode == "interpreter" ? runtime::TorchScriptMode::kInterpreter
                                                : runtime::TorchScriptMode::kGraphExecutor);
    }
    return *slot;
  }

  std::shared_ptr<BuilderState> state_;
  trace::Program structured_;
  emit::EmittedGraph emitted_;
  size_t num_traces_ = 0;
  std::map<std::string, double> timings_;
  std::map<std::string, std::unique_ptr<runtime::Executor>> executors_;
};

// Parses TorchScript IR, runs the emitter's pass pipeline on it, returns the result: lets tests
// check that the channel ops survive the passes on graphs written by hand.
std::string optimize_ir(const std::string& ir) {
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(ir, graph.get());
  emit::optimize_graph(graph);
  return graph->toString();
}

}  // namespace

void init_emit(py::module_& m) {
  py::module_ e = m.def_submodule("emit", "TorchScript graph generation");

  py::class_<BuilderState, std::shared_ptr<BuilderState>>(e, "Builder")
      .def(py::init<>())
      .def(
          "add",
          [](BuilderState& s, std::shared_ptr<Region> region) {
            TORCH_CHECK(!region->is_open(), "terra_torch: close the region before adding its trace");
            const uint32_t index = s.program.add(region->trace());
            s.regions.push_back(std::move(region));
            return index;
          },
          py::arg("region"), "Merge a closed capture region's trace; returns its trace index")
      .def_property_readonly("num_traces", [](const BuilderState& s) { return s.program.num_traces(); })
      .def(
          "build",
          [](std::shared_ptr<BuilderState> s, bool optimize) { return std::make_unique<PyGraph>(std::move(s), optimize); },
          py::arg("optimize") = true, "Case assignment + graph generation over every trace added so far");

  py::class_<PyGraph>(e, "Graph")
      .def_property_readonly("text", &PyGraph::text)
      .def("__str__", &PyGraph::text)
      .def_property_readonly("feeds", &PyGraph::feeds, "[(node, input, optional)] per feed slot")
      .def_property_readonly("fetches", &PyGraph::fetches, "[(node, input, tag)] per fetch slot")
      .def_property_readonly("stats", &PyGraph::stats)
      .def("decisions", &PyGraph::decisions, py::arg("trace"))
      .def("run", &PyGraph::run, py::arg("trace"), py::arg("externals") = py::none(),
           py::arg("mode") = "interpreter")
      .def("describe_program", &PyGraph::describe_program)
      .def("describe_tracegraph", &PyGraph::describe_tracegraph);

  e.def("optimize_ir", &optimize_ir, py::arg("ir"));
  e.def("external_tensors", [](const std::shared_ptr<Region>& r) { return emit::external_tensors(*r); },
        py::arg("region"));
}

}  // namespace terra::python
