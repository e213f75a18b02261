// The selection policy of seed 001 (Algorithm 2), against an abstract Provider: look the
// convolution up in the record; if it is absent, profile it (under the user's workspace cap, so
// that profiling cannot overshoot memory), store it, and reuse it for every batch size. Extended
// with what a persisted record needs and the paper leaves out: a recorded configuration that fails
// (not supported at this batch size, out of memory) falls back to the next ranked one, then to the
// backend's heuristics, and a record that no longer works at all is profiled again.
//
// The per-call path (plan cache, fallback order) is conv_runner.h; this class owns the record and
// answers the cache misses. Its lock is taken on misses only; counters are atomics.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "profile/diagnostic.h"
#include "profile/plan_cache.h"
#include "profile/provider.h"
#include "profile/record_store.h"

namespace terra::profile {

struct SelectorOptions {
  WorkspaceCap workspace_cap;     // applies to profiling and to running
  bool save_each_profile = true;  // persist at once: a crash later in start-up keeps the work
};

struct Outcome {
  bool ok = false;
  std::shared_ptr<const EngineConfig> config;  // the one that ran, when ok (shared: no copy per call)
  Source source = Source::record;
  bool fell_back = false;                                   // not the first choice
  std::vector<std::pair<EngineConfig, RunStatus>> failed;  // what was tried before, in order
  std::string error;                                        // when !ok
};

struct SelectorStats {
  int64_t calls = 0;
  int64_t plan_hits = 0;       // a cached plan ran: nothing was looked up or built
  int64_t plan_builds = 0;     // provider.build calls (successful or not)
  int64_t record_hits = 0;     // a miss found the key's entry in the record
  int64_t profiles = 0;        // provider.profile calls, re-profiles included
  int64_t heuristic_runs = 0;  // misses served by the backend's heuristics
  int64_t fallbacks = 0;       // misses that did not use the first choice
  int64_t failures = 0;        // calls where nothing ran
};

// The configurations a miss tries, and where they came from.
struct Candidates {
  std::vector<EngineConfig> configs;  // ranked, then least memory if not among them
  Source source = Source::record;     // record, profiled or reprofiled
  std::string error;                  // when empty: why (profiling failed, nothing fits the cap)
};

class Selector {
 public:
  Selector(RecordStore store, SelectorOptions options);

  // Chooses and runs a configuration for (key, batch) through `provider`, with the calling
  // thread's plan cache (conv_runner.h). For the fake path and tests; CUDA kernels build the
  // PlanKey themselves.
  Outcome run(const ConvKey& key, int64_t batch, Provider& provider);

  // Cache-miss path, thread-safe. The key's entry (re-read if another process changed the file,
  // profiled at this batch if absent).
  Candidates candidates(const ConvKey& key, int64_t batch, Provider& provider);
  // Every recorded configuration failed (`why`): profile the key again at this batch and replace it.
  Candidates reprofile(const ConvKey& key, int64_t batch, Provider& provider, const std::string& why);

  Diagnostics load();   // (re)reads the record file; plans chosen before are forgotten
  Diagnostics flush();  // saves unsaved entries (useful with save_each_profile = false)
  Diagnostics drain();  // messages gathered since the last drain
  // Only the warnings (kernels raise them as torch warnings; infos wait for the Python logger).
  // Without pending warnings it takes no lock, so kernels may call it on every call.
  Diagnostics drain_warnings();
  void note(Diagnostic diagnostic);

  SelectorStats stats() const;
  std::vector<Entry> entries() const;
  const RecordHeader& header() const { return header_; }  // fixed at construction: no lock
  std::string path() const;
  WorkspaceCap workspace_cap() const { return options_.workspace_cap; }  // fixed too

  // Identity of this selector and of its last load(), for plan caches (plan_cache.h).
  uint64_t id() const { return id_; }
  uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }

  // Counters of the per-call path (conv_runner.cpp).
  void count_call() { calls_.fetch_add(1, std::memory_order_relaxed); }
  void count_plan_hit() { plan_hits_.fetch_add(1, std::memory_order_relaxed); }
  void count_build() { plan_builds_.fetch_add(1, std::memory_order_relaxed); }
  void count_heuristic_run() { heuristic_runs_.fetch_add(1, std::memory_order_relaxed); }
  void count_fallback() { fallbacks_.fetch_add(1, std::memory_order_relaxed); }
  void count_failure() { failures_.fetch_add(1, std::memory_order_relaxed); }

 private:
  Candidates profile_locked(const ConvKey& key, int64_t batch, Provider& provider, Source source);
  void note_locked(Diagnostic diagnostic);

  const uint64_t id_;
  const RecordHeader header_;
  const SelectorOptions options_;
  std::atomic<uint64_t> epoch_{1};
  mutable std::mutex mu_;
  RecordStore store_;
  Diagnostics pending_;
  std::atomic<bool> has_warnings_{false};
  std::atomic<int64_t> calls_{0}, plan_hits_{0}, plan_builds_{0}, record_hits_{0}, profiles_{0},
      heuristic_runs_{0}, fallbacks_{0}, failures_{0};
};

// Ranked configurations, then the least-memory one if it is not among them.
std::vector<EngineConfig> candidates_of(const Entry& entry);

}  // namespace terra::profile
