// Bounded spinning before a thread sleeps on a condition variable.
//
// The two co-execution threads hand work to each other many times per iteration (Python posts,
// the graph publishes, Python reads). On the development VM a condition-variable round trip
// between two threads costs ~46 us (each wake-up is a futex syscall plus a reschedule), while a
// spin on an atomic sees the other thread's store in ~1 us. A read in the middle of an iteration
// paid both wake-ups: the graph asleep waiting for posts, then Python asleep waiting for the
// value. So each waiter first spins for a short budget, then sleeps as before; spinning only
// uses a core the waiting thread holds anyway, and never for longer than the budget.
//
// TERRA_SPIN_US sets the budget in microseconds (default 200; 0 turns spinning off, for
// oversubscribed machines where a spinning thread takes a core another process needs). With a
// single CPU a spinner only delays the thread it waits for, so the default there is 0.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <thread>

#include "common/clock.h"

namespace terra::common {

inline std::chrono::nanoseconds spin_budget() {
  static const std::chrono::nanoseconds budget = [] {
    const char* env = std::getenv("TERRA_SPIN_US");
    long us = std::thread::hardware_concurrency() >= 2 ? 200 : 0;
    if (env != nullptr && *env != '\0') {
      char* end = nullptr;
      const long v = std::strtol(env, &end, 10);
      if (end != env && v >= 0) us = v;
    }
    return std::chrono::nanoseconds(std::chrono::microseconds(us));
  }();
  return budget;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Polls `ready` until it returns true (-> true) or `budget` has passed (-> false). The clock is
// read every 64 polls: `ready` is an atomic load, far cheaper than the clock. After the first
// few microseconds each of those reads also yields the CPU: on a machine where another process
// holds the other core, the thread we wait for may be queued behind us on ours, and a pure spin
// kept it off the CPU for the whole budget (an MLP step under one busy process: 465 us without
// spinning, 650 us with a pure spin). With nobody else runnable, sched_yield returns at once.
template <class Ready>
bool spin_until(Ready&& ready, std::chrono::nanoseconds budget) {
  if (budget.count() <= 0) return ready();
  const auto start = Clock::now();
  const auto deadline = start + budget;
  const auto yield_after = start + std::chrono::microseconds(5);
  for (uint32_t n = 1;; ++n) {
    if (ready()) return true;
    cpu_relax();
    if ((n & 63) == 0) {
      const auto now = Clock::now();
      if (now >= deadline) return ready();
      if (now >= yield_after) std::this_thread::yield();
    }
  }
}

}  // namespace terra::common
