// The selection policy of seed 001 (Algorithm 2), against an abstract Provider: look the
// convolution up in the record; if it is absent, profile it (under the user's workspace cap, so
// that profiling cannot overshoot memory), store it, and reuse it for every batch size. Extended
// with what a persisted record needs and the paper leaves out: a recorded algorithm that fails
// (not supported at this batch size, out of memory) falls back to the next ranked one, then to the
// least-memory one, and a record that no longer works at all is profiled again.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "profile/diagnostic.h"
#include "profile/provider.h"
#include "profile/record_store.h"

namespace terra::profile {

struct SelectorOptions {
  WorkspaceCap workspace_cap;     // applies to profiling and to running
  bool save_each_profile = true;  // persist at once: a crash later in start-up keeps the work
};

// Where the algorithm that ran was found.
enum class Source { memo, record, profiled, reprofiled };
std::string_view source_name(Source source);

struct Outcome {
  bool ok = false;
  AlgoPerf algo;                                      // the one that ran, when ok
  Source source = Source::record;
  bool fell_back = false;                             // not the first choice
  std::vector<std::pair<AlgoPerf, RunStatus>> failed;  // what was tried before, in order
  std::string error;                                  // when !ok
};

struct SelectorStats {
  int64_t calls = 0;
  int64_t memo_hits = 0;    // (key, batch) already resolved in this process
  int64_t record_hits = 0;  // entry found in the record (loaded or profiled earlier)
  int64_t profiles = 0;     // provider.profile calls, re-profiles included
  int64_t fallbacks = 0;    // runs that did not use the first choice
  int64_t failures = 0;     // calls where nothing ran
};

class Selector {
 public:
  Selector(RecordStore store, SelectorOptions options);

  // Chooses an algorithm for (key, batch) and runs it through `provider`. Thread-safe; the lock
  // is not held while a convolution runs, only while the record is consulted or profiled.
  Outcome run(const ConvKey& key, int64_t batch, Provider& provider);

  Diagnostics load();   // (re)reads the record file
  Diagnostics flush();  // saves unsaved entries (useful with save_each_profile = false)
  Diagnostics drain();  // messages gathered by run() since the last drain
  // Only the warnings (kernels raise them as torch warnings; infos wait for the Python logger).
  Diagnostics drain_warnings();

  SelectorStats stats() const;
  std::vector<Entry> entries() const;
  RecordHeader header() const;
  std::string path() const;
  WorkspaceCap workspace_cap() const;

 private:
  // Entry for the key: from the record (re-read if another process changed the file) or by
  // profiling. Called with mu_ held.
  const Entry* find_or_profile(const ConvKey& key, int64_t batch, Provider& provider, Source& source,
                               std::string& error);
  const Entry* profile_locked(const ConvKey& key, int64_t batch, Provider& provider, std::string& error);

  mutable std::mutex mu_;
  RecordStore store_;
  SelectorOptions options_;
  std::map<std::pair<std::string, int64_t>, AlgoPerf> memo_;  // (key id, batch) -> what worked
  Diagnostics pending_;
  SelectorStats stats_;
};

}  // namespace terra::profile
