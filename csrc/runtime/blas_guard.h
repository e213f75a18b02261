// One MKL thread for the graph worker's small matrix products, call by call, where that keeps
// eager's bits.
//
// Why: under co-execution Python holds a core while the worker runs the kernels. With torch's
// default team (every core) each MKL call on the worker opens a parallel region whose other
// thread has to be scheduled onto the core Python holds: on 2 cores with 2 threads an MLP + SGD
// step spent 0.49 ms per iteration in the graph against 0.16-0.19 ms with one MKL thread
// (runtime/worker_threads.h has the rest). But the team can decide the bits: MKL computes some
// calls differently with one thread (GEMMs of 5-7 rows against 8x32 and 32x32 weights, torch.dot
// over 65536 floats), and co-execution promises eager's numbers.
//
// So the worker's MKL keeps torch's team, and each call of a matrix product it runs (mm, addmm,
// bmm, baddbmm, addbmm, addmv, dot, vdot and their in-place and out= forms: the ops whose CPU
// kernels call MKL's BLAS) passes through a kernel on a dispatch key of our own, included in the
// worker thread's TLS while a graph runs. That kernel looks the call up by its *layout*: the op,
// each tensor's dtype, sizes, strides and data-pointer alignment, each scalar's value. A layout
// seen for the first time is calibrated there and then: the call runs on random inputs of that
// layout with torch's team and again with one thread, and the results are compared bit for bit.
// Same bits: this and every later call of that layout runs with one MKL thread. Other bits, an
// error, or a call too large for one thread to pay off (kMaxOneThreadMacs): torch's team. Every
// other MKL use (a convolution's slow path, LAPACK, FFT) is not listed and runs with torch's
// team. So a batch of a new size, a shape that follows from data, a fed int: every layout is
// either calibrated or computed as eager computes it; nothing is decided per program.
//
// Example: an MLP at batch 32 on 2 threads; the worker's first iteration calibrates its 7 GEMM
// layouts (~1 ms in all), and from then on each runs on one MKL thread. The epoch's last batch
// of 6 rows brings new layouts: the 6-row GEMM differs with one thread here, so it runs on
// torch's team, and the iteration stays eager's bits.
//
// Random inputs cannot prove that two summation orders agree on every input, but different orders
// give different bits on random data with overwhelming probability, so an agreement means MKL
// took the same path both times. The MKL path depends on sizes, strides, alignment and thread
// count, which the layout holds, not on values.
//
// Why a dispatch key: the worker runs graphs through the TorchScript interpreter or fused
// segments, and a matrix product may also be nested in another op's kernel (addbmm's loop of
// addmm_); the dispatcher sees them all. Why FPGA: a functionality key right above Dense (below
// autograd, functionalization and Python modes), which no kernel of torch's uses (Xilinx's
// support lives out of tree): every op without a kernel of ours falls through it at no cost.
// A backend key (PrivateUse2, as capture/terra_key.h uses PrivateUse3) cannot fall through: its
// fallthrough removes the Dense functionality for every backend. Where another library has
// kernels on FPGA, the guard stays off.
//
// Locking: the verdicts are per process (workers of several programs share them) behind one
// mutex, held for a lookup only, never across a kernel; a calibration runs unlocked (two workers
// may calibrate one layout twice, with the same result).
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/impl/LocalDispatchKeySet.h>

namespace terra::runtime {

// Calls with more multiply-adds keep torch's team uncalibrated: at ~0.25 ms on one core a team's
// wake-up is small against the time a second thread saves (measured cost per call of a team whose
// thread waits for Python's core: ~10 us).
constexpr int64_t kMaxOneThreadMacs = int64_t{1} << 22;

// Registers the guard's kernels (once per process). False where the guard cannot work: no MKL
// per-thread team in this torch, TERRA_BLAS_GUARD=0, or another library has kernels on its key.
bool install_blas_guard();

// While alive, matrix products on this thread go through the guard; a no-op unless `enable`, the
// guard is installed, and torch runs more than one intra-op thread (one thread: the teams are
// equal). Restores the thread's dispatch TLS exactly on destruction.
class BlasGuardScope {
 public:
  explicit BlasGuardScope(bool enable);
  ~BlasGuardScope();
  BlasGuardScope(const BlasGuardScope&) = delete;
  BlasGuardScope& operator=(const BlasGuardScope&) = delete;
  bool active() const { return active_; }

 private:
  bool active_ = false;
  c10::impl::LocalDispatchKeySet saved_;
};

// What the guard did on the calling thread since it started (the GraphRunner adds its worker's
// calls to its stats after each iteration).
struct BlasGuardCalls {
  int64_t one_thread = 0;  // ran with one MKL thread (a calibrated layout)
  int64_t team = 0;        // ran with torch's team (other bits, too large, or not calibratable)
};
BlasGuardCalls blas_guard_calls_on_this_thread();

// The process's verdicts so far.
struct BlasGuardVerdicts {
  int64_t same = 0;     // layouts that run on one MKL thread
  int64_t differ = 0;   // layouts that keep torch's team: other bits or an error on random inputs
  int64_t large = 0;    // layouts over kMaxOneThreadMacs, never calibrated
  int64_t calibration_ns = 0;
  std::string why;      // the first layout that differed, and how
};
BlasGuardVerdicts blas_guard_verdicts();

}  // namespace terra::runtime
