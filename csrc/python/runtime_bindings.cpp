// Python bindings of the co-execution runtime's building blocks (csrc/runtime): the _C.runtime
// submodule with Channel (ConcurrentChannel), GraphRunner, and Plan, which turns recordings into
// a graph plus what each recorded iteration must post and will fetch, so that a Python thread
// can drive the GraphRunner the way the PythonRunner will; and DirectGraph with the deferred
// runs of overlap mode (runtime/direct_graph.h), which the Dynamo backend drives.
//
// GIL rules: every call that can block releases the GIL, and waits run in short slices so that
// Ctrl-C (PyErr_CheckSignals) and timeouts work. Teardown of a GraphRunner joins its worker with
// the GIL released; at interpreter exit an atexit hook shuts down every live runner while the
// interpreter can still hand the GIL to the worker (and then closes every FusedExecutor, so that
// compiled packages' extracted folders are deleted), and a runner destroyed later (during
// finalization) is abandoned (worker detached) instead of joined.
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "capture/region.h"
#include "emit/captured_program.h"
#include "emit/channel.h"
#include "emit/graph_emitter.h"
#include "emit/scripted_channel.h"
#include "python/bindings.h"
#include "python/program_views.h"
#include "runtime/backward_replay.h"
#include "runtime/team_guard.h"
#include "runtime/channels.h"
#include "runtime/direct_graph.h"
#include "runtime/executor.h"
#include "runtime/feed_snapshot.h"
#include "runtime/fused_executor.h"
#include "runtime/graph_runner.h"
#include "runtime/worker_threads.h"
#include "trace/case_assignment.h"
#include "trace/replay.h"

namespace py = pybind11;

namespace terra::python {

namespace {

using capture::Region;
using runtime::ConcurrentChannel;
using runtime::DirectGraph;
using runtime::GraphRunner;
using Clock = std::chrono::steady_clock;

// ---- waiting from Python ----------------------------------------------------------------------

constexpr std::chrono::milliseconds kWaitSlice{50};

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

[[noreturn]] void raise_timeout(const std::string& what) {
  PyErr_SetString(PyExc_TimeoutError, ("terra_torch: timed out waiting for " + what).c_str());
  throw py::error_already_set();
}

// Calls `attempt(max_wait) -> bool` with the GIL released, in slices, until it returns true;
// between slices it lets Python handle signals. Raises TimeoutError after `timeout` seconds.
template <class Attempt>
void wait_in_slices(std::optional<double> timeout, const std::string& what, Attempt attempt) {
  const auto deadline =
      timeout ? Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(*timeout))
              : Clock::time_point::max();
  while (true) {
    std::chrono::nanoseconds slice = kWaitSlice;
    if (timeout) slice = std::clamp<std::chrono::nanoseconds>(deadline - Clock::now(), std::chrono::nanoseconds(0), slice);
    bool done = false;
    {
      py::gil_scoped_release no_gil;
      done = attempt(slice);
    }
    if (done) return;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (timeout && Clock::now() >= deadline) raise_timeout(what);
  }
}

// ---- Plan -------------------------------------------------------------------------------------

// The graph of a set of recordings and, per recording, the script of one iteration: the
// decisions, the feeds (slot, tensor or None) and the fetches (slot, tag) in record order. It
// builds the graph the same way _C.emit.Graph does (same passes, so the same slots); the
// PythonRunner will derive the same three streams from the Cursor as the program runs.
class Plan {
 public:
  Plan(std::vector<std::shared_ptr<Region>> regions, bool optimize) : regions_(std::move(regions)) {
    for (const auto& r : regions_) {
      TORCH_CHECK(r != nullptr && !r->is_open(), "terra_torch: Plan needs closed capture regions");
      program_.add(r->trace());
    }
    std::optional<trace::Program> structured;
    emitted_ = emit::emit_program(program_, structured, {.optimize = optimize});
    structured_ = std::move(*structured);
  }

  const std::shared_ptr<torch::jit::Graph>& graph() const { return emitted_.graph; }
  std::string text() const { return emitted_.graph->toString(); }
  size_t num_traces() const { return regions_.size(); }

  py::list feeds() const { return feed_table(emitted_); }
  py::list fetches() const { return fetch_table(emitted_); }
  py::list sites() const {
    py::list out;
    for (const auto& s : structured_.sites) out.append(s.kind == trace::SiteKind::kCaseSelect ? "case" : "loop");
    return out;
  }

  py::tuple script(uint32_t index, std::optional<std::vector<at::Tensor>> externals) const {
    TORCH_CHECK(index < regions_.size(), "terra_torch: Plan has no recording ", index);
    const Region& region = *regions_[index];
    const capture::Trace& captured = region.trace();
    const std::vector<at::Tensor> ext = externals ? std::move(*externals) : emit::external_tensors(region);
    TORCH_CHECK(ext.size() == captured.externals.size(), "terra_torch: recording ", index, " read ",
                captured.externals.size(), " external tensors, got ", ext.size());

    std::vector<trace::Decision> ds;
    TORCH_CHECK(trace::decisions_for(structured_, program_.trace(index), ds),
                "terra_torch: the generated program does not accept trace ", index);
    py::list decisions;
    for (const auto& d : ds) decisions.append(py::make_tuple(d.site, d.value));
    // (The channel keeps one queue per site, so the choices can follow the Program's decisions.)
    for (const auto& [site, choice] : emit::selections_for_trace(program_, index, structured_, emitted_))
      decisions.append(py::make_tuple(site, choice));

    // Slot numbering skips None inputs, as the translation and the emitter do.
    py::list feeds, fetches, scalars;
    const auto& nodes = program_.record_nodes(index);
    std::vector<std::pair<int64_t, int64_t>> posts;
    for (size_t i = 0; i < captured.ops.size(); ++i) {
      const capture::OpRecord& rec = captured.ops[i];
      // Python numbers fed per execution (terra::feed_scalar, feed_int, ...): the channel takes
      // each as a decision at kScalarKeyBase + slot.
      posts.clear();
      emit::append_scalar_posts(emitted_, nodes[i], rec, posts);
      for (const auto& [slot, value] : posts) scalars.append(py::make_tuple(runtime::kScalarKeyBase + slot, value));
      const bool read = emit::is_read_op(rec.op.schema());
      uint32_t s = 0;
      for (const capture::OpInput& input : rec.inputs) {
        if (emit::is_none_input(captured, input)) continue;
        const uint32_t slot_input = s++;
        if (read) {
          const int64_t slot = emitted_.fetch_slot(nodes[i], slot_input);
          TORCH_CHECK(slot >= 0, "terra_torch: record ", i, " is a read without a fetch slot");
          fetches.append(py::make_tuple(slot, emitted_.fetches[slot].tag));
        }
        const int64_t slot = emitted_.feed_slot(nodes[i], slot_input);
        if (slot < 0) {
          TORCH_CHECK(!input.value.is_external(), "terra_torch: record ", i, " reads an external tensor at input ",
                      slot_input, " but the graph has no feed there");
          continue;
        }
        if (input.value.is_external())
          feeds.append(py::make_tuple(slot, ext.at(input.value.external)));
        else
          feeds.append(py::make_tuple(slot, py::none()));
      }
    }
    return py::make_tuple(decisions, feeds, fetches, scalars);
  }

 private:
  std::vector<std::shared_ptr<Region>> regions_;  // own the traces and their external tensors
  emit::CapturedProgram program_;
  trace::Program structured_;
  emit::EmittedGraph emitted_;
};

// ---- GraphRunner ------------------------------------------------------------------------------

// Live runners, for the atexit hook, keyed by their Python wrapper. Weak: the hook must not keep
// a runner alive, and holds a strong reference only while it shuts one down (with the GIL
// released, another thread may drop the wrapper meanwhile). Touched only with the GIL held.
std::unordered_map<const void*, std::weak_ptr<GraphRunner>>& live_runners() {
  static auto* runners = new std::unordered_map<const void*, std::weak_ptr<GraphRunner>>();  // leaked: used at exit
  return *runners;
}

runtime::TorchScriptMode parse_mode(const std::string& mode) {
  TORCH_CHECK(mode == "interpreter" || mode == "graph_executor",
              "terra_torch: executor mode must be 'interpreter' or 'graph_executor', got '", mode, "'");
  return mode == "interpreter" ? runtime::TorchScriptMode::kInterpreter : runtime::TorchScriptMode::kGraphExecutor;
}

// `feeds_ready`: every feed is posted before Python waits for anything (a Plan's scripts), so
// segments may run across feeds (emit::SegmentOptions::feeds_ready).
std::shared_ptr<runtime::Executor> make_executor(const std::shared_ptr<torch::jit::Graph>& graph, const std::string& mode,
                                                 bool feeds_ready) {
  if (mode == "fused") return std::make_shared<runtime::FusedExecutor>(graph, emit::SegmentOptions{.feeds_ready = feeds_ready});
  return std::make_shared<runtime::TorchScriptExecutor>(graph, parse_mode(mode));
}

class PyGraphRunner {
 public:
  PyGraphRunner(const std::shared_ptr<torch::jit::Graph>& graph, std::shared_ptr<ConcurrentChannel> channel,
                const std::string& mode, bool feeds_ready) {
    TORCH_CHECK(graph != nullptr, "terra_torch: GraphRunner needs a graph");
    if (!channel) channel = std::make_shared<ConcurrentChannel>();
    executor_ = make_executor(graph, mode, feeds_ready);
    runner_ = std::make_shared<GraphRunner>(executor_, std::move(channel));
    live_runners().emplace(this, runner_);
  }

  // The executor when it is a FusedExecutor (mode "fused"), for its compiler; else None.
  std::shared_ptr<runtime::FusedExecutor> fused() const {
    return std::dynamic_pointer_cast<runtime::FusedExecutor>(executor_);
  }

  ~PyGraphRunner() {
    live_runners().erase(this);
    if (interpreter_finalizing()) {
      runner_->abandon();  // joining could wait forever for a worker that needs the GIL
    } else if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      runner_.reset();  // joins (unless the atexit hook holds it: then it joins there)
    }
    runner_.reset();
  }

  GraphRunner& get() { return *runner_; }

  void shutdown() {
    py::gil_scoped_release no_gil;
    runner_->shutdown();
  }

  void wait_iteration(std::optional<double> timeout) {
    wait_in_slices(timeout, "a graph iteration", [&](std::chrono::nanoseconds d) { return runner_->wait_iteration(d); });
  }
  void synchronize(std::optional<double> timeout) {
    wait_in_slices(timeout, "the graph iterations", [&](std::chrono::nanoseconds d) { return runner_->synchronize(d); });
  }

  py::dict stats() const {
    const runtime::RunnerStats r = runner_->stats();
    const runtime::ChannelStats c = runner_->channel()->stats();
    py::dict d;
    d["iterations_started"] = r.iterations_started;
    d["iterations_run"] = r.iterations_run;
    d["iterations_failed"] = r.iterations_failed;
    d["exec_ns"] = r.exec_ns;
    d["python_wait_ns"] = r.python_wait_ns;
    d["graph_stall_ns"] = c.graph_stall_ns;
    d["python_stall_ns"] = c.python_stall_ns;
    return d;
  }

 private:
  std::shared_ptr<runtime::Executor> executor_;
  std::shared_ptr<GraphRunner> runner_;
};

void shutdown_all_runners() {
  if (capture::forked_child()) return;  // (a fork's copies of the runners have no threads to join)
  try {
    runtime::wait_direct();  // launched runs finish while the interpreter can still hand out the GIL
  } catch (const std::exception&) {
  }
  std::vector<std::shared_ptr<GraphRunner>> runners;
  for (const auto& [wrapper, weak] : live_runners())
    if (auto r = weak.lock()) runners.push_back(std::move(r));
  py::gil_scoped_release no_gil;
  for (const auto& r : runners) r->shutdown();
  runtime::FusedExecutor::close_every_live();  // compiled packages' extracted folders go (fused_executor.h)
}

py::dict channel_stats(const ConcurrentChannel& c) {
  const runtime::ChannelStats s = c.stats();
  py::dict d;
  d["graph_stall_ns"] = s.graph_stall_ns;
  d["python_stall_ns"] = s.python_stall_ns;
  d["decisions"] = s.decisions;
  d["feeds"] = s.feeds;
  d["fetches"] = s.fetches;
  return d;
}

py::object graph_waiting_for(const ConcurrentChannel& c) {
  const auto w = c.graph_waiting_for();
  if (!w) return py::none();
  const char* kind = w->kind == runtime::GraphWait::Kind::kDecision ? "decision"
                     : w->kind == runtime::GraphWait::Kind::kGate   ? "gate"
                     : w->kind == runtime::GraphWait::Kind::kScalar ? "scalar"
                                                                     : "feed";
  return py::make_tuple(kind, w->id);
}

at::Tensor wait_fetch(ConcurrentChannel& c, int64_t slot, std::optional<double> timeout) {
  std::optional<at::Tensor> value;
  wait_in_slices(timeout, "fetch slot " + std::to_string(slot), [&](std::chrono::nanoseconds d) {
    value = c.wait_fetch(slot, d);
    return value.has_value();
  });
  return std::move(*value);
}

}  // namespace

void init_runtime(py::module_& m) {
  py::module_ r = m.def_submodule("runtime", "Co-execution runtime: channel and GraphRunner");

  r.def(
      "leaves_reached",
      [](std::vector<at::Tensor> roots) {
        runtime::BackwardCall call;
        call.roots = std::move(roots);
        return runtime::reach(call, /*whole_graph=*/true).leaves;
      },
      py::arg("roots"), "The leaves (AccumulateGrad variables) a backward() of `roots` would reach, hooks or not");
  r.def("tolerate_idle_reducer_hooks", &runtime::tolerate_idle_reducer_hooks, py::arg("leaves"), py::arg("idle"),
        "Whether DDP's reducer hooks on these leaves are idle, so do not stop a backward replay "
        "(runtime/backward_replay.h)");

  r.def("note_exported_memory", &runtime::note_exported_memory, py::arg("tensor"),
        "The tensor's memory was handed to Python as an array (numpy(), __array__, __dlpack__): "
        "Python may write it without an op from now on (runtime/feed_snapshot.h)");
  r.def("release_openmp_pool", &runtime::release_openmp_pool,
        "Gives the calling thread's OpenMP pool back: its idle team threads exit instead of spinning "
        "on the cores the graph worker needs (runtime/worker_threads.h)");
  r.def("can_release_openmp_pool", &runtime::can_release_openmp_pool,
        "Whether release_openmp_pool() can give a pool back with this OpenMP runtime");
  r.def(
      "team_guard",
      [] {
        const runtime::TeamGuardVerdicts v = runtime::team_guard_verdicts();
        py::dict d;
        d["installed"] = runtime::install_team_guard();
        d["same"] = v.same;
        d["differ"] = v.differ;
        d["large"] = v.large;
        d["calibration_ns"] = v.calibration_ns;
        d["why"] = v.why;
        return d;
      },
      "The process's verdicts on the layouts of the graph worker's guarded calls (runtime/team_guard.h)");

  py::class_<ConcurrentChannel, std::shared_ptr<ConcurrentChannel>>(r, "Channel")
      .def(py::init<>())
      .def("post_decision", &ConcurrentChannel::post_decision, py::arg("site"), py::arg("value"))
      .def("post_case", &ConcurrentChannel::post_case, py::arg("site"), py::arg("index"))
      .def("post_loop", &ConcurrentChannel::post_loop, py::arg("site"), py::arg("again"))
      .def(
          "post_feed",
          [](ConcurrentChannel& c, int64_t slot, std::optional<at::Tensor> t) {
            c.post_feed(slot, t ? std::move(*t) : at::Tensor());
          },
          py::arg("slot"), py::arg("tensor"), "None: the graph uses its own value (feed_or_none slots)")
      .def("wait_fetch", &wait_fetch, py::arg("slot"), py::arg("timeout") = py::none(),
           "The next value the graph publishes at `slot` (FIFO); TimeoutError after `timeout` s")
      .def("cancel", &ConcurrentChannel::cancel, py::arg("reason"))
      .def_property_readonly("cancelled", &ConcurrentChannel::cancelled)
      .def_property_readonly("cancel_reason", &ConcurrentChannel::cancel_reason)
      .def("reset", &ConcurrentChannel::reset, "Drop queued values and the cancel (no graph may be running)")
      .def("leftovers", &ConcurrentChannel::leftovers, "'' if nothing is queued in either direction")
      .def("graph_waiting_for", &graph_waiting_for, "None, or ('decision', site) / ('feed', slot)")
      .def_property_readonly("stats", &channel_stats);

  py::class_<Plan>(r, "Plan")
      .def(py::init<std::vector<std::shared_ptr<Region>>, bool>(), py::arg("regions"), py::arg("optimize") = true)
      .def_property_readonly("graph", &Plan::graph, "the generated torch._C.Graph")
      .def_property_readonly("text", &Plan::text)
      .def_property_readonly("num_traces", &Plan::num_traces)
      .def_property_readonly("feeds", &Plan::feeds, "[(node, input, optional)] per feed slot")
      .def_property_readonly("fetches", &Plan::fetches, "[(node, input, tag)] per fetch slot")
      .def_property_readonly("sites", &Plan::sites, "'case' or 'loop' per decision site")
      .def("script", &Plan::script, py::arg("index"), py::arg("externals") = py::none(),
           "(decisions [(site, value)], feeds [(slot, tensor|None)], fetches [(slot, tag)], scalars [(key, "
           "value)]: post_decision(key, value) each) of a recording");

  py::class_<DirectGraph, std::shared_ptr<DirectGraph>>(r, "DirectGraph")
      .def(py::init([](const Plan& plan, const std::string& mode, bool into_buffers) {
             const bool fused = mode == "fused";
             return std::make_shared<DirectGraph>(plan.graph(), fused ? runtime::TorchScriptMode::kInterpreter : parse_mode(mode),
                                                  into_buffers, fused);
           }),
           py::arg("plan"), py::arg("mode") = "interpreter", py::arg("into_buffers") = false,
           "mode: 'interpreter', 'graph_executor' or 'fused' (compiled segments, runtime/fused_executor.h)")
      .def_property_readonly("fused", &DirectGraph::fused, "the FusedExecutor of mode 'fused' (else None)")
      .def("launch", &runtime::launch_direct, py::arg("inputs"), py::arg("like"),
           "Queue a run on the deferred worker; returns output buffers shaped like `like`, filled when "
           "the run ends (the next op of any Python thread waits for that)")
      .def_property_readonly("feed_slots", &DirectGraph::feed_slots, "the feed slot of each input, in order")
      .def_property_readonly("fetch_slots", &DirectGraph::fetch_slots, "the fetch slot of each output, in order")
      .def_property_readonly("text", &DirectGraph::text)
      .def("run", &DirectGraph::run, py::arg("inputs"),
           "Run on the calling thread (GIL released): a value per feed slot in, a value per fetch slot out");

  py::class_<PyGraphRunner>(r, "GraphRunner")
      .def(py::init([](const Plan& plan, std::shared_ptr<ConcurrentChannel> channel, const std::string& mode) {
             return std::make_unique<PyGraphRunner>(plan.graph(), std::move(channel), mode, /*feeds_ready=*/true);
           }),
           py::arg("plan"), py::arg("channel") = py::none(), py::arg("mode") = "interpreter")
      .def(py::init([](const std::shared_ptr<torch::jit::Graph>& graph, std::shared_ptr<ConcurrentChannel> channel,
                       const std::string& mode) {
             return std::make_unique<PyGraphRunner>(graph, std::move(channel), mode, /*feeds_ready=*/false);
           }),
           py::arg("graph"), py::arg("channel") = py::none(), py::arg("mode") = "interpreter")
      .def_property_readonly("channel", [](PyGraphRunner& g) { return g.get().channel(); })
      .def_property_readonly("fused", &PyGraphRunner::fused, "the FusedExecutor of mode 'fused' (else None)")
      .def("start_iteration", [](PyGraphRunner& g) { return g.get().start_iteration(); })
      .def("wait_iteration", &PyGraphRunner::wait_iteration, py::arg("timeout") = py::none(),
           "Wait for the oldest unwaited iteration; re-raise its error")
      .def("synchronize", &PyGraphRunner::synchronize, py::arg("timeout") = py::none(),
           "Wait for every started iteration; re-raise the first error")
      .def("cancel", [](PyGraphRunner& g, const std::string& reason) { g.get().cancel(reason); }, py::arg("reason"))
      .def("reset", [](PyGraphRunner& g) { g.get().reset(); })
      .def("shutdown", &PyGraphRunner::shutdown)
      .def_property_readonly("is_shut_down", [](PyGraphRunner& g) { return g.get().is_shut_down(); })
      .def_property_readonly("in_flight", [](PyGraphRunner& g) { return g.get().in_flight(); })
      .def_property_readonly("stats", &PyGraphRunner::stats)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyGraphRunner& g, py::args) { g.shutdown(); });

  r.def("wait_direct", &runtime::wait_direct, "Wait for every launched direct run; re-raise the first error");
  r.def("direct_failed", &runtime::direct_failed, "A launched direct run failed (wait_direct raises it)");
  r.def("direct_pending", &runtime::direct_pending,
        "A launched direct run is in flight, or failed and wait_direct has not raised it yet");
  r.def("_shutdown_all", &shutdown_all_runners, "Shut down every live GraphRunner (atexit hook)");
  // atexit hooks run before finalization starts, while a worker can still take the GIL to free a
  // tensor; they run in reverse order of registration, so before torch's own.
  py::module_::import("atexit").attr("register")(r.attr("_shutdown_all"));
}

}  // namespace terra::python
