// Python bindings of graph generation (csrc/emit) and the executor interface (csrc/runtime):
// the _C.emit submodule that terra_torch/graph.py wraps. Records come in as capture regions;
// graphs come out as text, slot tables, a Graphviz picture (trace/dot.h), the torch._C.Graph, and
// a way to run them on a recorded iteration.
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "capture/region.h"
#include "emit/captured_program.h"
#include "emit/graph_emitter.h"
#include "emit/scripted_channel.h"
#include "emit/segments.h"
#include "python/bindings.h"
#include "python/program_views.h"
#include "runtime/executor.h"
#include "runtime/fused_executor.h"
#include "trace/case_assignment.h"
#include "trace/describe.h"
#include "trace/dot.h"
#include "trace/replay.h"

namespace py = pybind11;

namespace terra::python {

namespace {

using capture::Region;

// The frame a user recognises as their line, picked as debug.Location.user_frame picks it: the
// innermost frame outside torch's own Python, skipping the "backward: ..." entry that backward
// ops append to their forward op's frames. Returned short ("train.py:12"), since it labels a
// node in a picture; backward ops say so, because they share their forward op's line.
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
    std::optional<trace::Program> structured;
    emitted_ = emit::emit_program(state_->program, structured, {.optimize = optimize});
    structured_ = std::move(*structured);
    // Case assignment of every round (a round that flattens loops assigns and emits again), and
    // the emission attempts that asked for flattening.
    timings_["assign_cases_ms"] = ms_since(t0) - emitted_.stats.emit_ms - emitted_.stats.optimize_ms;
    timings_["emit_ms"] = emitted_.stats.emit_ms;
    timings_["optimize_ms"] = emitted_.stats.optimize_ms;  // passes + lint (lint alone if not optimizing)
    num_traces_ = state_->program.num_traces();
  }

  std::string text() const { return emitted_.graph->toString(); }

  py::list feeds() const { return feed_table(emitted_); }
  py::list fetches() const { return fetch_table(emitted_); }

  py::dict stats() const {
    py::dict d;
    d["ops"] = emitted_.stats.ops;
    d["switches"] = emitted_.stats.switches;
    d["loops"] = emitted_.stats.loops;
    d["unrolled"] = emitted_.stats.unrolled;
    d["selected_reads"] = emitted_.num_selections;
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

  // What the TraceGraph and the program hold, counted once each (the emitter's stats count
  // emitted constructs, so a loop inside an unrolled loop counts once per copy there).
  py::dict structure() const { return structure_of(state_->program.graph(), structured_, num_traces_); }

  // The executor of mode "fused" (made on first use): its segments compile while runs go on.
  const std::shared_ptr<runtime::FusedExecutor>& fused() {
    if (!fused_) fused_ = std::make_shared<runtime::FusedExecutor>(emitted_.graph, emit::SegmentOptions{.feeds_ready = true});
    return fused_;
  }

  // The TorchScript graph itself, shared with this object (what _C.runtime.GraphRunner takes).
  const std::shared_ptr<torch::jit::Graph>& graph() const { return emitted_.graph; }

  // Graphviz DOT of the TraceGraph as case assignment structured it, with operator names and
  // the user's source lines. Needs the GIL (locations are described from Python code objects).
  std::string to_dot(const std::string& title) {
    const trace::TraceGraph& g = state_->program.graph();
    // A node's location is on every record merged into it; the first one found is enough.
    std::vector<std::pair<uint32_t, uint32_t>> record_of(g.num_nodes(), {UINT32_MAX, 0});
    for (uint32_t t = 0; t < num_traces_; ++t) {
      const auto& nodes = state_->program.record_nodes(t);
      for (uint32_t i = 0; i < nodes.size(); ++i) {
        if (record_of[nodes[i]].first == UINT32_MAX) record_of[nodes[i]] = {t, i};
      }
    }
    const std::string torch_dir = torch_package_dir();
    std::vector<std::string> sources(g.num_nodes());
    for (trace::NodeId n = 0; n < g.num_nodes(); ++n) {
      const auto [t, i] = record_of[n];
      if (t == UINT32_MAX) continue;
      Region& region = *state_->regions[t];
      sources[n] = user_source(region.locations().describe(region.trace().ops[i].location), torch_dir);
    }
    // Loop ids are hashes with no line of their own; the first op of the body places the loop.
    auto first_op = [&g](trace::NodeId loop) {
      trace::NodeId n = loop;
      while (n != trace::kNoNode && g.node(n).kind == trace::NodeKind::kLoop) {
        const auto& kids = g.node(g.graph(g.node(n).body).start).children;
        n = kids.empty() ? trace::kNoNode : kids.front();
      }
      return n != trace::kNoNode && g.node(n).kind == trace::NodeKind::kOp ? n : trace::kNoNode;
    };
    trace::DotNames names;
    names.label = [this](trace::NodeId n) {
      const emit::OpInfo* info = state_->program.info(n);
      return info ? c10::toString(info->op.operator_name()) : std::string();
    };
    names.source = [&](trace::NodeId n) {
      if (g.node(n).kind != trace::NodeKind::kLoop) return sources[n];
      const trace::NodeId op = first_op(n);
      return op == trace::kNoNode || sources[op].empty() ? std::string() : "body starts at " + sources[op];
    };
    return trace::to_dot(g, structured_, names, {.title = title});
  }

  std::string describe_program() const { return trace::describe(structured_); }
  std::string describe_tracegraph() const { return trace::describe(state_->program.graph()); }

 private:
  void check_index(uint32_t index) const {
    TORCH_CHECK(index < num_traces_, "terra_torch: trace ", index, " was added after this graph was built");
  }

  runtime::Executor& executor(const std::string& mode) {
    if (mode == "fused") return *fused();
    auto& slot = executors_[mode];
    if (!slot) {
      TORCH_CHECK(mode == "interpreter" || mode == "graph_executor",
                  "terra_torch: executor mode must be 'interpreter', 'graph_executor' or 'fused', got '", mode, "'");
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
  std::shared_ptr<runtime::FusedExecutor> fused_;
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
      .def_property_readonly("feeds", &PyGraph::feeds, "[(node, input, optional, written)] per feed slot")
      .def_property_readonly("fetches", &PyGraph::fetches, "[(node, input, tag)] per fetch slot")
      .def_property_readonly("stats", &PyGraph::stats)
      .def("decisions", &PyGraph::decisions, py::arg("trace"))
      .def("run", &PyGraph::run, py::arg("trace"), py::arg("externals") = py::none(),
           py::arg("mode") = "interpreter")
      .def("describe_program", &PyGraph::describe_program)
      .def("describe_tracegraph", &PyGraph::describe_tracegraph)
      .def_property_readonly("structure", &PyGraph::structure,
                             "counts of the TraceGraph (nodes, ops, loops, branch/merge points) and program")
      .def_property_readonly("fused", &PyGraph::fused, "the executor of run(mode='fused'): compiled segments")
      .def_property_readonly("graph", &PyGraph::graph, "the generated torch._C.Graph (shared, not a copy)")
      .def("to_dot", &PyGraph::to_dot, py::arg("title") = "",
           "Graphviz DOT of the TraceGraph and its switches and loops, with op names and source lines");

  e.def("optimize_ir", &optimize_ir, py::arg("ir"));
  e.def(
      "scalar_operands",
      [] {
        py::list out;
        for (const emit::ScalarOperand& s : emit::scalar_operands()) out.append(py::make_tuple(s.op, s.overload, s.argument));
        return out;
      },
      "[(op, overload, argument)]: the Scalar arguments a segment may take at run time (emit/segments.h)");
  e.def("external_tensors", [](const std::shared_ptr<Region>& r) { return emit::external_tensors(*r); },
        py::arg("region"));
}

}  // namespace terra::python
