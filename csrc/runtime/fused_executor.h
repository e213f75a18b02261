// FusedExecutor: the second Executor. It runs the generated graph with its straight-line
// stretches cut out (emit/segments.h); each segment runs compiled code once that is compiled
// and checked, the TorchScript interpreter before then and wherever compiled code cannot run.
//
// A segment's life:
//
//   new --first run (interpreted and timed; its inputs' CallPlan noted)--> requested, or
//            interpreted when it ran in under min_segment_us() (a call into compiled code
//            costs about that much, so its compile would be wasted)
//   requested --compiler takes it (next_request)--> compiling
//   compiling --compiled(path): package loaded--> loaded | --failed(reason)--> interpreted
//            | a package this process already checked--> its verdict: trusted or interpreted
//   loaded --next run with the same plan: compiled on copies of the inputs, interpreted on
//            the real ones, results and written inputs compared--> trusted | rejected
//          --next run with inputs the plan does not fit (the first run was not like the
//            others: a replay from restored snapshots)--> requested, planned from them (once)
//   trusted: compiled whenever the inputs' plan is the compiled one, else interpreted. Its
//            first 2 * kTrialRuns runs with that plan alternate compiled and interpreted code,
//            timed: compiled code slower than min_speedup() times the interpreter's (medians)
//            leaves the segment interpreted, with both times in the reason (a small segment
//            can cost more in the call into compiled code than its few kernels save).
//   interpreted (for good).
// Where its ops run: a segment is called (terra::segment) when new, loaded or trusted. While it
// waits for the compiler (requested, compiling) and once interpreted for good, the graph runs
// its ops in place instead: at the next run() after such a change the graph is cut again
// (emit::cut_segments' `in_place`), so that the segment costs what its ops cost, not a call
// (an input list, a new interpreter state, views made again: ~6 us); its report says `inlined`.
// So co-execution with fused segments starts at the interpreter's speed and stays there until
// compiled code is ready, however long the compiler takes.
//
// The compiler is Python (terra_torch/_fused.py: the body as an FX graph, exported and compiled
// by AOTInductor into a package); the package's code is loaded and run here without the GIL
// (torch::inductor::AOTIModelPackageLoader). Results of compiled code are within a tolerance of
// eager's, not bitwise (kRelTolerance, kAbsTolerance: the check), which is why the executor is
// opt-in; the default TorchScriptExecutor stays bitwise.
//
// Locking: mu_ guards every segment's state and which graph runs (the outer executor, swapped
// when segments are inlined); run() holds it only to read or change them, never while a segment
// or the graph runs (a rebuilt graph is made outside it), so the compiler's
// next_request()/compiled() calls and a running graph never wait for each other's work. A
// process-wide list of live executors (for close_every_live) has its own mutex, taken before an
// executor's mu_, never after. The process-wide verdicts on packages (fused_executor.cpp,
// verdict_book: a graph built again takes the verdicts on packages this process has checked
// and timed) have a mutex taken after an executor's mu_, never before.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/core/Device.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "emit/segments.h"
#include "runtime/executor.h"

namespace at {
class Tensor;
}

namespace terra::runtime {

// What compiled code is specialized to: one input's layout.
struct InputLayout {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  // A Python number the program passed (`0.01 * t`, `mul_(momentum)`), fed as a 0-dim tensor
  // that type promotion treats as a scalar (TensorImpl::is_wrapped_number): compiled code must
  // promote as eager does (terra_torch/_fused.py, build_module), so it is part of the plan.
  bool wrapped = false;
  bool operator==(const InputLayout&) const = default;
};

// How a segment's inputs reach compiled code. Inputs that share memory with an input the
// segment writes are passed as one flat tensor over that memory (a base) and rebuilt inside the
// compiled function as views of it (as_strided), so that the compiled function sees the aliasing
// and its functionalization keeps eager's order of the write and the reads (an optimizer step
// writes a parameter that the forward read through another feed, or through t()). The others
// are passed as they are. Compiled code runs only on inputs with the plan it was compiled for.
struct CallPlan {
  struct Direct {
    size_t input = 0;
    InputLayout layout;
    bool operator==(const Direct&) const = default;
  };
  struct Base {
    size_t first_input = 0;  // an input over the memory (its flat view is passed)
    int64_t numel = 0;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    c10::Device device = c10::Device(c10::DeviceType::CPU);
    bool operator==(const Base&) const = default;
  };
  struct View {
    size_t input = 0, base = 0;
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
    bool operator==(const View&) const = default;
  };
  std::vector<Direct> direct;  // call arguments first, in input order
  std::vector<Base> bases;     // then these
  std::vector<View> views;
  bool operator==(const CallPlan&) const = default;
};

struct CompileRequest {
  size_t segment = 0;
  std::shared_ptr<torch::jit::Graph> body;
  CallPlan plan;
};

struct SegmentReport {
  size_t ops = 0;
  std::string state;   // new, requested, compiling, loaded, trusted, interpreted
  std::string reason;  // why it stays interpreted (state "interpreted")
  int64_t compiled_runs = 0;
  int64_t interpreted_runs = 0;
  double max_difference = 0;  // in the check: largest |compiled - interpreted|
  // The speed trial's medians, microseconds per run (0 until the trial ended).
  double compiled_us = 0, interpreted_us = 0;
  double first_run_us = 0;  // its first run, interpreted and called (0 until it ran)
  std::string package;      // its compiled package's path ("" before the compiler handed one)
  // Its ops now run in place, not called (emit::cut_segments): it waits for the compiler, or
  // stays interpreted for good.
  bool inlined = false;
};

class FusedExecutor final : public Executor {
 public:
  // Tolerance of the first compiled run's check, per element: |c - i| <= kAbs + kRel * |i|
  // (float types; other types must be equal). torch.compile's own accuracy checks on float32
  // allow about this much for reordered reductions and fused pointwise code.
  static constexpr double kRelTolerance = 1e-3;
  static constexpr double kAbsTolerance = 1e-5;
  // Runs of each kind in a trusted segment's speed trial.
  static constexpr int kTrialRuns = 8;
  // How much faster than the interpreter compiled code must be to stay: TERRA_FUSED_MIN_SPEEDUP
  // (default 1.0; 0 keeps every checked segment compiled without a trial).
  static double min_speedup();
  // A CPU segment whose first run took less is not compiled: TERRA_FUSED_MIN_SEGMENT_US (default
  // 10; 0 compiles every segment). A compiled call costs 7-19 us on the development machine, and
  // no segment interpreted in under 10 us won its speed trial by more than 5% (docs/RUNTIME.md,
  // "Compiled segments"); the first run is the slowest, so a segment under it is small for sure.
  static double min_segment_us();

  explicit FusedExecutor(std::shared_ptr<torch::jit::Graph> graph, const emit::SegmentOptions& options = {});
  ~FusedExecutor() override;
  std::vector<c10::IValue> run(std::vector<c10::IValue> inputs) override;

  // For the compiler (any thread; blocks at most `wait`, so Python must release the GIL).
  std::optional<CompileRequest> next_request(std::chrono::nanoseconds wait);
  // Loads the package, or takes this process's verdict on it where there is one.
  void compiled(size_t segment, const std::string& package_path);
  void failed(size_t segment, const std::string& reason);
  // The program is closed for good (Session::shut_down): every loaded package is let go now, so
  // that its loader deletes the folder it extracted the package to (AOTIModelPackageLoader does
  // that only in its destructor, and a program Python still holds at exit is never destroyed:
  // each run left ~1.5 MB per segment in /tmp). Segments report "interpreted", the compiler gets
  // no more requests and a package it hands over later is not loaded.
  void close();
  // close() on every FusedExecutor alive (at interpreter exit: python/runtime_bindings.cpp). A
  // graph that Python still holds then (a `graph.build` result kept in a global or a reference
  // cycle, a program never closed) is never destroyed, and its loaders' folders would stay.
  static void close_every_live();
  std::vector<SegmentReport> report() const;
  // Segments whose compiled code is loaded but not yet checked, or trusted and still in their
  // speed trial: the next runs are not yet the steady ones (the program's speed check waits).
  size_t settling() const;
  const emit::SegmentedGraph& segmented() const;
  // Called by the terra::segment op's kernel on the thread running this executor.
  std::vector<at::Tensor> run_segment(size_t segment, std::vector<at::Tensor> inputs);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace terra::runtime
