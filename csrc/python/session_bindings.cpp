// Python bindings of one co-executed program (runtime/session.h): _C.runtime.Session, which
// terra_torch/runtime.py drives through the phases. Blocking calls release the GIL inside the
// runtime (PythonRunner waits), so nothing here holds it across a wait.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>

#include "capture/region.h"
#include "python/bindings.h"
#include "python/program_views.h"
#include "trace/case_assignment.h"
#include "trace/dot.h"
#include "runtime/fused_executor.h"
#include "runtime/session.h"

namespace py = pybind11;

namespace terra::python {

namespace {

using runtime::Session;

py::dict session_stats(Session& s) {
  py::dict d;
  d["traces"] = s.num_traces();
  d["builds"] = s.builds();
  if (!s.has_runner()) return d;
  const runtime::PythonRunnerStats p = s.runner().stats();
  const runtime::RunnerStats g = s.runner().graph_stats();
  const runtime::ChannelStats c = s.runner().channel_stats();
  d["python_ops"] = p.ops;
  d["python_placeholders"] = p.placeholders;
  d["python_reads"] = p.reads;
  d["python_stall_ns"] = p.stall_ns;
  d["divergences"] = p.divergences;
  d["materialized"] = p.materialized;
  d["known_reads"] = p.known_reads;
  d["known_reads_waited"] = p.known_reads_waited;
  d["known_reads_published"] = p.known_reads_published;
  d["known_reads_close"] = p.known_reads_close;
  d["known_reads_recipe_waited"] = p.known_reads_recipe_waited;
  d["early_reads"] = p.early_reads;
  d["early_batches"] = p.early_batches;
  d["graph_iterations_run"] = g.iterations_run;
  d["graph_iterations_failed"] = g.iterations_failed;
  d["graph_exec_ns"] = g.exec_ns;
  d["graph_intra_op_threads"] = g.threads.intra_op;
  d["graph_blas_threads"] = g.threads.blas;
  d["graph_one_thread_calls"] = g.guarded.one_thread;
  d["graph_team_calls"] = g.guarded.team;
  d["graph_stall_ns"] = c.graph_stall_ns;
  d["decisions"] = c.decisions;
  d["feeds"] = c.feeds;
  // The stream the graph runs on (id 0 and no device: no stream policy, e.g. a CPU program).
  d["graph_stream_id"] = c.worker_stream ? c.worker_stream->id() : 0;
  d["graph_stream_device"] = c.worker_stream ? c.worker_stream->device().str() : std::string();
  d["table_size"] = s.runner().table_size();
  const runtime::PythonRunner::BackwardStats& b = s.runner().backward_stats();
  d["backward_replayed"] = b.replayed;
  d["backward_recorded"] = b.recorded;
  d["backward_per_op"] = b.per_op;
  d["backward_reason"] = b.reason;
  const runtime::PythonRunner::CallStats& c2 = s.runner().call_stats();
  d["calls_replayed"] = c2.replayed;
  d["calls_recorded"] = c2.recorded;
  d["calls_per_op"] = c2.per_op;
  d["calls_reason"] = c2.reason;
  d["outside_ops"] = s.runner().outside_ops();
  if (const emit::EmittedGraph* e = s.emitted()) {
    // Reads where the graph picks the producer Python read, and ops checked before it runs them.
    d["selected_reads"] = e->num_selections;
    d["checked_ops"] = e->gated_checks.size();
  }
  return d;
}

py::dict structure(const Session& s) {
  return structure_of(s.program().graph(), trace::assign_cases(s.program().graph()), s.num_traces());
}

std::string session_dot(const Session& s, const std::string& title) {
  const trace::TraceGraph& g = s.program().graph();
  const trace::Program structured = trace::assign_cases(g);
  const std::string torch_dir = torch_package_dir();
  std::vector<std::string> sources(g.num_nodes());
  for (trace::NodeId n = 0; n < g.num_nodes() && n < s.node_frames().size(); ++n)
    sources[n] = user_source(s.node_frames()[n], torch_dir);
  trace::DotNames names;
  names.label = [&s](trace::NodeId n) {
    const emit::OpInfo* info = s.program().info(n);
    return info ? c10::toString(info->op.operator_name()) : std::string();
  };
  names.source = [&sources](trace::NodeId n) { return n < sources.size() ? sources[n] : std::string(); };
  return trace::to_dot(g, structured, names, {.title = title});
}

}  // namespace

void init_session(py::module_& m) {
  py::module_ r = m.attr("runtime").cast<py::module_>();
  py::class_<Session, std::shared_ptr<Session>>(r, "Session")
      .def(py::init([](const std::string& mode, bool optimize, bool fused, bool keep_traces) {
             TORCH_CHECK(mode == "coexec" || mode == "lazy", "terra_torch: mode must be 'coexec' or 'lazy', got '",
                         mode, "'");
             runtime::SessionOptions o;
             o.drive = mode == "lazy" ? runtime::Drive::kLazy : runtime::Drive::kCoExec;
             o.optimize = optimize;
             o.fused = fused;
             o.keep_traces = keep_traces;
             return std::make_shared<Session>(o);
           }),
           py::arg("mode") = "coexec", py::arg("optimize") = false, py::arg("fused") = false,
           py::arg("keep_traces") = false)
      .def("export_program", &Session::export_program,
           "The merged traces as JSON text for import_program in a later run (warm start); ValueError "
           "naming what cannot be kept")
      .def("import_program", &Session::import_program, py::arg("text"),
           "Merge the traces of an export_program text into this new session; ValueError if unreadable")
      .def_property_readonly("fused", &Session::fused_executor, "the current graph's FusedExecutor, or None")
      .def("add", &Session::add, py::arg("region"), "Merge a closed region's trace; True if it was already covered")
      .def("build", &Session::build, "Generate the graph and start its runner")
      .def_property_readonly("has_runner", &Session::has_runner)
      .def_property_readonly("num_traces", &Session::num_traces)
      .def(
          "open",
          [](Session& s, py::object stop_frame, bool ignore_outermost_loops, int64_t iteration) {
            auto* frame = stop_frame.is_none() ? nullptr : reinterpret_cast<PyFrameObject*>(stop_frame.ptr());
            return s.open_region(frame, ignore_outermost_loops, iteration);
          },
          py::arg("stop_frame"), py::arg("ignore_outermost_loops") = false, py::arg("iteration") = -1)
      .def(
          "close", [](Session& s, capture::Region& region, bool partial) { return s.close_region(region, partial); },
          py::arg("region"), py::arg("partial") = false)
      .def(
          "backward_begin",
          [](Session& s, capture::Region& region, const std::vector<std::optional<at::Tensor>>& roots,
             const std::vector<std::optional<at::Tensor>>& grads, bool keep_graph, bool create_graph, bool has_inputs,
             bool accumulate_grad) -> std::string {
            if (!s.has_runner()) return "per_op";
            runtime::BackwardCall call;
            for (const auto& t : roots) call.roots.push_back(t.value_or(at::Tensor()));
            for (const auto& g : grads) call.grads.push_back(g.value_or(at::Tensor()));
            call.keep_graph = keep_graph;
            call.create_graph = create_graph;
            call.has_inputs = has_inputs;
            call.accumulate_grad = accumulate_grad;
            runtime::PythonRunner::BackwardPath path;
            {
              py::gil_scoped_release no_gil;  // posts and value-table locks, as on the per-op path
              path = s.runner().begin_backward(region, call);
            }
            switch (path) {
              case runtime::PythonRunner::BackwardPath::kReplayed:
                return "replayed";
              case runtime::PythonRunner::BackwardPath::kRecording:
                return "recording";
              default:
                return "per_op";
            }
          },
          py::arg("region"), py::arg("roots"), py::arg("grads"), py::arg("keep_graph"), py::arg("create_graph"),
          py::arg("has_inputs"), py::arg("accumulate_grad"),
          "Before the autograd engine runs in a co-executed iteration: 'replayed' (done, do not run it), "
          "'recording' or 'per_op' (run it, then backward_end)")
      .def(
          "backward_end",
          [](Session& s, capture::Region& region, bool completed) {
            if (s.has_runner()) s.runner().end_backward(region, completed);
          },
          py::arg("region"), py::arg("completed"))
      .def(
          "call_begin",
          [](Session& s, capture::Region& region, int64_t key, const std::vector<std::optional<at::Tensor>>& arguments,
             const std::vector<double>& numbers, const std::vector<std::pair<at::Tensor, double>>& known_after)
              -> py::tuple {
            if (!s.has_runner()) return py::make_tuple("per_op", py::none());
            std::vector<at::Tensor> tensors;
            tensors.reserve(arguments.size());
            for (const auto& t : arguments) tensors.push_back(t.value_or(at::Tensor()));
            runtime::PythonRunner::CallPath path;
            at::Tensor result;
            {
              py::gil_scoped_release no_gil;  // posts and value-table locks, as on the per-op path
              path = s.runner().begin_call(region, key, tensors, numbers, known_after, result);
            }
            switch (path) {
              case runtime::PythonRunner::CallPath::kReplayed:
                return py::make_tuple("replayed", result.defined() ? py::cast(result) : py::none());
              case runtime::PythonRunner::CallPath::kRecording:
                return py::make_tuple("recording", py::none());
              default:
                return py::make_tuple("per_op", py::none());
            }
          },
          py::arg("region"), py::arg("key"), py::arg("arguments"), py::arg("numbers") = std::vector<double>(),
          py::arg("known_after") = std::vector<std::pair<at::Tensor, double>>(),
          "A keyed call in co-execution, an optimizer's step() (csrc/runtime/call_replay.h): ('replayed', "
          "what it returns; do not run it), ('recording', None) or ('per_op', None) (run it, then call_end)")
      .def(
          "known_numbers",
          [](Session& s, const std::vector<std::optional<at::Tensor>>& tensors) -> py::list {
            py::list out;
            if (!s.has_runner()) {
              for (size_t i = 0; i < tensors.size(); ++i) out.append(py::none());
              return out;
            }
            std::vector<at::Tensor> ts;
            for (const auto& t : tensors) ts.push_back(t.value_or(at::Tensor()));
            for (const auto& v : s.runner().known_numbers(ts)) out.append(v ? py::cast(*v) : py::none());
            return out;
          },
          py::arg("tensors"),
          "The values Python knows for these one-element tensors (optimizer step counters), read without an op "
          "and without waiting for the graph; None where it knows none")
      .def(
          "call_end",
          [](Session& s, capture::Region& region, bool completed, bool replayable, py::object result) {
            if (!s.has_runner()) return false;
            at::Tensor t;
            if (THPVariable_Check(result.ptr())) t = THPVariable_Unpack(result.ptr());
            return s.runner().end_call(region, completed, replayable, t);
          },
          py::arg("region"), py::arg("completed"), py::arg("replayable"), py::arg("result") = py::none())
      .def("divergence",
           [](Session& s) -> py::object {
             if (!s.has_runner() || !s.runner().diverged()) return py::none();
             return py::make_tuple(s.runner().divergence_reason(), s.runner().divergence_record());
           })
      .def_property_readonly("last_uncovered", &Session::last_uncovered,
                             "Record index where the last merged trace left the program (-1: covered)")
      .def("diverged_at_unsupported",
           [](Session& s) { return s.has_runner() && s.runner().diverged_at_unsupported(); },
           "The last iteration diverged at a node the graph cannot express: building again would not help")
      .def("unsupported",
           [](Session& s) {
             py::list out;
             if (const auto* e = s.emitted())
               for (const auto& [node, reason] : e->unsupported) out.append(py::make_tuple(node, reason));
             return out;
           },
           "(node, reason) of every op the generated graph could not express")
      .def(
          "synchronize",
          [](Session& s, bool finish) {
            if (s.has_runner()) s.runner().synchronize(finish);
          },
          py::arg("finish") = true)
      .def(
          "release_worker_pool",
          [](Session& s) {
            if (s.has_runner()) s.runner().release_worker_pool();
          },
          "the program runs on the Python thread for now: the graph worker gives its OpenMP pool back once idle")
      .def(
          "catch_up",
          [](Session& s) {
            if (s.has_runner()) s.runner().catch_up();  // (holding the GIL, as materialize)
          },
          "wait until the graph has run every op Python validated (nothing is materialized)")
      .def(
          "materialize",
          [](Session& s, const at::Tensor& t) {
            if (s.has_runner()) s.runner().materialize(t);
          },
          py::arg("tensor"))
      .def("shut_down", &Session::shut_down)
      .def_property_readonly("graph",
                             [](const Session& s) -> py::object {
                               if (s.emitted() == nullptr) return py::none();
                               return py::cast(s.emitted()->graph);
                             })
      .def_property_readonly("text",
                             [](const Session& s) -> std::string {
                               return s.emitted() ? s.emitted()->graph->toString() : std::string();
                             })
      .def_property_readonly("stats", &session_stats)
      .def(
          "iteration_spans",
          [](const Session& s) {
            py::list out;
            for (const Session::IterationSpan& i : s.iteration_spans())
              out.append(py::make_tuple(i.iteration, i.start_ns, i.end_ns, i.stall_ns, i.decisions, i.feeds, i.reads));
            return out;
          },
          "(iteration, start_ns, end_ns, stall_ns, decisions, feeds, python_reads) per co-executed iteration, "
          "the latest 200,000")
      .def(
          "python_times", [](const Session& s) { return py::make_tuple(s.python_exec_ns(), s.python_stall_ns()); },
          "(exec_ns, stall_ns): Python's time in co-executed iterations minus its stalls, and its stalls")
      .def_property_readonly("structure", &structure)
      .def("to_dot", &session_dot, py::arg("title") = "")
      .def("graph_spans", [](Session& s) {
        return s.has_runner() ? s.runner().graph_spans() : std::vector<std::pair<int64_t, int64_t>>{};
      });
}

}  // namespace terra::python
