#include "runtime/worker_threads.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>

#include "common/env.h"

// MKL's per-thread team size, by its C name (mkl_service.h maps mkl_set_num_threads_local to it;
// the lower-case symbol libtorch exports is the Fortran entry, which takes a pointer). Weak: a
// torch build without MKL (aarch64 wheels use OpenBLAS) leaves it null, and the worker keeps the
// process setting.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
// OpenMP 5.0 (libgomp since GCC 9, torch's bundled copy included): frees the calling thread's
// pool. Weak, like the above: another OpenMP runtime, or none, leaves it null.
extern "C" int omp_pause_resource_all(int kind) __attribute__((weak));
extern "C" void omp_set_num_threads(int n) __attribute__((weak));
extern "C" int omp_get_max_threads() __attribute__((weak));

namespace terra::runtime {

namespace {

// TERRA_WORKER_BLAS_THREADS, or 0 when unset or not a number >= 1.
int blas_override() {
  static const int value = [] {
    const char* env = std::getenv("TERRA_WORKER_BLAS_THREADS");
    if (env == nullptr || *env == '\0') return 0;
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    return end != env && *end == '\0' && v >= 1 ? static_cast<int>(v) : 0;
  }();
  return value;
}

// MKL's team on this thread for an intra-op team of `intra_op`: the same, unless
// TERRA_WORKER_BLAS_THREADS asks for fewer (see the header).
int cap_blas(int intra_op) {
  int blas = intra_op;
  if (blas_override() > 0) blas = std::min(blas, blas_override());
  if (MKL_Set_Num_Threads_Local == nullptr) return intra_op;
  // (0: "the process's setting" on this thread.)
  MKL_Set_Num_Threads_Local(blas == intra_op ? 0 : blas);
  return blas;
}

}  // namespace

WorkerThreadBudget adopt_worker_thread_budget() {
  at::init_num_threads();  // the process's intra-op setting, on this thread's OpenMP and MKL teams
  const int intra_op = at::get_num_threads();
  return {intra_op, cap_blas(intra_op)};
}

WorkerThreadBudget adopt_worker_thread_budget_of(int intra_op) {
  if (at::get_num_threads() != intra_op) at::set_num_threads(intra_op);
  return {intra_op, cap_blas(intra_op)};
}

bool can_limit_blas_team() { return MKL_Set_Num_Threads_Local != nullptr; }

TeamSizeGuard::TeamSizeGuard(int omp_threads, int blas_threads)
    : omp_active_(omp_set_num_threads != nullptr && omp_get_max_threads != nullptr),
      omp_previous_(omp_active_ ? omp_get_max_threads() : 0),
      blas_active_(MKL_Set_Num_Threads_Local != nullptr),
      blas_previous_(blas_active_ ? MKL_Set_Num_Threads_Local(blas_threads) : 0) {
  if (omp_active_ && omp_threads != omp_previous_) omp_set_num_threads(omp_threads);
}

TeamSizeGuard::~TeamSizeGuard() {
  if (blas_active_) MKL_Set_Num_Threads_Local(blas_previous_);
  if (omp_active_ && omp_get_max_threads() != omp_previous_) omp_set_num_threads(omp_previous_);
}

bool can_release_openmp_pool() {
  static const bool enabled = !common::switched_off("TERRA_OPENMP_POOL_RELEASE");
  return enabled && omp_pause_resource_all != nullptr && omp_set_num_threads != nullptr;
}

void release_openmp_pool() {
  if (!can_release_openmp_pool()) return;
  const int team = at::get_num_threads();
  if (team <= 1 || at::in_parallel_region()) return;
  constexpr int kOmpPauseSoft = 1;  // omp_pause_soft: threads go, the runtime stays initialized
  omp_pause_resource_all(kOmpPauseSoft);
  // libgomp frees the thread's implicit task with its pool, and with it the team size the
  // thread was given (torch.set_num_threads): the next region would take the library default.
  omp_set_num_threads(team);
}

}  // namespace terra::runtime
