// Record lookups, profiles and re-profiles of cache misses; see selector.h.
#include "profile/selector.h"

#include <exception>

#include "profile/conv_runner.h"

namespace terra::profile {

namespace {

uint64_t next_selector_id() {
  static std::atomic<uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}

}  // namespace

std::vector<EngineConfig> candidates_of(const Entry& entry) {
  std::vector<EngineConfig> out = entry.configs;
  bool listed = false;
  for (const EngineConfig& c : out) listed = listed || c.same_config(entry.least_memory);
  if (!listed) out.push_back(entry.least_memory);
  return out;
}

Selector::Selector(RecordStore store, SelectorOptions options)
    : id_(next_selector_id()), header_(store.header()), options_(options), store_(std::move(store)) {}

void Selector::note_locked(Diagnostic d) {
  if (d.level == Diagnostic::Level::warning) has_warnings_.store(true, std::memory_order_release);
  pending_.push_back(std::move(d));
}

void Selector::note(Diagnostic d) {
  std::lock_guard<std::mutex> lock(mu_);
  note_locked(std::move(d));
}

Candidates Selector::profile_locked(const ConvKey& key, int64_t batch, Provider& provider, Source source) {
  profiles_.fetch_add(1, std::memory_order_relaxed);
  Candidates out;
  out.source = source;
  std::vector<EngineConfig> measured;
  try {
    measured = provider.profile(key, batch, options_.workspace_cap);
  } catch (const std::exception& e) {
    out.error = std::string("profiling failed: ") + e.what();
    note_locked(warning(out.error + " (" + key.id() + ")"));
    return out;
  }
  auto entry = make_entry(key, batch, std::move(measured));
  if (!entry) {
    out.error = "no engine configuration could be profiled" +
                std::string(options_.workspace_cap ? " within the workspace cap of " +
                                                         std::to_string(*options_.workspace_cap) + " bytes"
                                                   : "");
    note_locked(warning(out.error + " (" + key.id() + ")"));
    return out;
  }
  const EngineConfig& best = entry->configs.front();
  note_locked(info("profiled " + key.id() + " at batch " + std::to_string(batch) + ": " + best.tag + ", " +
                   std::to_string(best.time_ms) + " ms, " + std::to_string(best.workspace_bytes) +
                   " B workspace (" + std::to_string(entry->configs.size()) + " configurations)"));
  out.configs = candidates_of(*entry);
  store_.put(std::move(*entry));
  if (options_.save_each_profile)
    for (Diagnostic& d : store_.save()) note_locked(std::move(d));
  return out;
}

Candidates Selector::candidates(const ConvKey& key, int64_t batch, Provider& provider) {
  std::lock_guard<std::mutex> lock(mu_);
  if (const Entry* e = store_.find(key)) {
    record_hits_.fetch_add(1, std::memory_order_relaxed);
    return Candidates{candidates_of(*e), Source::record, {}};
  }
  // Another process (a second rank, a parallel job) may have profiled it meanwhile.
  if (store_.changed_on_disk()) {
    for (Diagnostic& d : store_.load()) note_locked(std::move(d));
    if (const Entry* e = store_.find(key)) {
      record_hits_.fetch_add(1, std::memory_order_relaxed);
      return Candidates{candidates_of(*e), Source::record, {}};
    }
  }
  return profile_locked(key, batch, provider, Source::profiled);
}

Candidates Selector::reprofile(const ConvKey& key, int64_t batch, Provider& provider, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  note_locked(warning("no recorded configuration of " + key.id() + " runs at batch " + std::to_string(batch) +
                      ", nor a heuristic one (" + why + "); profiling it again"));
  // Plans cached for other batch sizes ran and stay valid; only this key's entry is replaced.
  return profile_locked(key, batch, provider, Source::reprofiled);
}

Outcome Selector::run(const ConvKey& key, int64_t batch, Provider& provider) {
  auto plan_key = make_plan_key(key, batch);
  if (!plan_key) {
    count_call();
    count_failure();
    Outcome out;
    out.error = "the record cannot describe " + key.id() + " (rank, dtype, layout or math mode)";
    note(warning(out.error));
    return out;
  }
  return run_convolution(*this, *plan_key, provider, thread_plan_cache());
}

Diagnostics Selector::load() {
  std::lock_guard<std::mutex> lock(mu_);
  epoch_.fetch_add(1, std::memory_order_acq_rel);
  return store_.load();
}

Diagnostics Selector::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  return store_.save();
}

Diagnostics Selector::drain() {
  std::lock_guard<std::mutex> lock(mu_);
  Diagnostics out = std::move(pending_);
  pending_.clear();
  has_warnings_.store(false, std::memory_order_release);
  return out;
}

Diagnostics Selector::drain_warnings() {
  if (!has_warnings_.load(std::memory_order_acquire)) return {};
  std::lock_guard<std::mutex> lock(mu_);
  Diagnostics warnings;
  Diagnostics rest;
  for (Diagnostic& d : pending_) (d.level == Diagnostic::Level::warning ? warnings : rest).push_back(std::move(d));
  pending_ = std::move(rest);
  has_warnings_.store(false, std::memory_order_release);
  return warnings;
}

SelectorStats Selector::stats() const {
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  return SelectorStats{get(calls_),       get(plan_hits_),      get(plan_builds_), get(record_hits_),
                       get(profiles_),    get(heuristic_runs_), get(fallbacks_),   get(failures_)};
}

std::vector<Entry> Selector::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  return store_.entries();
}

std::string Selector::path() const {
  std::lock_guard<std::mutex> lock(mu_);
  return store_.path();
}

}  // namespace terra::profile
