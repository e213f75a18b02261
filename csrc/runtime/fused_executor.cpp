// FusedExecutor: see fused_executor.h for a segment's life and the locking.
#include "runtime/fused_executor.h"

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>
#include <torch/library.h>

#include "capture/schema_aliases.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <sstream>
#include <unordered_map>
#include <variant>

namespace terra::runtime {

namespace {

// c10::Error's what() carries a stack trace after its message: a segment's reason keeps the
// message ("index out of bounds: ..."), which is what explain() shows.
std::string first_line(const char* what) {
  std::string text(what);
  const size_t end = text.find('\n');
  return end == std::string::npos ? text : text.substr(0, end);
}

using Loader = torch::inductor::AOTIModelPackageLoader;

enum class State { kNew, kRequested, kCompiling, kLoaded, kTrusted, kInterpreted };

// Where a segment's ops run in the outer graph: called (terra::segment), or in place, as the
// generated graph had them. A segment is called while its first run is to come (it notes its
// call plan and time there) and while it has compiled code to check or run; waiting for the
// compiler, or interpreted for good, a call would only cost (`segment_call_bench`: ~6 us a call
// of a few ops against the same ops in place), so its ops run in place.
bool runs_in_place(State s) { return s == State::kRequested || s == State::kCompiling || s == State::kInterpreted; }

// The reason a segment whose first run was faster than min_segment_us() is not compiled.
std::string too_small(double us, double floor_us) {
  std::ostringstream why;
  why.precision(3);
  why << "its first run took " << us << " us, under the " << floor_us
      << " us (TERRA_FUSED_MIN_SEGMENT_US) that a call into compiled code needs to pay";
  return why.str();
}

const char* name_of(State s) {
  switch (s) {
    case State::kNew: return "new";
    case State::kRequested: return "requested";
    case State::kCompiling: return "compiling";
    case State::kLoaded: return "loaded";
    case State::kTrusted: return "trusted";
    case State::kInterpreted: return "interpreted";
  }
  return "?";
}

// The executor whose graph is running on this thread (the terra::segment kernel's target).
thread_local FusedExecutor* t_running = nullptr;

struct RunningScope {
  FusedExecutor* saved;
  explicit RunningScope(FusedExecutor* e) : saved(t_running) { t_running = e; }
  ~RunningScope() { t_running = saved; }
};

// Verdicts on compiled packages, for the whole process, by package path: the path names the
// package by a hash of the body, the call plan and the versions (terra_torch/_fused.py,
// package_key), so the same path means the same compiled code for the same inputs. A graph
// built again (a co-executed program rebuilds its graph when a new path is traced; `graph.build`
// of the same recording) cuts the same segments, and its compiler finds their packages in the
// cache; the segment then takes the verdict this process reached on that package (its loaded
// code, trusted, or the reason it stays interpreted) instead of loading, checking and timing it
// again: a program that rebuilds its graph now and then (trip_count) ran its segments through
// all of that after every rebuild. Only verdicts on the package itself are kept: trusted after
// its trial, refused by its check or its trial, raised once trusted; not a failed compile,
// which another try may not repeat. Entries go when a program using them closes (close()) and
// at exit (close_every_live()), with the loaders' extracted folders.
//
// Locking: the book's mutex is taken after an executor's mu, never before it.
struct Verdict {
  std::shared_ptr<Loader> loader;  // trusted: the loaded code; null: stays interpreted (reason)
  std::string reason;
  double max_difference = 0, compiled_us = 0, interpreted_us = 0;
};
struct VerdictBook {
  std::mutex mu;
  std::unordered_map<std::string, Verdict> by_path;  // guarded by mu
};
VerdictBook& verdict_book() {
  static auto* book = new VerdictBook();  // (leaked, as LiveExecutors below)
  return *book;
}

// Every FusedExecutor alive, for close_every_live() at exit. Leaked, so that it outlives the
// executors static destructors might still free.
struct LiveExecutors {
  std::mutex mu;
  std::vector<FusedExecutor*> executors;  // guarded by mu
};
LiveExecutors& live_executors() {
  static auto* live = new LiveExecutors();
  return *live;
}

std::vector<at::Tensor> segment_kernel(int64_t index, std::vector<at::Tensor> inputs) {
  TORCH_CHECK(t_running != nullptr, "terra_torch: terra::segment ran outside a FusedExecutor");
  return t_running->run_segment(static_cast<size_t>(index), std::move(inputs));
}

// Which body inputs the body may write: directly, or through a view it made of them.
std::vector<bool> written_inputs(const torch::jit::Graph& body) {
  std::vector<bool> written(body.inputs().size(), false);
  std::unordered_map<const torch::jit::Value*, size_t> root;  // a value -> the input it aliases
  for (size_t i = 0; i < body.inputs().size(); ++i) root.emplace(body.inputs()[i], i);
  for (const torch::jit::Node* n : body.nodes()) {
    const c10::FunctionSchema* schema = n->maybeSchema();
    if (schema == nullptr) continue;
    for (size_t j = 0; j < n->inputs().size(); ++j) {
      auto it = root.find(n->input(j));
      if (it != root.end() && capture::writes_argument(*schema, j)) written[it->second] = true;
    }
    for (size_t k = 0; k < n->outputs().size(); ++k) {
      const auto alias = capture::aliased_argument(*schema, k);
      if (!alias || alias->argument >= n->inputs().size()) continue;
      if (auto it = root.find(n->input(alias->argument)); it != root.end()) root.emplace(n->output(k), it->second);
    }
  }
  return written;
}

// Whether no two elements of `t` share memory, proven from its sizes and strides: with the
// dimensions of more than one element sorted by stride, each stride must step past every offset
// the smaller ones reach, so that each element's offset has one set of indices. True for dense
// tensors and their views (slices, chunks, transposes: an LSTM cell's gates, written in place
// through unsafe_chunk, have gaps but no overlap); a layout it cannot prove counts as overlapping.
// (at::has_internal_overlap answers "too hard" for every such view.)
bool no_internal_overlap(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return true;
  c10::SmallVector<std::pair<int64_t, int64_t>, 6> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) return true;  // no elements
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the largest offset the dimensions so far reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += (size - 1) * stride;
  }
  return true;
}

// The CallPlan of these inputs (fused_executor.h), or why compiled code cannot take them.
std::variant<CallPlan, std::string> plan_of(const std::vector<at::Tensor>& inputs, const std::vector<bool>& written) {
  std::vector<std::pair<const c10::StorageImpl*, size_t>> by_storage;
  for (size_t i = 0; i < inputs.size(); ++i) {
    // (A write into memory two elements share has no order compiled code could keep.)
    if (written[i] && !no_internal_overlap(inputs[i]))
      return "input " + std::to_string(i) + " is written and overlaps itself";
    if (inputs[i].has_storage()) by_storage.emplace_back(inputs[i].storage().unsafeGetStorageImpl(), i);
  }
  std::sort(by_storage.begin(), by_storage.end());
  std::vector<int64_t> base_of(inputs.size(), -1);
  CallPlan plan;
  for (size_t a = 0; a < by_storage.size();) {
    size_t b = a + 1;
    bool any_written = written[by_storage[a].second];
    while (b < by_storage.size() && by_storage[b].first == by_storage[a].first) any_written |= written[by_storage[b++].second];
    if (b - a >= 2 && any_written) {
      const at::Tensor& t = inputs[by_storage[a].second];  // (the lowest index: sorted by (storage, index))
      const size_t item = t.element_size();
      for (size_t k = a; k < b; ++k) {
        if (inputs[by_storage[k].second].scalar_type() != t.scalar_type())
          return std::string("inputs of different dtypes share memory");
      }
      if (t.storage().nbytes() % item != 0) return std::string("a shared memory is not a whole number of elements");
      for (size_t k = a; k < b; ++k) base_of[by_storage[k].second] = static_cast<int64_t>(plan.bases.size());
      plan.bases.push_back({by_storage[a].second, static_cast<int64_t>(t.storage().nbytes() / item), t.scalar_type(), t.device()});
    }
    a = b;
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (base_of[i] < 0) {
      plan.direct.push_back({i, {t.sizes().vec(), t.strides().vec(), t.scalar_type(), t.device(),
                                 t.unsafeGetTensorImpl()->is_wrapped_number()}});
    } else {
      plan.views.push_back({i, static_cast<size_t>(base_of[i]), t.sizes().vec(), t.strides().vec(), t.storage_offset()});
    }
  }
  return plan;
}

// Whether plan_of(inputs) would be `plan`, checked in place: the steady path of every compiled
// run, which should not build a plan (two vectors per input) only to compare it. The inputs fit
// when each direct input has its layout, each view input lies over its base's memory with its
// geometry, and no memory is shared that the plan does not share: a base's memory by anything
// else, or a written direct input's by another input.
bool fits(const CallPlan& plan, const std::vector<at::Tensor>& inputs, const std::vector<bool>& written) {
  if (inputs.size() != plan.direct.size() + plan.views.size()) return false;
  for (const CallPlan::Direct& d : plan.direct) {
    const at::Tensor& t = inputs[d.input];
    if (t.sizes() != c10::IntArrayRef(d.layout.sizes) || t.strides() != c10::IntArrayRef(d.layout.strides) ||
        t.scalar_type() != d.layout.dtype || t.device() != d.layout.device ||
        t.unsafeGetTensorImpl()->is_wrapped_number() != d.layout.wrapped)
      return false;
  }
  for (const CallPlan::View& v : plan.views) {
    const at::Tensor& t = inputs[v.input];
    const CallPlan::Base& b = plan.bases[v.base];
    const at::Tensor& first = inputs[b.first_input];
    if (!t.has_storage() || !first.has_storage() || !t.storage().is_alias_of(first.storage()) ||
        t.scalar_type() != b.dtype || t.device() != b.device ||
        static_cast<int64_t>(t.storage().nbytes()) != b.numel * static_cast<int64_t>(t.element_size()) ||
        t.sizes() != c10::IntArrayRef(v.sizes) || t.strides() != c10::IntArrayRef(v.strides) ||
        t.storage_offset() != v.offset)
      return false;
  }
  // (storage, shared only if allowed): bases and written direct inputs may share with nothing.
  c10::SmallVector<std::pair<const c10::StorageImpl*, bool>, 16> memory;
  for (const CallPlan::Direct& d : plan.direct) {
    if (inputs[d.input].has_storage()) memory.emplace_back(inputs[d.input].storage().unsafeGetStorageImpl(), !written[d.input]);
  }
  for (const CallPlan::Base& b : plan.bases) memory.emplace_back(inputs[b.first_input].storage().unsafeGetStorageImpl(), false);
  std::sort(memory.begin(), memory.end());
  for (size_t i = 1; i < memory.size(); ++i) {
    if (memory[i].first == memory[i - 1].first && !(memory[i].second && memory[i - 1].second)) return false;
  }
  return true;
}

// The compiled function's arguments: the direct inputs, then a flat view over each base's memory.
std::vector<at::Tensor> call_arguments(const CallPlan& plan, const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> out;
  out.reserve(plan.direct.size() + plan.bases.size());
  for (const CallPlan::Direct& d : plan.direct) out.push_back(inputs[d.input]);
  for (const CallPlan::Base& b : plan.bases) out.push_back(inputs[b.first_input].as_strided({b.numel}, {1}, 0));
  return out;
}

// Why `got` (compiled) is not `want` (interpreted) within the tolerance, or nullopt.
std::optional<std::string> differs(const at::Tensor& got, const at::Tensor& want, double& max_difference) {
  if (got.sizes() != want.sizes() || got.scalar_type() != want.scalar_type())
    return "a result has another shape or type";
  if (!at::isFloatingType(want.scalar_type()) && !at::isComplexType(want.scalar_type()))
    return at::equal(got, want) ? std::nullopt : std::optional<std::string>("an integer or boolean result differs");
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const at::Tensor nan_g = g.isnan(), nan_w = w.isnan();
  if (!at::equal(nan_g, nan_w)) return "NaNs differ";
  const at::Tensor diff = (g - w).abs().masked_fill(nan_w, 0).masked_fill(g.eq(w), 0);  // (inf == inf)
  if (diff.numel() > 0) max_difference = std::max(max_difference, diff.max().item<double>());
  const at::Tensor bound = w.abs().masked_fill(nan_w, 0) * FusedExecutor::kRelTolerance + FusedExecutor::kAbsTolerance;
  if (diff.gt(bound).any().item<bool>()) {
    std::ostringstream os;
    os << "compiled results differ from the interpreter's by up to " << max_difference << " (tolerance "
       << FusedExecutor::kAbsTolerance << " + " << FusedExecutor::kRelTolerance << " * |value|)";
    return os.str();
  }
  return std::nullopt;
}

struct SegmentState {
  emit::Segment segment;
  torch::jit::Code code;
  std::vector<bool> written;
  // Guarded by FusedExecutor::Impl::mu, except where noted.
  State state = State::kNew;
  std::string reason;
  CallPlan plan;  // set once (kNew -> kRequested), read-only after
  std::shared_ptr<Loader> loader;
  double max_difference = 0;
  std::atomic<int64_t> compiled_runs{0}, interpreted_runs{0};
  // The speed trial of a trusted segment (FusedExecutor::kTrialRuns), nanoseconds per run; it
  // has ended once `trial_done` is set (read without the lock by the segment's runs).
  std::vector<int64_t> trial_compiled, trial_interpreted;
  std::atomic<bool> trial_done{false};
  double compiled_us = 0, interpreted_us = 0;
  double first_run_us = 0;  // the first (interpreted) run, timed: min_segment_us() decides on it
  std::string package_path;  // set by compiled(): the key of its verdict in verdict_book()
  bool replanned = false;    // planned again once (FusedExecutor::replan)

  explicit SegmentState(emit::Segment s)
      : segment(std::move(s)), code(segment.body, "terra_segment"), written(written_inputs(*segment.body)) {}

  std::vector<at::Tensor> interpret(const std::vector<at::Tensor>& inputs) {
    interpreted_runs.fetch_add(1, std::memory_order_relaxed);
    torch::jit::Stack stack(inputs.begin(), inputs.end());
    torch::jit::InterpreterState(code).run(stack);
    std::vector<at::Tensor> out;
    out.reserve(stack.size());
    for (c10::IValue& v : stack) out.push_back(std::move(v).toTensor());
    return out;
  }
};

// Notes the segment's verdict on its package for the rest of the process (verdict_book); the
// caller holds the executor's mu and has just decided: trusted with its trial over, or
// interpreted for good after its check, its trial or a raise.
void remember_verdict(const SegmentState& s) {
  if (s.package_path.empty()) return;
  Verdict v{s.state == State::kTrusted ? s.loader : nullptr, s.reason, s.max_difference, s.compiled_us, s.interpreted_us};
  VerdictBook& book = verdict_book();
  std::lock_guard lock(book.mu);
  book.by_path.insert_or_assign(s.package_path, std::move(v));
}

}  // namespace

struct FusedExecutor::Impl {
  std::shared_ptr<torch::jit::Graph> graph;  // as generated, before the cut
  emit::SegmentOptions options;
  emit::SegmentedGraph segmented;
  std::shared_ptr<TorchScriptExecutor> outer;  // guarded by mu (a run holds its own reference)
  std::vector<bool> inlined;                   // guarded by mu: the segments `outer` runs in place
  std::vector<std::unique_ptr<SegmentState>> segments;
  bool closed = false;  // guarded by mu (close())
  mutable std::mutex mu;
  std::condition_variable requested;
};

FusedExecutor::FusedExecutor(std::shared_ptr<torch::jit::Graph> graph, const emit::SegmentOptions& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->graph = graph->copy();  // (cut again from this when segments are left in place)
  impl_->options = options;
  impl_->segmented = emit::cut_segments(graph, options);
  impl_->outer = std::make_shared<TorchScriptExecutor>(impl_->segmented.graph);
  impl_->inlined.assign(impl_->segmented.segments.size(), false);
  for (const emit::Segment& s : impl_->segmented.segments) impl_->segments.push_back(std::make_unique<SegmentState>(s));
  LiveExecutors& live = live_executors();
  std::lock_guard lock(live.mu);
  live.executors.push_back(this);
}

FusedExecutor::~FusedExecutor() {
  LiveExecutors& live = live_executors();
  std::lock_guard lock(live.mu);  // (close_every_live() may be closing this one: it holds mu meanwhile)
  live.executors.erase(std::find(live.executors.begin(), live.executors.end(), this));
}

void FusedExecutor::close_every_live() {
  LiveExecutors& live = live_executors();
  std::lock_guard lock(live.mu);  // lock order: live.mu, then an executor's mu (close())
  for (FusedExecutor* e : live.executors) e->close();
  // (graphs destroyed earlier left their packages' verdicts, and with them the loaders)
  std::unordered_map<std::string, Verdict> dropped;  // destroyed after the lock
  VerdictBook& book = verdict_book();
  std::lock_guard book_lock(book.mu);
  dropped.swap(book.by_path);
}

std::vector<c10::IValue> FusedExecutor::run(std::vector<c10::IValue> inputs) {
  RunningScope running(this);
  std::shared_ptr<TorchScriptExecutor> outer;
  std::vector<bool> wanted;
  {
    std::lock_guard lock(impl_->mu);
    outer = impl_->outer;
    auto in_place = [&](size_t k) { return runs_in_place(impl_->segments[k]->state); };
    bool changed = false;
    for (size_t k = 0; k < impl_->segments.size() && !changed; ++k) changed = in_place(k) != impl_->inlined[k];
    if (changed) {
      wanted.resize(impl_->segments.size());
      for (size_t k = 0; k < wanted.size(); ++k) wanted[k] = in_place(k);
    }
  }
  if (!wanted.empty()) {
    // Segments waiting for their compiled code, and those that stay interpreted for good, run in
    // place from now on; a segment whose package has loaded is called again (a few milliseconds
    // to rebuild, once per iteration in which something changed).
    outer = std::make_shared<TorchScriptExecutor>(emit::cut_segments(impl_->graph, impl_->options, wanted).graph);
    std::lock_guard lock(impl_->mu);
    impl_->outer = outer;
    impl_->inlined = std::move(wanted);
  }
  return outer->run(std::move(inputs));
}

double FusedExecutor::min_segment_us() {
  const char* v = std::getenv("TERRA_FUSED_MIN_SEGMENT_US");
  return v != nullptr && *v != '\0' ? std::max(0.0, std::atof(v)) : 10.0;
}

double FusedExecutor::min_speedup() {
  // (Read at each trial's end, a handful of times per segment: a test or a user can change it.)
  const char* v = std::getenv("TERRA_FUSED_MIN_SPEEDUP");
  return v != nullptr && *v != '\0' ? std::max(0.0, std::atof(v)) : 1.0;
}

namespace {

// A trusted segment's compiled code. Code that raises after its check (a bounds check of its own
// on index values the check run never saw) gives the segment back to the interpreter for good,
// the reason kept for explain(). A segment that writes none of its inputs is then run by the
// interpreter, which returns eager's results or raises eager's error for the same values; one
// that writes inputs may have written some of them before it raised, so its error goes on as it
// is (the iteration fails, as it does when an interpreted op raises in the graph).
std::vector<at::Tensor> run_compiled(std::mutex& mu, SegmentState& s, Loader& loader, const std::vector<at::Tensor>& inputs,
                                     bool* raised = nullptr) {
  try {
    return loader.run(call_arguments(s.plan, inputs));
  } catch (const std::exception& e) {
    {
      std::lock_guard lock(mu);
      s.state = State::kInterpreted;
      s.reason = "compiled code raised after it was trusted: " + first_line(e.what());
      s.loader.reset();  // (this run holds its own reference)
      remember_verdict(s);
    }
    if (raised != nullptr) *raised = true;
    if (std::find(s.written.begin(), s.written.end(), true) != s.written.end()) throw;
    return s.interpret(inputs);
  }
}

// A trusted segment's run during its speed trial: compiled and interpreted in turns, timed;
// the last one decides whether compiled code stays (FusedExecutor::min_speedup).
std::vector<at::Tensor> trial_run(std::mutex& mu, SegmentState& s, Loader& loader, const std::vector<at::Tensor>& inputs) {
  constexpr int kTrialRuns = FusedExecutor::kTrialRuns;
  const double wanted = FusedExecutor::min_speedup();
  bool compiled_turn;
  {
    std::lock_guard lock(mu);
    compiled_turn = s.trial_compiled.size() <= s.trial_interpreted.size();
  }
  if (wanted <= 0) {
    s.trial_done.store(true, std::memory_order_release);
    compiled_turn = true;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<at::Tensor> out;
  if (compiled_turn) {
    s.compiled_runs.fetch_add(1, std::memory_order_relaxed);
    bool raised = false;
    out = run_compiled(mu, s, loader, inputs, &raised);
    if (raised) return out;  // the segment is interpreted from now on: no trial to finish
  } else {
    out = s.interpret(inputs);
  }
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard lock(mu);
  if (wanted <= 0) {
    if (s.state == State::kTrusted) remember_verdict(s);  // (no trial: trusted as it is)
    return out;
  }
  (compiled_turn ? s.trial_compiled : s.trial_interpreted).push_back(ns);
  if (static_cast<int>(s.trial_interpreted.size()) < kTrialRuns || static_cast<int>(s.trial_compiled.size()) < kTrialRuns)
    return out;
  auto median_us = [](std::vector<int64_t>& v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2] / 1e3;
  };
  s.compiled_us = median_us(s.trial_compiled);
  s.interpreted_us = median_us(s.trial_interpreted);
  if (s.compiled_us * wanted > s.interpreted_us) {
    std::ostringstream why;
    why.precision(3);
    if (wanted == 1.0)
      why << "compiled code was slower than the interpreter: ";
    else
      why << "compiled code was not " << wanted << " times as fast as the interpreter (TERRA_FUSED_MIN_SPEEDUP): ";
    why << s.compiled_us << " us against " << s.interpreted_us << " us per run (medians of " << kTrialRuns
        << " runs each, taken in turns)";
    s.state = State::kInterpreted;
    s.reason = why.str();
    s.loader.reset();
  }
  s.trial_done.store(true, std::memory_order_release);
  remember_verdict(s);
  return out;
}

}  // namespace

std::vector<at::Tensor> FusedExecutor::run_segment(size_t index, std::vector<at::Tensor> inputs) {
  TORCH_CHECK(index < impl_->segments.size(), "terra_torch: no segment ", index);
  SegmentState& s = *impl_->segments[index];
  State state;
  std::shared_ptr<Loader> loader;
  {
    std::lock_guard lock(impl_->mu);
    state = s.state;
    loader = s.loader;
  }
  if (state == State::kNew) {
    std::variant<CallPlan, std::string> plan = plan_of(inputs, s.written);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<at::Tensor> out = s.interpret(inputs);
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    // (On a GPU the first run times the launches, not the kernels, which may run long after it:
    // the floor is for CPU segments only.)
    const bool on_cpu = std::all_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.is_cpu(); });
    const double floor_us = on_cpu ? min_segment_us() : 0.0;
    {
      std::lock_guard lock(impl_->mu);
      if (s.state == State::kNew) {
        s.first_run_us = us;
        if (auto* p = std::get_if<CallPlan>(&plan); p != nullptr && us >= floor_us) {
          s.plan = std::move(*p);
          s.state = State::kRequested;
        } else {
          s.state = State::kInterpreted;
          s.reason = p != nullptr ? too_small(us, floor_us) : std::get<std::string>(plan);
        }
      }
    }
    impl_->requested.notify_all();
    return out;
  }
  if (state != State::kTrusted && state != State::kLoaded) return s.interpret(inputs);
  if (!fits(s.plan, inputs, s.written)) {
    // Loaded code not yet checked whose plan these inputs do not fit: the first run was not
    // like the others (a replay that starts from restored snapshots, contiguous where the
    // program's inputs are views, as gpt's `tokens[:, :-1]`), so the segment is planned again
    // from these inputs and compiled for them, once. Trusted code keeps its plan: inputs of
    // another layout (a smaller last batch) run interpreted and the plan's come back.
    if (state == State::kLoaded && !s.replanned) {
      std::variant<CallPlan, std::string> plan = plan_of(inputs, s.written);
      std::shared_ptr<Loader> released;  // (destroyed after the lock: it removes a folder)
      {
        std::lock_guard lock(impl_->mu);
        if (s.state == State::kLoaded && !s.replanned) {
          s.replanned = true;
          released = std::move(s.loader);
          s.package_path.clear();
          if (auto* p = std::get_if<CallPlan>(&plan)) {
            s.plan = std::move(*p);
            s.state = State::kRequested;
          } else {
            s.state = State::kInterpreted;
            s.reason = std::get<std::string>(plan);
          }
        }
      }
      impl_->requested.notify_all();
    }
    return s.interpret(inputs);
  }
  if (state == State::kTrusted) {
    if (!s.trial_done.load(std::memory_order_acquire)) return trial_run(impl_->mu, s, *loader, inputs);
    s.compiled_runs.fetch_add(1, std::memory_order_relaxed);
    return run_compiled(impl_->mu, s, *loader, inputs);
  }
  // kLoaded: the first compiled run, on copies of the arguments, checked against the
  // interpreter on the real inputs (whose results are the ones returned).
  std::vector<at::Tensor> copies;
  // (Copies with the very strides of the originals: the compiled code assumes the plan's
  // strides, and clone() makes a strided view that is not dense, such as one chunk of an LSTM's
  // gates, contiguous; the check then failed every such segment on garbage reads.)
  for (const at::Tensor& a : call_arguments(s.plan, inputs))
    copies.push_back(at::empty_strided(a.sizes(), a.strides(), a.options()).copy_(a));
  std::optional<std::string> reason;
  std::vector<at::Tensor> got;
  try {
    got = loader->run(copies);
  } catch (const std::exception& e) {
    reason = "compiled code failed: " + first_line(e.what());
  }
  std::vector<at::Tensor> want = s.interpret(inputs);
  double max_difference = 0;
  if (!reason && got.size() != want.size()) reason = "compiled code returned another number of results";
  for (size_t i = 0; !reason && i < want.size(); ++i) reason = differs(got[i], want[i], max_difference);
  for (size_t d = 0; !reason && d < s.plan.direct.size(); ++d) {
    const size_t i = s.plan.direct[d].input;
    if (s.written[i]) reason = differs(copies[d], inputs[i], max_difference);
  }
  for (size_t v = 0; !reason && v < s.plan.views.size(); ++v) {
    const CallPlan::View& view = s.plan.views[v];
    const at::Tensor& base = copies[s.plan.direct.size() + view.base];
    reason = differs(base.as_strided(view.sizes, view.strides, view.offset), inputs[view.input], max_difference);
  }
  {
    std::lock_guard lock(impl_->mu);
    s.max_difference = max_difference;
    s.state = reason ? State::kInterpreted : State::kTrusted;
    if (reason) {
      s.reason = *reason;
      s.loader.reset();
      remember_verdict(s);  // (a trusted one is noted once its trial is over)
    }
  }
  return want;
}


std::optional<CompileRequest> FusedExecutor::next_request(std::chrono::nanoseconds wait) {
  std::unique_lock lock(impl_->mu);
  auto pending = [&]() -> std::optional<size_t> {
    if (impl_->closed) return std::nullopt;
    for (size_t i = 0; i < impl_->segments.size(); ++i) {
      if (impl_->segments[i]->state == State::kRequested) return i;
    }
    return std::nullopt;
  };
  impl_->requested.wait_for(lock, wait, [&] { return pending().has_value(); });
  const std::optional<size_t> index = pending();
  if (!index) return std::nullopt;
  SegmentState& s = *impl_->segments[*index];
  s.state = State::kCompiling;
  return CompileRequest{*index, s.segment.body, s.plan};
}

void FusedExecutor::compiled(size_t index, const std::string& package_path) {
  TORCH_CHECK(index < impl_->segments.size(), "terra_torch: no segment ", index);
  std::optional<Verdict> known;
  {
    VerdictBook& book = verdict_book();
    std::lock_guard lock(book.mu);
    if (auto it = book.by_path.find(package_path); it != book.by_path.end()) known = it->second;
  }
  if (known) {  // this process checked (and timed) the same package already
    std::lock_guard lock(impl_->mu);
    if (impl_->closed) return;
    SegmentState& s = *impl_->segments[index];
    s.package_path = package_path;
    s.max_difference = known->max_difference;
    s.compiled_us = known->compiled_us;
    s.interpreted_us = known->interpreted_us;
    if (known->loader) {
      s.loader = std::move(known->loader);
      s.state = State::kTrusted;
      s.trial_done.store(true, std::memory_order_release);
    } else {
      s.state = State::kInterpreted;
      s.reason = known->reason + " (decided earlier in this process for the same package)";
    }
    return;
  }
  std::shared_ptr<Loader> loader;
  std::string error;
  try {
    loader = std::make_shared<Loader>(package_path);
  } catch (const std::exception& e) {
    error = first_line(e.what());
  }
  if (!loader) return failed(index, "loading the compiled package failed: " + error);
  std::lock_guard lock(impl_->mu);
  SegmentState& s = *impl_->segments[index];
  if (impl_->closed) return;  // (the loader goes, its folder with it)
  s.loader = std::move(loader);
  s.package_path = package_path;
  s.state = State::kLoaded;
}

void FusedExecutor::close() {
  std::vector<std::shared_ptr<Loader>> released;  // destroyed after the locks: each removes a folder
  std::vector<Verdict> forgotten;                  // (the same)
  {
    std::lock_guard lock(impl_->mu);
    impl_->closed = true;
    VerdictBook& book = verdict_book();
    std::lock_guard book_lock(book.mu);
    for (auto& s : impl_->segments) {
      if (auto it = book.by_path.find(s->package_path); it != book.by_path.end()) {  // ("" is never a key)
        forgotten.push_back(std::move(it->second));
        book.by_path.erase(it);
      }
      if (s->loader) released.push_back(std::move(s->loader));
      if (s->state != State::kNew && s->state != State::kInterpreted) {
        s->state = State::kInterpreted;
        s->reason = "the program was closed";
      }
    }
  }
  impl_->requested.notify_all();
}

void FusedExecutor::failed(size_t index, const std::string& reason) {
  TORCH_CHECK(index < impl_->segments.size(), "terra_torch: no segment ", index);
  std::lock_guard lock(impl_->mu);
  SegmentState& s = *impl_->segments[index];
  s.state = State::kInterpreted;
  s.reason = reason;
  s.loader.reset();
}

std::vector<SegmentReport> FusedExecutor::report() const {
  std::lock_guard lock(impl_->mu);
  std::vector<SegmentReport> out;
  for (const auto& s : impl_->segments) {
    out.push_back({s->segment.num_ops, name_of(s->state), s->reason, s->compiled_runs.load(),
                   s->interpreted_runs.load(), s->max_difference, s->compiled_us, s->interpreted_us,
                   s->first_run_us, s->package_path, impl_->inlined[out.size()]});
  }
  return out;
}

size_t FusedExecutor::settling() const {
  std::lock_guard lock(impl_->mu);
  return static_cast<size_t>(std::count_if(impl_->segments.begin(), impl_->segments.end(), [](const auto& s) {
    return s->state == State::kLoaded ||
           (s->state == State::kTrusted && !s->trial_done.load(std::memory_order_acquire));
  }));
}

const emit::SegmentedGraph& FusedExecutor::segmented() const { return impl_->segmented; }

}  // namespace terra::runtime

// Registered with the channel ops' library (emit/channel_ops.cpp). CONSERVATIVE, as they are:
// no pass moves a write across the call or merges two of them.
TORCH_LIBRARY_FRAGMENT(terra, m) {
  m.def(torch::schema("segment(int index, Tensor[] inputs) -> Tensor[]", c10::AliasAnalysisKind::CONSERVATIVE),
        &terra::runtime::segment_kernel);
}
