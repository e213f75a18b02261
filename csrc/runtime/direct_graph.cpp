// DirectGraph and the deferred worker of overlap mode. Both live in one translation unit because
// both are small and every file here that includes the TorchScript IR costs most of a minute to
// compile. Why they exist: see direct_graph.h.
#include "runtime/direct_graph.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/record_function.h>
#include <c10/util/thread_name.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "emit/channel.h"
#include "emit/segments.h"
#include "runtime/fused_executor.h"
#include "runtime/gil_release.h"
#include "runtime/team_guard.h"
#include "runtime/worker_threads.h"

namespace terra::runtime {

// ---- DirectGraph ------------------------------------------------------------------------------

namespace {

// Feeds and fetches inside a prim::If or prim::Loop run a data-dependent number of times:
// they cannot become inputs or outputs, and such a graph is not a static one.
void refuse_nested(torch::jit::Block* block, bool nested) {
  for (torch::jit::Node* n : block->nodes()) {
    const std::string kind = n->kind().toQualString();
    TORCH_CHECK(!nested || (kind != emit::kFeedOp && kind != emit::kFeedOrNoneOp && kind != emit::kFetchOp),
                "terra_torch: DirectGraph: ", kind, " inside a control-flow block");
    for (torch::jit::Block* b : n->blocks()) refuse_nested(b, true);
  }
}

int64_t slot_of(torch::jit::Node* n) {
  const auto slot = torch::jit::toIValue(n->input(0));
  TORCH_CHECK(slot && slot->isInt(), "terra_torch: DirectGraph: ", n->kind().toQualString(), " without a constant slot");
  return slot->toInt();
}

}  // namespace

DirectGraph::DirectGraph(const std::shared_ptr<torch::jit::Graph>& generated, TorchScriptMode mode, bool into_buffers,
                         bool fused)
    : into_buffers_(into_buffers) {
  TORCH_CHECK(generated != nullptr, "terra_torch: DirectGraph needs a graph");
  graph_ = generated->copy();
  lift_channel_ops();
  if (fused) {
    // Every input is at hand when the graph starts (no channel waits): feeds end no segment.
    fused_ = std::make_shared<FusedExecutor>(graph_, emit::SegmentOptions{.feeds_ready = true});
    executor_ = fused_;
  } else {
    executor_ = std::make_shared<TorchScriptExecutor>(graph_, mode);
  }
}

DirectGraph::~DirectGraph() = default;

std::string DirectGraph::text() const { return graph_->toString(); }

void DirectGraph::run_stack(std::vector<c10::IValue> stack) { executor_->run(std::move(stack)); }

std::vector<std::optional<at::Tensor>> DirectGraph::run(const std::vector<std::optional<at::Tensor>>& inputs) {
  TORCH_CHECK(inputs.size() == feed_slots_.size(), "terra_torch: DirectGraph takes ", feed_slots_.size(),
              " inputs, got ", inputs.size());
  std::vector<c10::IValue> stack;
  stack.reserve(inputs.size());
  for (const auto& t : inputs) stack.emplace_back(t ? c10::IValue(*t) : c10::IValue());
  std::vector<c10::IValue> results;
  {
    // Ops may run long; a tensor dying in the graph may need the GIL to free its PyObject.
    GilRelease no_gil;
    results = executor_->run(std::move(stack));
  }
  std::vector<std::optional<at::Tensor>> out;
  out.reserve(results.size());
  for (auto& v : results) out.push_back(v.isTensor() ? std::optional<at::Tensor>(std::move(v).toTensor()) : std::nullopt);
  return out;
}

void DirectGraph::lift_channel_ops() {
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

// ---- deferred direct runs ---------------------------------------------------------------------

namespace {

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
      // MKL's team as the co-execution worker's (runtime/worker_threads.h).
      adopt_worker_thread_budget_of(job.threads);
      try {
        TeamGuardScope team_guard(true);  // small calls on one thread where calibrated (team_guard.h)
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
    GilRelease no_gil;  // the worker may need the GIL to free a tensor
    w.wait_idle();
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

}  // namespace

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
    GilRelease no_gil;
    w.wait();
  }
  // With the GIL back: dropping Python's tensors may free their Python objects.
  w.release_finished();
}

bool direct_failed() { return DirectWorker::get().failed(); }

bool direct_pending() { return DirectWorker::get().pending() || DirectWorker::get().failed(); }

}  // namespace terra::runtime
