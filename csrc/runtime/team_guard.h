// One thread for the graph worker's small calls, call by call, where that keeps eager's bits.
//
// Why: under co-execution Python holds a core while the worker runs the kernels. With torch's
// default team (every core) each parallel region the worker opens waits for a team thread that
// has to be scheduled onto the core Python holds. MKL opens one for every GEMM of any size
// (2 threads on 2 cores, MLP + SGD: 0.49 ms of graph per iteration against 0.16-0.19 ms with
// one MKL thread); ATen opens one for a VML function over more than 2048 elements (Adam's
// `sqrt` of a 64x64 state: MLP + Adam spent 0.30 ms per iteration in the graph against 0.13 ms
// with one OpenMP thread), and for batch and layer norm, softmax and the fused optimizers at
// any size. But a team can decide the bits: MKL computes some calls differently with one thread
// (GEMMs of 5-7 rows against 8x32 and 32x32 weights, torch.dot over 65536 floats), and
// co-execution promises eager's numbers.
//
// So the worker keeps torch's teams, and each call of a listed op (guarded_ops() in team_guard.cpp:
// the matrix products, VML's elementwise functions, the norms and softmaxes, the fused
// optimizers; each with its in-place and out= forms) passes through a kernel on a dispatch key
// of our own, included in the worker thread's TLS while a graph runs. That kernel looks the call
// up by its *layout*: the op, torch's team size, each tensor's dtype, sizes, strides and
// data-pointer alignment, each other argument's value. A layout seen for the first time is calibrated there and then:
// the call runs on random inputs of that layout with torch's teams and again with one thread
// (OpenMP's and MKL's), and the results are compared bit for bit. Same bits: this and every
// later call of that layout runs on one thread. Other bits, an error, or a call too large for one
// thread to pay off (kMaxOneThreadMacs, kMaxOneThreadElements): torch's teams. Every other op
// runs with torch's teams. So a batch of a new size, a shape that follows from data, a fed int:
// every call is either calibrated or computed as eager computes it; nothing is decided per
// program.
//
// Example: an MLP + Adam at batch 32 on 2 threads; the worker's first iteration calibrates its
// GEMM and sqrt layouts (~1 ms in all), and from then on each runs on one thread. The epoch's
// last batch of 6 rows brings new layouts: the 6-row GEMM differs with one thread here, so it
// runs on torch's team, and the iteration stays eager's bits.
//
// Random inputs cannot prove that two computations agree on every input, but different summation
// orders (or a vector path against a scalar tail) give different bits on random data with
// overwhelming probability, so an agreement means the same path was taken both times. The path
// depends on sizes, strides, alignment, other arguments and the thread count, which the layout
// holds, not on values.
//
// Where: the co-execution worker (GraphRunner) and the Dynamo backend's overlap worker
// (direct_graph.cpp), the threads that run kernels while Python runs on.
//
// Why a dispatch key: the worker runs graphs through the TorchScript interpreter or fused
// segments, and a listed op may also be nested in another op's kernel (addbmm's loop of addmm_,
// a foreach op's per-tensor calls); the dispatcher sees them all. Why FPGA: a functionality key
// right above Dense (below autograd, functionalization and Python modes), which no kernel of
// torch's uses (Xilinx's support lives out of tree): every op without a kernel of ours falls
// through it at no cost. A backend key (PrivateUse2, as capture/terra_key.h uses PrivateUse3)
// cannot fall through: its fallthrough removes the Dense functionality for every backend. Where
// another library has kernels on FPGA, the guard stays off. FPGA is, though, among the keys the
// CompositeExplicitAutograd(NonFunctional) aliases fill, so ops with such a kernel and a CPU one
// get a kernel of ours that goes on below (install_team_guard); c10 refuses per-op fallthroughs.
//
// Locking: the verdicts are per process (workers of several programs share them) behind one
// mutex, held for a lookup only, never across a kernel; a calibration runs unlocked (two workers
// may calibrate one layout twice, with the same result).
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/impl/LocalDispatchKeySet.h>

namespace terra::runtime {

// Calls with more work keep torch's teams uncalibrated: at ~0.25 ms on one core a team's wake-up
// is small against the time a second thread saves. The wake-up's cost, ~10 us per call, is
// derived, not timed per call: 0.49 against 0.16-0.19 ms of graph per MLP + SGD iteration over its
// ~30 GEMMs. The limits are chosen from it, not tuned by a benchmark. Matrix products count
// multiply-adds, other ops the elements of their tensor arguments.
constexpr int64_t kMaxOneThreadMacs = int64_t{1} << 22;
constexpr int64_t kMaxOneThreadElements = int64_t{1} << 17;

// Registers the guard's kernels (once per process). False where the guard cannot work: no MKL
// per-thread team in this torch, TERRA_TEAM_GUARD=0, or another library has kernels on its key.
bool install_team_guard();

// While alive, listed ops on this thread go through the guard; a no-op unless `enable`, the guard
// is installed, and torch runs more than one intra-op thread (one thread: the teams are equal).
// Restores the thread's dispatch TLS exactly on destruction.
class TeamGuardScope {
 public:
  explicit TeamGuardScope(bool enable);
  ~TeamGuardScope();
  TeamGuardScope(const TeamGuardScope&) = delete;
  TeamGuardScope& operator=(const TeamGuardScope&) = delete;

 private:
  bool active_ = false;
  int previous_team_ = 0;
  c10::impl::LocalDispatchKeySet saved_;
};

// What the guard did on the calling thread since it started (the GraphRunner adds its worker's
// calls to its stats after each iteration).
struct TeamGuardCalls {
  int64_t one_thread = 0;  // ran on one thread (a calibrated layout)
  int64_t team = 0;        // ran with torch's teams (other bits, too large, or not calibratable)
};
TeamGuardCalls team_guard_calls_on_this_thread();

// The process's verdicts so far.
struct TeamGuardVerdicts {
  int64_t same = 0;     // layouts that run on one thread
  int64_t differ = 0;   // layouts that keep torch's teams: other bits or an error on random inputs
  int64_t large = 0;    // layouts over the limits above, never calibrated
  int64_t calibration_ns = 0;
  std::string why;      // the first layout that differed, and how
};
TeamGuardVerdicts team_guard_verdicts();

}  // namespace terra::runtime
