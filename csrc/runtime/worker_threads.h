// The graph worker's share of the cores while Python runs ahead of it.
//
// Eager runs every kernel on the Python thread with torch's intra-op team (torch.get_num_threads(),
// all cores by default). Under co-execution the Python thread stays busy issuing placeholders
// while the worker runs the kernels, so a worker with the full team asks for one core more than
// the machine has. ATen's own kernels run inline on small tensors (at::parallel_for below its
// grain size), but MKL's GEMMs open a parallel region for every call, of any size (torch turns
// MKL's dynamic thread choice off in at::set_num_threads), and each one waits for a team member
// that has to be scheduled onto a core Python holds: on the 2-core development machine with
// torch's default of 2 threads, an 8-layer MLP step took 2-3.6 ms co-executed against 0.37 ms
// eagerly (benchmarks/coexec_profile.py --program mlp --threads 2), 0.22-0.30 ms with the
// worker's MKL team at one thread.
//
// The worker still keeps the full ATen team, because the team decides the bits: a full reduction
// over 3M floats differs between 1 and 2 threads in ATen, while co-execution gives eager's
// numbers. MKL's team decides the bits of some calls only (GEMMs with 5-7 rows against 8x32 and
// 32x32 weights: 24 of 81 small shapes tried; torch.dot over 65536 floats), so the worker's MKL
// also keeps torch's team, and its small matrix products (and norms, softmaxes, VML calls: ATen's
// parallel regions below a size where one thread is enough) take one thread call by call where a
// calibration of their layout found the same bits (runtime/team_guard.h). Where none does, the
// speed check sends an overhead-bound program to eager (terra_torch/_speed.py).
// TERRA_WORKER_BLAS_THREADS=<n> runs the worker's MKL with at most n threads without calibration:
// faster where GEMMs are small, no longer bitwise equal to eager where a call differs.
// test/python/test_worker_threads.py compares a co-executed loop bitwise with eager at the full
// team, on a program whose GEMMs and reductions both change with the team.
//
// No idle OpenMP pool beside eager's kernels. libgomp keeps a pool of team threads per thread
// that has opened a parallel region. Once the process's pools together hold more threads than it
// has cores, every team spins only ~100 times at its barriers before it sleeps on a futex, so each
// parallel region pays a wake-up of its team: a 16-channel conv + batch-norm step on 2 cores with
// 2 threads took 0.29 ms on the main thread, 0.71-0.86 ms on a second thread once the main thread
// had a pool (the main thread asleep), 0.36 ms after the main thread's pool was released. The
// worker makes a pool for the graph; when the program goes back to eager or to tracing, that pool
// would slow down every eager kernel (the speed check measured eager at 2.5x its own time and kept
// co-executing). So the worker gives its pool back once it has no iteration to run (the Program
// tells it; or no iteration came for kPoolIdle).
//
// Python's pool is kept while co-executing, although releasing it would let the worker's teams
// spin: a spinning team member takes the core the Python thread needs, and the overhead-bound
// programs co-execution is for went from 0.22-0.30 ms to 0.41-0.61 ms per MLP step with it
// released (2 threads on 2 cores, the worker's MKL at one thread). Kernel-bound programs with
// many parallel regions (cnn_bn) are slower co-executed than eager there; the speed check sends
// them to eager. Releasing Python's
// pool only for graph-bound programs was tried (decided per 16 iterations from the two threads'
// busy times): cnn_bn 0.80-0.93 ms per step instead of 2.4-2.9, still behind eager's 0.75-0.88,
// dcgan 4.5 ms against 3.5 eager; and a window that misjudged the MLP released its pool for good
// (Python makes no new one while co-executing), 0.40-0.56 ms per step. Not kept.
#pragma once

namespace terra::runtime {

// What the worker thread's kernels may use: `intra_op` (torch's setting, the process's) and
// `blas` (MKL's team on this thread: `intra_op` unless TERRA_WORKER_BLAS_THREADS asks for fewer).
struct WorkerThreadBudget {
  int intra_op = 1;
  int blas = 0;
};

// Called on a worker thread before it runs kernels: a new thread's OpenMP team is the library
// default (all cores), not what the user set with torch.set_num_threads, so the process setting
// is taken first, then MKL's team is set as above.
WorkerThreadBudget adopt_worker_thread_budget();
// The same with the team of the thread that launched the work (the torch.compile backend's
// graph thread runs graphs launched with various torch.set_num_threads): cheap when the thread
// has that team already, so it is called per graph.
WorkerThreadBudget adopt_worker_thread_budget_of(int intra_op);

// Whether this torch has MKL's per-thread team (x86 wheels; aarch64 wheels use OpenBLAS).
bool can_limit_blas_team();

// The calling thread's teams for the guard's life, then what they were: OpenMP's (the thread's
// own setting, which ATen's at::parallel_for and oneDNN read) is `omp_threads`, MKL's is
// `blas_threads` (0: the process's setting, the team eager runs with). A runtime that is missing
// (no MKL, no OpenMP that exports omp_set_num_threads) is left alone. runtime/team_guard.h runs
// calibrated calls this way, with one thread or with torch's teams.
class TeamSizeGuard {
 public:
  TeamSizeGuard(int omp_threads, int blas_threads);
  ~TeamSizeGuard();
  TeamSizeGuard(const TeamSizeGuard&) = delete;
  TeamSizeGuard& operator=(const TeamSizeGuard&) = delete;

 private:
  bool omp_active_;
  int omp_previous_;
  bool blas_active_;
  int blas_previous_;
};

// Gives the calling thread's OpenMP pool back (its team threads exit; the next parallel region
// on this thread makes a new pool of the same size). A no-op inside a parallel region, where the
// intra-op team has one thread, and with TERRA_OPENMP_POOL_RELEASE=0 (for comparisons).
void release_openmp_pool();
// Whether release_openmp_pool() can give a pool back here (an OpenMP runtime that exports
// omp_pause_resource_all, and TERRA_OPENMP_POOL_RELEASE is not 0).
bool can_release_openmp_pool();

}  // namespace terra::runtime
