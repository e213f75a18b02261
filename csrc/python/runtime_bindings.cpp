// Python bindings of the co-execution runtime's building blocks (csrc/runtime): the _C.runtime
// submodule with Channel (ConcurrentChannel), GraphRunner, and Plan, which turns recordings into
// a graph plus what each recorded iteration must post and will fetch, so that a Python thread
// can drive the GraphRunner the way the PythonRunner will.
//
// GIL rules: every call that can block releases the GIL, and waits run in short slices so that
// Ctrl-C (PyErr_CheckSignals) and timeouts work. Teardown of a GraphRunner joins its worker with
// the GIL released; at interpreter exit an atexit hook shuts down every live runner while the
// interpreter can still hand the GIL to the worker, and a runner destroyed later (during
// finalization) is abandoned (worker detached) instead of joined.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/thread_name.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "capture/region.h"
#include "emit/captured_program.h"
#include "emit/channel.h"
#include "emit/graph_emitter.h"
#include "python/bindings.h"
#include "python/program_views.h"
#include "runtime/channels.h"
#include "runtime/executor.h"
#include "runtime/graph_runner.h"
#include "trace/case_assignment.h"
#include "trace/replay.h"

namespace py = pybind11;

namespace terra::python {

namespace {

using capture::Region;
using runtime::ConcurrentChannel;
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

    // Slot numbering skips None inputs, as the translation and the emitter do.
    py::list feeds, fetches;
    const auto& nodes = program_.record_nodes(index);
    for (size_t i = 0; i < captured.ops.size(); ++i) {
      const capture::OpRecord& rec = captured.ops[i];
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
    return py::make_tuple(decisions, feeds, fetches);
  }

 private:
  std::vector<std::shared_ptr<Region>> regions_;  // own the traces and their external tensors
  emit::CapturedProgram program_;
  trace::Program structured_;
  emit::EmittedGraph emitted_;
};

// ---- DirectGraph ------------------------------------------------------------------------------

// A generated graph of one straight-line trace, rewritten so that its feeds are graph inputs
// and its fetches graph outputs, and run on the calling thread. For a static graph (what a
// Dynamo backend gets) a channel adds nothing: every call feeds the same slots and reads the
// same fetches. Outputs leave by reference, so views and shared memory survive, where a fetch
// would publish a copy (docs/DYNAMO_BACKEND.md, mode "graph").
class DirectGraph {
 public:
  // `into_buffers`: fetches become copies into extra inputs (one buffer per fetch slot, after
  // the feeds) instead of outputs, so that a deferred run can write values Python already holds.
  DirectGraph(const std::shared_ptr<torch::jit::Graph>& generated, const std::string& mode, bool into_buffers)
      : into_buffers_(into_buffers) {
    TORCH_CHECK(generated != nullptr, "terra_torch: DirectGraph needs a graph");
    graph_ = generated->copy();
    lift_channel_ops();
    executor_ = std::make_unique<runtime::TorchScriptExecutor>(graph_, parse_executor_mode(mode));
  }

  bool into_buffers() const { return into_buffers_; }
  // Runs with inputs already converted (feeds, then buffers); no GIL needed.
  void run_stack(std::vector<c10::IValue> stack) { executor_->run(std::move(stack)); }

  const std::vector<int64_t>& feed_slots() const { return feed_slots_; }
  const std::vector<int64_t>& fetch_slots() const { return fetch_slots_; }
  std::string text() const { return graph_->toString(); }

  // One value per feed slot (in feed_slots order; None for a feed_or_none slot that takes the
  // graph's own none), one result per fetch slot (fetch_slots order).
  std::vector<std::optional<at::Tensor>> run(const std::vector<std::optional<at::Tensor>>& inputs) {
    TORCH_CHECK(inputs.size() == feed_slots_.size(), "terra_torch: DirectGraph takes ", feed_slots_.size(),
                " inputs, got ", inputs.size());
    std::vector<c10::IValue> stack;
    stack.reserve(inputs.size());
    for (const auto& t : inputs) stack.emplace_back(t ? c10::IValue(*t) : c10::IValue());
    std::vector<c10::IValue> results;
    {
      // Ops may run long; a tensor dying in the graph may need the GIL to free its PyObject.
      py::gil_scoped_release no_gil;
      results = executor_->run(std::move(stack));
    }
    std::vector<std::optional<at::Tensor>> out;
    out.reserve(results.size());
    for (auto& v : results) out.push_back(v.isTensor() ? std::optional<at::Tensor>(std::move(v).toTensor()) : std::nullopt);
    return out;
  }

 private:
  static runtime::TorchScriptMode parse_executor_mode(const std::string& mode);

  // Feeds and fetches inside a prim::If or prim::Loop run a data-dependent number of times:
  // they cannot become inputs or outputs, and such a graph is not a static one.
  static void refuse_nested(torch::jit::Block* block, bool nested) {
    for (torch::jit::Node* n : block->nodes()) {
      const std::string kind = n->kind().toQualString();
      TORCH_CHECK(!nested || (kind != emit::kFeedOp && kind != emit::kFeedOrNoneOp && kind != emit::kFetchOp),
                  "terra_torch: DirectGraph: ", kind, " inside a control-flow block");
      for (torch::jit::Block* b : n->blocks()) refuse_nested(b, true);
    }
  }

  static int64_t slot_of(torch::jit::Node* n) {
    const auto slot = torch::jit::toIValue(n->input(0));
    TORCH_CHECK(slot && slot->isInt(), "terra_torch: DirectGraph: ", n->kind().toQualString(), " without a constant slot");
    return slot->toInt();
  }

  void lift_channel_ops() {
    refuse_nested(graph_->block(), false);
    std::map<int64_t, torch::jit::Node*> feeds, fetches;
    for (torch::jit::Node* n : graph_->block()->nodes()) {
      const std::string kind = n->kind().toQualString();
      if (kind == emit::kFeedOp || kind == emit::kFeedOrNoneOp) {
        TORCH_CHECK(feeds.emplace(slot_of(n), n).second, "terra_torch: DirectGraph: feed slot fed twice");
      } else if (kind == emit::kFetchOp) {
        TORCH_CHECK(fetches.emplace(slot_of(n), n).second, "terra_torch: DirectGraph: fetch slot read twice");
      }
    }
    for (auto& [slot, n] : feeds) {
      torch::jit::Value* input = graph_->addInput();
      input->setType(n->output()->type());
      n->output()->replaceAllUsesWith(input);
      n->destroy();
      feed_slots_.push_back(slot);
    }
    for (auto& [slot, n] : fetches) {
      if (into_buffers_) {
        torch::jit::Value* buffer = graph_->addInput();
        buffer->setType(c10::TensorType::get());
        torch::jit::WithInsertPoint here(n);
        torch::jit::Value* no = graph_->insertConstant(false);
        torch::jit::Node* copy = graph_->create(c10::Symbol::fromQualString("aten::copy_"), {buffer, n->input(1), no}, 1);
        copy->output()->setType(c10::TensorType::get());
        graph_->insertNode(copy);
      } else {
        graph_->registerOutput(n->input(1));
      }
      n->destroy();
      fetch_slots_.push_back(slot);
    }
  }

  bool into_buffers_ = false;
  std::shared_ptr<torch::jit::Graph> graph_;
  std::unique_ptr<runtime::TorchScriptExecutor> executor_;
  std::vector<int64_t> feed_slots_;
  std::vector<int64_t> fetch_slots_;
};

// ---- deferred direct runs ---------------------------------------------------------------------

// Direct graphs launched without waiting (docs/DYNAMO_BACKEND.md, "Overlap"): one process-wide
// worker runs them in launch order, each writing into output buffers Python already holds.
// Nothing marks those buffers (an extra dispatch key would fail Dynamo's tensor guards), so the
// wait is tied to ops instead: a global RecordFunction callback makes the first op of any
// Python thread wait until every launched run has finished. Ops on other threads (the worker,
// intra-op pools) do not wait; they never touch Python's values before Python's own ops do.
thread_local bool t_no_direct_wait = false;

class DirectWorker {
 public:
  static DirectWorker& get() {
    static auto* worker = new DirectWorker();  // leaked: its thread may outlive static destruction
    return *worker;
  }

  bool pending() const { return pending_.load(std::memory_order_acquire) > 0; }

  // Called with the GIL held. The job keeps its own references to the tensors Python passed
  // and got back: the worker never drops the last one, because a tensor whose Python object
  // outlived Python's references frees that object under the GIL, and the worker would then
  // stall until the Python thread's next switch interval. Finished jobs' references are
  // dropped here and in release_finished(), on the Python thread.
  void launch(std::shared_ptr<DirectGraph> graph, std::vector<c10::IValue> stack) {
    ensure_started();
    std::vector<c10::IValue> keep = stack;
    std::vector<std::vector<c10::IValue>> finished;
    {
      std::lock_guard lock(mu_);
      queue_.push_back({std::move(graph), std::move(stack), std::move(keep), at::get_num_threads()});
      pending_.fetch_add(1, std::memory_order_release);
      finished.swap(finished_);
    }
    work_cv_.notify_one();
  }

  void release_finished() {
    std::vector<std::vector<c10::IValue>> finished;
    std::lock_guard lock(mu_);
    finished.swap(finished_);
  }

  // Waits for every launched run; rethrows the first error since the last wait (once).
  void wait() {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  bool failed() {
    std::lock_guard lock(mu_);
    return error_ != nullptr;
  }

  // For the op callback: waits, and leaves an error for wait() to raise. RecordFunction turns
  // an exception from a start callback into a logged warning, so raising it there would lose it.
  void wait_idle() {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
  }

 private:
  struct Job {
    std::shared_ptr<DirectGraph> graph;
    std::vector<c10::IValue> stack;
    std::vector<c10::IValue> keep;  // Python's tensors, released on the Python thread
    int threads;                     // the launching thread's intra-op thread count
  };

  void ensure_started() {
    std::call_once(started_, [&] {
      std::thread([this] { loop(); }).detach();
      at::addGlobalCallback(at::RecordFunctionCallback(&wait_before_op)
                                .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
    });
  }

  void loop() {
    c10::setThreadName("terra_direct");
    t_no_direct_wait = true;
    while (true) {
      Job job;
      {
        std::unique_lock lock(mu_);
        work_cv_.wait(lock, [&] { return !queue_.empty(); });
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      // A new thread's OpenMP team is the library default (all cores), not what the program set
      // with torch.set_num_threads; an oversized team on a busy machine stalls at its barriers.
      if (at::get_num_threads() != job.threads) at::set_num_threads(job.threads);
      try {
        job.graph->run_stack(std::move(job.stack));
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard lock(mu_);
        finished_.push_back(std::move(job.keep));
        if (error && !error_) error_ = error;
        pending_.fetch_sub(1, std::memory_order_release);
      }
      done_cv_.notify_all();
    }
  }

  static std::unique_ptr<at::ObserverContext> wait_before_op(const at::RecordFunction&) {
    DirectWorker& w = get();
    if (!w.pending() || t_no_direct_wait) return nullptr;
    if (PyGILState_GetThisThreadState() == nullptr) return nullptr;  // not a Python thread
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;  // the worker may need the GIL to free a tensor
      w.wait_idle();
    } else {
      w.wait_idle();
    }
    return nullptr;
  }

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Job> queue_;
  std::vector<std::vector<c10::IValue>> finished_;
  std::atomic<int64_t> pending_{0};
  std::exception_ptr error_;
  std::once_flag started_;
};

// Allocates the output buffers and queues the run; returns the buffers (per fetch slot).
std::vector<at::Tensor> launch_direct(const std::shared_ptr<DirectGraph>& graph,
                                      const std::vector<std::optional<at::Tensor>>& inputs,
                                      const std::vector<at::Tensor>& like) {
  TORCH_CHECK(graph->into_buffers(), "terra_torch: launch needs a DirectGraph made with into_buffers=True");
  TORCH_CHECK(inputs.size() == graph->feed_slots().size() && like.size() == graph->fetch_slots().size(),
              "terra_torch: launch: wrong number of inputs or buffer templates");
  std::vector<c10::IValue> stack;
  stack.reserve(inputs.size() + like.size());
  for (const auto& t : inputs) stack.emplace_back(t ? c10::IValue(*t) : c10::IValue());
  std::vector<at::Tensor> buffers;
  buffers.reserve(like.size());
  {
    // Fresh memory of our own: allocating it need not wait for runs still in flight.
    const bool saved = t_no_direct_wait;
    t_no_direct_wait = true;
    for (const auto& t : like) buffers.push_back(at::empty_strided(t.sizes(), t.strides(), t.options()));
    t_no_direct_wait = saved;
  }
  for (const auto& b : buffers) stack.emplace_back(b);
  DirectWorker::get().launch(graph, std::move(stack));
  return buffers;
}

void wait_direct() {
  DirectWorker& w = DirectWorker::get();
  if (w.pending() || w.failed()) {
    py::gil_scoped_release no_gil;
    w.wait();
  }
  w.release_finished();
}

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

runtime::TorchScriptMode DirectGraph::parse_executor_mode(const std::string& mode) { return parse_mode(mode); }

class PyGraphRunner {
 public:
  PyGraphRunner(const std::shared_ptr<torch::jit::Graph>& graph, std::shared_ptr<ConcurrentChannel> channel,
                const std::string& mode) {
    TORCH_CHECK(graph != nullptr, "terra_torch: GraphRunner needs a graph");
    if (!channel) channel = std::make_shared<ConcurrentChannel>();
    runner_ = std::make_shared<GraphRunner>(std::make_unique<runtime::TorchScriptExecutor>(graph, parse_mode(mode)),
                                            std::move(channel));
    live_runners().emplace(this, runner_);
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
  std::shared_ptr<GraphRunner> runner_;
};

void shutdown_all_runners() {
  try {
    wait_direct();  // launched runs finish while the interpreter can still hand out the GIL
  } catch (const std::exception&) {
  }
  std::vector<std::shared_ptr<GraphRunner>> runners;
  for (const auto& [wrapper, weak] : live_runners())
    if (auto r = weak.lock()) runners.push_back(std::move(r));
  py::gil_scoped_release no_gil;
  for (const auto& r : runners) r->shutdown();
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
           "(decisions [(site, value)], feeds [(slot, tensor|None)], fetches [(slot, tag)]) of a recording");

  py::class_<DirectGraph, std::shared_ptr<DirectGraph>>(r, "DirectGraph")
      .def(py::init([](const Plan& plan, const std::string& mode, bool into_buffers) {
             return std::make_shared<DirectGraph>(plan.graph(), mode, into_buffers);
           }),
           py::arg("plan"), py::arg("mode") = "interpreter", py::arg("into_buffers") = false)
      .def("launch", &launch_direct, py::arg("inputs"), py::arg("like"),
           "Queue a run on the deferred worker; returns output buffers shaped like `like`, filled when "
           "the run ends (the next op of any Python thread waits for that)")
      .def_property_readonly("feed_slots", &DirectGraph::feed_slots, "the feed slot of each input, in order")
      .def_property_readonly("fetch_slots", &DirectGraph::fetch_slots, "the fetch slot of each output, in order")
      .def_property_readonly("text", &DirectGraph::text)
      .def("run", &DirectGraph::run, py::arg("inputs"),
           "Run on the calling thread (GIL released): a value per feed slot in, a value per fetch slot out");

  py::class_<PyGraphRunner>(r, "GraphRunner")
      .def(py::init([](const Plan& plan, std::shared_ptr<ConcurrentChannel> channel, const std::string& mode) {
             return std::make_unique<PyGraphRunner>(plan.graph(), std::move(channel), mode);
           }),
           py::arg("plan"), py::arg("channel") = py::none(), py::arg("mode") = "interpreter")
      .def(py::init([](const std::shared_ptr<torch::jit::Graph>& graph, std::shared_ptr<ConcurrentChannel> channel,
                       const std::string& mode) { return std::make_unique<PyGraphRunner>(graph, std::move(channel), mode); }),
           py::arg("graph"), py::arg("channel") = py::none(), py::arg("mode") = "interpreter")
      .def_property_readonly("channel", [](PyGraphRunner& g) { return g.get().channel(); })
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

  r.def("wait_direct", &wait_direct, "Wait for every launched direct run; re-raise the first error");
  r.def("direct_failed", [] { return DirectWorker::get().failed(); }, "A launched direct run failed (wait_direct raises it)");
  r.def("direct_pending", [] { return DirectWorker::get().pending() || DirectWorker::get().failed(); },
        "A launched direct run is in flight, or failed and wait_direct has not raised it yet");
  r.def("_shutdown_all", &shutdown_all_runners, "Shut down every live GraphRunner (atexit hook)");
  // atexit hooks run before finalization starts, while a worker can still take the GIL to free a
  // tensor; they run in reverse order of registration, so before torch's own.
  py::module_::import("atexit").attr("register")(r.attr("_shutdown_all"));
}

}  // namespace terra::python
