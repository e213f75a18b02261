// The graph worker's share of the cores while Python runs ahead of it.
//
// Eager runs every kernel on the Python thread with torch's intra-op team (torch.get_num_threads(),
// all cores by default). Under co-execution the Python thread stays busy issuing placeholders
// while the worker runs the kernels, so a worker with the full team asks for one core more than
// the machine has. For ATen's own kernels that costs nothing on small tensors (at::parallel_for
// runs inline below its grain size), but MKL's GEMMs open a parallel region for every call, of
// any size: torch turns MKL's dynamic thread choice off (at::set_num_threads). Each small GEMM
// then waits for a team member that has to be scheduled onto a core Python holds; on the 2-core
// development machine, with torch's default of 2 threads, an 8-layer MLP step went from 0.24 ms
// (1 thread) to 2-3.6 ms co-executed, against 0.37 ms eagerly (benchmarks/coexec_profile.py
// --threads 2).
//
// So the worker runs MKL with one thread fewer than the cores it may use, and at least one:
// MKL's GEMMs gave the same bits for 1 and 2 threads on every shape tried (16x32x32 to
// 2x1000000x2, mm, addmm and linear: they split the output, not the sum), and
// test/python/test_worker_threads.py compares a whole co-executed training loop bitwise with
// eager at the full team. ATen's own kernels and oneDNN keep the process's team: a full
// reduction's result depends on the number of threads (a sum over 3M floats differs between 1
// and 2), and co-execution gives eager's bits.
//
// TERRA_WORKER_BLAS_THREADS=<n> sets the worker's MKL team instead (0: leave MKL as the process
// set it), for comparisons.
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
// released (2 threads on 2 cores). Kernel-bound programs with many parallel regions (cnn_bn) are
// slower co-executed than eager there; the speed check sends them to eager.
#pragma once

namespace terra::runtime {

// What the worker thread's kernels may use: `intra_op` (torch's setting, the process's) and
// `blas` (MKL's team on this thread; 0 where MKL is not in this torch build).
struct WorkerThreadBudget {
  int intra_op = 1;
  int blas = 0;
};

// Called on a worker thread before it runs kernels, and again after anything set the thread's
// team (at::set_num_threads resets MKL's): a new thread's OpenMP team is the library default
// (all cores), not what the user set with torch.set_num_threads, so the process setting is taken
// first, then MKL's team is capped as above.
WorkerThreadBudget adopt_worker_thread_budget();

// Gives the calling thread's OpenMP pool back (its team threads exit; the next parallel region
// on this thread makes a new pool of the same size). A no-op inside a parallel region, where the
// intra-op team has one thread, and with TERRA_OPENMP_POOL_RELEASE=0 (for comparisons).
void release_openmp_pool();

}  // namespace terra::runtime
