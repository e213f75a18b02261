// Selection policy with fallbacks; see selector.h.
#include "profile/selector.h"

#include <exception>
#include <optional>
#include <sstream>

namespace terra::profile {

namespace {

// Ranked algorithms, then the least-memory one if it is not among them.
std::vector<AlgoPerf> candidates_of(const Entry& entry) {
  std::vector<AlgoPerf> out = entry.algorithms;
  bool listed = false;
  for (const AlgoPerf& a : out) listed = listed || a.same_algorithm(entry.least_memory);
  if (!listed) out.push_back(entry.least_memory);
  return out;
}

bool already_failed(const Outcome& outcome, const AlgoPerf& algo) {
  for (const auto& [a, status] : outcome.failed)
    if (a.same_algorithm(algo)) return true;
  return false;
}

std::string describe_failures(const Outcome& outcome) {
  std::ostringstream out;
  for (size_t i = 0; i < outcome.failed.size(); ++i)
    out << (i ? ", " : "") << "algo " << outcome.failed[i].first.algo << ": "
        << run_status_name(outcome.failed[i].second);
  return out.str();
}

}  // namespace

std::string_view source_name(Source source) {
  switch (source) {
    case Source::memo: return "memo";
    case Source::record: return "record";
    case Source::profiled: return "profiled";
    case Source::reprofiled: return "reprofiled";
  }
  return "record";
}

Selector::Selector(RecordStore store, SelectorOptions options)
    : store_(std::move(store)), options_(options) {}

const Entry* Selector::profile_locked(const ConvKey& key, int64_t batch, Provider& provider,
                                      std::string& error) {
  ++stats_.profiles;
  std::vector<AlgoPerf> measured;
  try {
    measured = provider.profile(key, batch, options_.workspace_cap);
  } catch (const std::exception& e) {
    error = std::string("profiling failed: ") + e.what();
    pending_.push_back(warning(error + " (" + key.id() + ")"));
    return nullptr;
  }
  auto entry = make_entry(key, batch, std::move(measured));
  if (!entry) {
    error = "no algorithm could be profiled" +
            std::string(options_.workspace_cap ? " within the workspace cap of " +
                                                     std::to_string(*options_.workspace_cap) + " bytes"
                                               : "");
    pending_.push_back(warning(error + " (" + key.id() + ")"));
    return nullptr;
  }
  const AlgoPerf& best = entry->algorithms.front();
  pending_.push_back(info("profiled " + key.id() + " at batch " + std::to_string(batch) + ": algo " +
                          std::to_string(best.algo) + " " + best.name + ", " + std::to_string(best.time_ms) +
                          " ms, " + std::to_string(best.workspace_bytes) + " B workspace"));
  store_.put(std::move(*entry));
  // Results at other batch sizes were chosen from the old entry; let them be chosen again.
  for (auto it = memo_.begin(); it != memo_.end();)
    it = it->first.first == key.id() ? memo_.erase(it) : std::next(it);
  if (options_.save_each_profile)
    for (Diagnostic& d : store_.save()) pending_.push_back(std::move(d));
  return store_.find(key);
}

const Entry* Selector::find_or_profile(const ConvKey& key, int64_t batch, Provider& provider,
                                       Source& source, std::string& error) {
  if (const Entry* e = store_.find(key)) {
    source = Source::record;
    ++stats_.record_hits;
    return e;
  }
  // Another process (a second rank, a parallel job) may have profiled it meanwhile.
  if (store_.changed_on_disk()) {
    for (Diagnostic& d : store_.load()) pending_.push_back(std::move(d));
    if (const Entry* e = store_.find(key)) {
      source = Source::record;
      ++stats_.record_hits;
      return e;
    }
  }
  source = Source::profiled;
  return profile_locked(key, batch, provider, error);
}

Outcome Selector::run(const ConvKey& key, int64_t batch, Provider& provider) {
  Outcome outcome;
  const std::pair<std::string, int64_t> memo_key{key.id(), batch};

  // Runs the candidates in order, skipping any that already failed in this call.
  auto try_all = [&](const std::vector<AlgoPerf>& candidates) {
    for (const AlgoPerf& algo : candidates) {
      if (already_failed(outcome, algo)) continue;
      RunStatus status = provider.run(key, batch, algo, options_.workspace_cap);
      if (status == RunStatus::ok) {
        std::lock_guard<std::mutex> lock(mu_);
        outcome.ok = true;
        outcome.algo = algo;
        outcome.fell_back = !outcome.failed.empty();
        if (outcome.fell_back) ++stats_.fallbacks;
        memo_[memo_key] = algo;
        return true;
      }
      outcome.failed.emplace_back(algo, status);
    }
    return false;
  };

  // 1. What worked for this key and batch before, in this process.
  std::optional<AlgoPerf> memo;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.calls;
    if (auto it = memo_.find(memo_key); it != memo_.end()) memo = it->second;
    if (memo) ++stats_.memo_hits;
  }
  if (memo) {
    outcome.source = Source::memo;
    if (try_all({*memo})) return outcome;
    std::lock_guard<std::mutex> lock(mu_);
    memo_.erase(memo_key);
  }

  // 2. The record's entry (profiled now if it has none), ranked choices then least memory.
  std::vector<AlgoPerf> candidates;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Entry* entry = find_or_profile(key, batch, provider, outcome.source, error);
    if (entry) candidates = candidates_of(*entry);
  }
  if (!candidates.empty() && try_all(candidates)) return outcome;

  // 3. An entry from an earlier profile that no longer runs at all (another batch size, a
  //    changed library) is profiled again once, here, at this batch size.
  if (!candidates.empty() && outcome.source == Source::record) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(warning("every recorded algorithm failed for " + key.id() + " at batch " +
                                 std::to_string(batch) + " (" + describe_failures(outcome) +
                                 "); profiling it again"));
      outcome.source = Source::reprofiled;
      const Entry* entry = profile_locked(key, batch, provider, error);
      candidates = entry ? candidates_of(*entry) : std::vector<AlgoPerf>{};
    }
    if (!candidates.empty() && try_all(candidates)) return outcome;
  }

  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.failures;
  if (!outcome.failed.empty()) {
    std::string detail = provider.last_error();
    outcome.error = "no algorithm ran for " + key.id() + " at batch " + std::to_string(batch) + ": " +
                    describe_failures(outcome) + (detail.empty() ? "" : " (last error: " + detail + ")");
    pending_.push_back(warning(outcome.error));
  } else {
    outcome.error = error;  // profiling failed; profile_locked already reported it
  }
  return outcome;
}

Diagnostics Selector::load() {
  std::lock_guard<std::mutex> lock(mu_);
  memo_.clear();
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
  return out;
}

Diagnostics Selector::drain_warnings() {
  std::lock_guard<std::mutex> lock(mu_);
  Diagnostics warnings;
  Diagnostics rest;
  for (Diagnostic& d : pending_) (d.level == Diagnostic::Level::warning ? warnings : rest).push_back(std::move(d));
  pending_ = std::move(rest);
  return warnings;
}

SelectorStats Selector::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::vector<Entry> Selector::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  return store_.entries();
}

RecordHeader Selector::header() const {
  std::lock_guard<std::mutex> lock(mu_);
  return store_.header();
}

std::string Selector::path() const {
  std::lock_guard<std::mutex> lock(mu_);
  return store_.path();
}

WorkspaceCap Selector::workspace_cap() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_.workspace_cap;
}

}  // namespace terra::profile
