// The selection policy against the scripted FakeProvider: profile once and reuse (across batch
// sizes and across runs), respect the workspace cap, fall back when a recorded configuration
// fails, re-profile a record that no longer runs, and re-profile a format-1 record.
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "profile/fake_provider.h"
#include "profile/record_json.h"
#include "profile/selector.h"
#include "profile_test_util.h"

namespace terra::profile {
namespace {

using testing::h200;
using testing::resnet_call;
using testing::ScratchDir;

KeyedCall call_at(int64_t batch, int64_t channels = 64) {
  return make_key(resnet_call(batch, channels), Pass::forward);
}

Selector make_selector(const std::string& path, WorkspaceCap cap = std::nullopt, Diagnostics* load_notes = nullptr) {
  RecordStore store(path, h200());
  Diagnostics notes = store.load();
  if (load_notes) *load_notes = notes;
  return Selector(std::move(store), SelectorOptions{cap, true});
}

int64_t engine_of(const Outcome& o) { return o.config ? o.config->engine : -1; }

bool has_message(const Diagnostics& ds, const std::string& fragment, Diagnostic::Level level) {
  for (const Diagnostic& d : ds)
    if (d.level == level && d.message.find(fragment) != std::string::npos) return true;
  return false;
}

// Fastest first: 4 (FFT-like, 1 MiB/sample), 1 (1 KiB/sample), 0 (no workspace).
TEST(ProfileSelector, ProfilesOnceThenReusesAcrossBatchSizes) {
  ScratchDir dir;
  Selector selector = make_selector(dir.file("r.json"));
  FakeProvider fake;

  Outcome first = selector.run(call_at(32).key, 32, fake);
  ASSERT_TRUE(first.ok) << first.error;
  EXPECT_EQ(first.source, Source::profiled);
  EXPECT_EQ(engine_of(first), 4);
  EXPECT_FALSE(first.fell_back);

  for (int64_t batch : {1, 7, 64, 256}) {
    Outcome o = selector.run(call_at(batch).key, batch, fake);
    ASSERT_TRUE(o.ok);
    EXPECT_EQ(o.source, Source::record) << "batch " << batch << " must reuse the batch-32 profile";
    EXPECT_EQ(engine_of(o), 4);
  }
  EXPECT_EQ(fake.profile_calls(), 1);
  EXPECT_EQ(selector.run(call_at(64).key, 64, fake).source, Source::plan_cache);

  Outcome other_layer = selector.run(call_at(32, 128).key, 32, fake);
  EXPECT_EQ(other_layer.source, Source::profiled);
  EXPECT_EQ(fake.profile_calls(), 2);

  SelectorStats stats = selector.stats();
  EXPECT_EQ(stats.calls, 7);
  EXPECT_EQ(stats.profiles, 2);
  EXPECT_EQ(stats.record_hits, 4);
  EXPECT_EQ(stats.plan_hits, 1);
  EXPECT_EQ(stats.plan_builds, 6);
  ASSERT_EQ(selector.entries().size(), 2u);
  EXPECT_EQ(selector.entries()[0].profiled_batch, 32);
}

TEST(ProfileSelector, ASecondRunUsesTheRecordWithoutProfiling) {
  ScratchDir dir;
  {
    Selector run1 = make_selector(dir.file("r.json"));
    FakeProvider fake;
    ASSERT_TRUE(run1.run(call_at(16).key, 16, fake).ok);
    ASSERT_TRUE(run1.run(make_key(resnet_call(16), Pass::grad_weight).key, 16, fake).ok);
    EXPECT_EQ(fake.profile_calls(), 2);
  }
  Selector run2 = make_selector(dir.file("r.json"));
  FakeProvider fake;
  Outcome o = run2.run(call_at(48).key, 48, fake);
  ASSERT_TRUE(o.ok);
  EXPECT_EQ(o.source, Source::record);
  EXPECT_EQ(engine_of(o), 4);
  EXPECT_TRUE(run2.run(make_key(resnet_call(48), Pass::grad_weight).key, 48, fake).ok);
  EXPECT_EQ(fake.profile_calls(), 0);
}

TEST(ProfileSelector, ACachedPlanThatStopsRunningFallsBackToTheNextRanked) {
  ScratchDir dir;
  Selector selector = make_selector(dir.file("r.json"));
  FakeProvider fake;
  ASSERT_TRUE(selector.run(call_at(32).key, 32, fake).ok);  // profiled: 4, 1, 0; plan for 4 cached

  fake.set_run_status(4, RunStatus::out_of_memory);
  Outcome o = selector.run(call_at(32).key, 32, fake);
  ASSERT_TRUE(o.ok) << o.error;
  EXPECT_TRUE(o.fell_back);
  EXPECT_EQ(engine_of(o), 1);
  ASSERT_EQ(o.failed.size(), 1u);
  EXPECT_EQ(o.failed[0].first.engine, 4);
  EXPECT_EQ(o.failed[0].second, RunStatus::out_of_memory);
  EXPECT_EQ(fake.attempted(), (std::vector<int64_t>{4, 4, 1})) << "the failed plan is not built again";
  EXPECT_EQ(fake.profile_calls(), 1) << "a fallback is not a re-profile";
  EXPECT_EQ(selector.stats().fallbacks, 1);
  EXPECT_EQ(selector.run(call_at(32).key, 32, fake).source, Source::plan_cache) << "the fallback's plan is cached";
}

TEST(ProfileSelector, ThenToTheLeastMemoryOne) {
  ScratchDir dir;
  Selector selector = make_selector(dir.file("r.json"));
  FakeProvider fake;
  ASSERT_TRUE(selector.run(call_at(32).key, 32, fake).ok);
  fake.set_run_status(4, RunStatus::not_supported);
  fake.set_run_status(1, RunStatus::failed);
  Outcome o = selector.run(call_at(32).key, 32, fake);
  ASSERT_TRUE(o.ok);
  EXPECT_EQ(engine_of(o), 0);
  EXPECT_EQ(o.failed.size(), 2u);
  EXPECT_EQ(fake.attempted(), (std::vector<int64_t>{4, 4, 1, 0}));
}

TEST(ProfileSelector, LeastMemoryIsTriedEvenWhenNotAmongTheRanked) {
  ScratchDir dir;
  FakeProvider fake({FakeAlgo{7, "fast", 1.0, 10}, FakeAlgo{2, "small", 9.0, 0}});
  // A hand-edited record: only the fast one ranked, the small one kept as least memory.
  KeyedCall kc = call_at(8);
  Entry e = *make_entry(kc.key, 8, {testing::config(7, 8.0, 80)});
  e.least_memory = testing::config(2, 72.0, 0);
  RecordStore store(dir.file("edited.json"), h200());
  store.put(e);
  store.save();
  Selector edited = make_selector(dir.file("edited.json"));
  fake.set_run_status(7, RunStatus::not_supported);
  Outcome o = edited.run(kc.key, 8, fake);
  ASSERT_TRUE(o.ok);
  EXPECT_EQ(engine_of(o), 2);
  EXPECT_EQ(o.source, Source::record);
  EXPECT_EQ(fake.profile_calls(), 0);
  EXPECT_EQ(fake.heuristics_calls(), 0) << "heuristics come after every recorded choice";
}

TEST(ProfileSelector, WorkspaceCapBoundsProfilingAndRunning) {
  ScratchDir dir;
  const uint64_t cap = 64 << 10;  // 64 KiB: FFT (1 MiB per sample) never fits
  Selector selector = make_selector(dir.file("r.json"), cap);
  FakeProvider fake;
  Outcome o = selector.run(call_at(32).key, 32, fake);
  ASSERT_TRUE(o.ok);
  EXPECT_EQ(engine_of(o), 1);  // 32 KiB at batch 32
  ASSERT_EQ(selector.entries().size(), 1u);
  for (const EngineConfig& c : selector.entries()[0].configs) EXPECT_LE(c.workspace_bytes, cap) << c.engine;

  // At batch 128 engine 1 needs 128 KiB: over the cap, so the least-memory one runs.
  Outcome big = selector.run(call_at(128).key, 128, fake);
  ASSERT_TRUE(big.ok);
  EXPECT_EQ(engine_of(big), 0);
  ASSERT_EQ(big.failed.size(), 1u);
  EXPECT_EQ(big.failed[0].second, RunStatus::exceeds_cap);
  EXPECT_EQ(fake.profile_calls(), 1);
}

TEST(ProfileSelector, RecordThatNoLongerRunsUsesHeuristicsBeforeReprofiling) {
  ScratchDir dir;
  {
    Selector before = make_selector(dir.file("r.json"));
    FakeProvider fake;
    ASSERT_TRUE(before.run(call_at(32).key, 32, fake).ok);
  }
  // After a library change engines 4, 1 and 0 are gone, 5 is new and cuDNN's heuristics name it.
  FakeProvider changed({FakeAlgo{5, "new", 0.5, 0}});
  Selector after = make_selector(dir.file("r.json"));
  Outcome o = after.run(call_at(32).key, 32, changed);
  ASSERT_TRUE(o.ok) << o.error;
  EXPECT_EQ(o.source, Source::heuristics);
  EXPECT_EQ(engine_of(o), 5);
  EXPECT_EQ(changed.profile_calls(), 0);
  EXPECT_EQ(after.stats().heuristic_runs, 1);
  EXPECT_TRUE(has_message(after.drain(), "heuristic choice", Diagnostic::Level::info));
}

TEST(ProfileSelector, RecordThatNoLongerRunsIsProfiledAgain) {
  ScratchDir dir;
  {
    Selector before = make_selector(dir.file("r.json"));
    FakeProvider fake;
    ASSERT_TRUE(before.run(call_at(32).key, 32, fake).ok);
  }
  // The new engine is not among the heuristics' choices: only a profile finds it.
  FakeAlgo fresh{5, "new", 0.5, 0};
  fresh.in_heuristics = false;
  FakeProvider changed({fresh});
  Selector after = make_selector(dir.file("r.json"));
  Outcome o = after.run(call_at(32).key, 32, changed);
  ASSERT_TRUE(o.ok) << o.error;
  EXPECT_EQ(o.source, Source::reprofiled);
  EXPECT_EQ(engine_of(o), 5);
  EXPECT_EQ(changed.profile_calls(), 1);
  EXPECT_EQ(changed.heuristics_calls(), 1) << "heuristics are asked before re-profiling";
  EXPECT_TRUE(has_message(after.drain(), "profiling it again", Diagnostic::Level::warning));

  Selector third = make_selector(dir.file("r.json"));
  EXPECT_EQ(third.run(call_at(32).key, 32, changed).source, Source::record) << "the new profile was saved";
}

TEST(ProfileSelector, BatchDependentFailureDoesNotPoisonOtherBatches) {
  ScratchDir dir;
  Selector selector = make_selector(dir.file("r.json"));
  FakeAlgo fft{4, "FFT", 1.0, 0};
  fft.unsupported_from_batch = 100;  // e.g. 32-bit indexing limits at large batches
  FakeProvider fake({fft, FakeAlgo{0, "IMPLICIT_GEMM", 3.0, 0}});
  ASSERT_EQ(engine_of(selector.run(call_at(32).key, 32, fake)), 4);
  Outcome big = selector.run(call_at(128).key, 128, fake);
  EXPECT_EQ(engine_of(big), 0);
  EXPECT_TRUE(big.fell_back);
  EXPECT_EQ(engine_of(selector.run(call_at(32).key, 32, fake)), 4);
  EXPECT_EQ(selector.run(call_at(128).key, 128, fake).source, Source::plan_cache);
  EXPECT_EQ(fake.profile_calls(), 1);
}

TEST(ProfileSelector, NothingRunsIsAnErrorNotACrash) {
  ScratchDir dir;
  Selector selector = make_selector(dir.file("r.json"), /*cap=*/0);
  FakeAlgo hungry{4, "FFT", 1.0, 100};
  hungry.in_heuristics = true;
  FakeProvider fake({hungry});
  Outcome o = selector.run(call_at(8).key, 8, fake);
  EXPECT_FALSE(o.ok);
  EXPECT_NE(o.error.find("exceeds_cap"), std::string::npos) << o.error;  // the heuristic one was tried
  EXPECT_EQ(selector.stats().failures, 1);
  EXPECT_TRUE(selector.entries().empty());
  EXPECT_TRUE(has_message(selector.drain(), "workspace cap", Diagnostic::Level::warning));
}

TEST(ProfileSelector, PicksUpEntriesAnotherProcessSavedMeanwhile) {
  ScratchDir dir;
  Selector ours = make_selector(dir.file("r.json"));
  {
    Selector theirs = make_selector(dir.file("r.json"));
    FakeProvider fake;
    ASSERT_TRUE(theirs.run(call_at(32).key, 32, fake).ok);
  }
  FakeProvider fake;
  Outcome o = ours.run(call_at(32).key, 32, fake);
  EXPECT_EQ(o.source, Source::record);
  EXPECT_EQ(fake.profile_calls(), 0);
}

TEST(ProfileSelector, AFormat1RecordIsReportedAndProfiledAgain) {
  ScratchDir dir;
  const std::string path = dir.file("v1.json");
  KeyedCall kc = call_at(32);
  nlohmann::json key = nlohmann::json::parse(encode(Record{h200(), {*make_entry(kc.key, 32, {testing::config(1, 1, 0)})}}))
                           ["entries"][0]["key"];
  nlohmann::json algo{{"algo", 1}, {"math_type", 0}, {"name", "IMPLICIT_PRECOMP_GEMM"}, {"time_ms", 0.8},
                      {"workspace_bytes", 4096}};
  nlohmann::json v1{{"format", kFormatName},
                    {"header", {{"format_version", 1}, {"device_name", "NVIDIA H200"}, {"compute_capability", "9.0"},
                                {"cudnn_version", 92400}, {"cuda_version", 13000}, {"torch_version", "2.14.1"}}},
                    {"entries", {{{"id", kc.key.id()}, {"key", key}, {"profiled_batch", 32},
                                  {"algorithms", {algo}}, {"least_memory", algo}}}}};
  testing::spit(path, v1.dump());

  Diagnostics notes;
  Selector selector = make_selector(path, std::nullopt, &notes);
  ASSERT_TRUE(has_message(notes, path, Diagnostic::Level::warning)) << "the warning names the file";
  EXPECT_TRUE(has_message(notes, "format version 1", Diagnostic::Level::warning));
  FakeProvider fake;
  Outcome o = selector.run(kc.key, 32, fake);
  ASSERT_TRUE(o.ok) << o.error;
  EXPECT_EQ(o.source, Source::profiled);
  EXPECT_EQ(fake.profile_calls(), 1);
  // The saved file is format 2; the old one was kept aside.
  Decoded now = decode(testing::slurp(path));
  ASSERT_EQ(now.status, DecodeStatus::ok);
  EXPECT_EQ(now.record.header.format_version, 2);
  ASSERT_EQ(now.record.entries.size(), 1u);
  EXPECT_EQ(now.record.entries[0].configs.front().engine, 4);
  EXPECT_TRUE(std::filesystem::exists(path + ".bak"));
}

}  // namespace
}  // namespace terra::profile
