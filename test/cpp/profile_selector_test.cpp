// The selection policy against the scripted FakeProvider: profile once and reuse (across batch
// sizes and across runs), respect the workspace cap, fall back when a recorded algorithm fails.
#include <gtest/gtest.h>

#include "profile/fake_provider.h"
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

Selector make_selector(const std::string& path, WorkspaceCap cap = std::nullopt) {
  RecordStore store(path, h200());
  store.load();
  return Selector(std::move(store), SelectorOptions{cap, true});
}

// Fastest first: 4 (FFT-like, 1 MiB/sample), 1 (1 KiB/sample), 0 (no workspace).
TEST(ProfileSelector, ProfilesOnceThenReusesAcrossBatchSizes) {
  ScratchDir dir;
  Selector selector = make_selector(dir.file("r.json"));
  FakeProvider fake;

  Outcome first = selector.run(call_at(32).key, 32, fake);
  ASSERT_TRUE(first.ok) << first.error;
  EXPECT_EQ(first.source, Source::profiled);
  EXPECT_EQ(first.algo.algo, 4);
  EXPECT_FALSE(first.fell_back);

  for (int64_t batch : {1, 7, 64, 256}) {
    Outcome o = selector.run(call_at(batch).key, batch, fake);
    ASSERT_TRUE(o.ok);
    EXPECT_EQ(o.source, Source::record) << "batch " << batch << " must reuse the batch-32 profile";
    EXPECT_EQ(o.algo.algo, 4);
  }
  EXPECT_EQ(fake.profile_calls(), 1);
  EXPECT_EQ(selector.run(call_at(64).key, 64, fake).source, Source::memo);

  Outcome other_layer = selector.run(call_at(32, 128).key, 32, fake);
  EXPECT_EQ(other_layer.source, Source::profiled);
  EXPECT_EQ(fake.profile_calls(), 2);

  SelectorStats stats = selector.stats();
  EXPECT_EQ(stats.calls, 7);
  EXPECT_EQ(stats.profiles, 2);
  EXPECT_EQ(stats.record_hits, 4);
  EXPECT_EQ(stats.memo_hits, 1);
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
  EXPECT_EQ(o.algo.algo, 4);
  EXPECT_TRUE(run2.run(make_key(resnet_call(48), Pass::grad_weight).key, 48, fake).ok);
  EXPECT_EQ(fake.profile_calls(), 0);
}

TEST(ProfileSelector, FailingAlgorithmFallsBackToTheNextRanked) {
  ScratchDir dir;
  Selector selector = make_selector(dir.file("r.json"));
  FakeProvider fake;
  ASSERT_TRUE(selector.run(call_at(32).key, 32, fake).ok);  // profiled: 4, 1, 0

  fake.set_run_status(4, RunStatus::out_of_memory);
  Outcome o = selector.run(call_at(32).key, 32, fake);
  ASSERT_TRUE(o.ok) << o.error;
  EXPECT_TRUE(o.fell_back);
  EXPECT_EQ(o.algo.algo, 1);
  ASSERT_EQ(o.failed.size(), 1u);
  EXPECT_EQ(o.failed[0].first.algo, 4);
  EXPECT_EQ(o.failed[0].second, RunStatus::out_of_memory);
  EXPECT_EQ(fake.profile_calls(), 1) << "a fallback is not a re-profile";
  EXPECT_EQ(selector.stats().fallbacks, 1);
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
  EXPECT_EQ(o.algo.algo, 0);
  EXPECT_EQ(o.failed.size(), 2u);
  EXPECT_EQ(fake.attempted_algos(), (std::vector<int>{4, 4, 1, 0}));
}

TEST(ProfileSelector, LeastMemoryIsTriedEvenWhenNotAmongTheRanked) {
  ScratchDir dir;
  Selector selector = make_selector(dir.file("r.json"));
  FakeProvider fake({FakeAlgo{7, "fast", 1.0, 10}, FakeAlgo{2, "small", 9.0, 0}});
  // A hand-edited record: only the fast one ranked, the small one kept as least memory.
  KeyedCall kc = call_at(8);
  Entry e = *make_entry(kc.key, 8, {AlgoPerf{7, 0, "fast", 8.0, 80}});
  e.least_memory = AlgoPerf{2, 0, "small", 72.0, 0};
  RecordStore store(dir.file("edited.json"), h200());
  store.put(e);
  store.save();
  Selector edited = make_selector(dir.file("edited.json"));
  fake.set_run_status(7, RunStatus::not_supported);
  Outcome o = edited.run(kc.key, 8, fake);
  ASSERT_TRUE(o.ok);
  EXPECT_EQ(o.algo.algo, 2);
  EXPECT_EQ(o.source, Source::record);
  EXPECT_EQ(fake.profile_calls(), 0);
}

TEST(ProfileSelector, WorkspaceCapBoundsProfilingAndRunning) {
  ScratchDir dir;
  const uint64_t cap = 64 << 10;  // 64 KiB: FFT (1 MiB per sample) never fits
  Selector selector = make_selector(dir.file("r.json"), cap);
  FakeProvider fake;
  Outcome o = selector.run(call_at(32).key, 32, fake);
  ASSERT_TRUE(o.ok);
  EXPECT_EQ(o.algo.algo, 1);  // 32 KiB at batch 32
  ASSERT_EQ(selector.entries().size(), 1u);
  for (const AlgoPerf& a : selector.entries()[0].algorithms) EXPECT_LE(a.workspace_bytes, cap) << a.algo;

  // At batch 128 algorithm 1 needs 128 KiB: over the cap, so the least-memory one runs.
  Outcome big = selector.run(call_at(128).key, 128, fake);
  ASSERT_TRUE(big.ok);
  EXPECT_EQ(big.algo.algo, 0);
  ASSERT_EQ(big.failed.size(), 1u);
  EXPECT_EQ(big.failed[0].second, RunStatus::exceeds_cap);
  EXPECT_EQ(fake.profile_calls(), 1);
}

TEST(ProfileSelector, RecordThatNoLongerRunsIsProfiledAgain) {
  ScratchDir dir;
  {
    Selector before = make_selector(dir.file("r.json"));
    FakeProvider fake;
    ASSERT_TRUE(before.run(call_at(32).key, 32, fake).ok);
  }
  // After a library change algorithms 4, 1 and 0 are gone, 5 is new.
  FakeProvider changed({FakeAlgo{5, "new", 0.5, 0}});
  Selector after = make_selector(dir.file("r.json"));
  Outcome o = after.run(call_at(32).key, 32, changed);
  ASSERT_TRUE(o.ok) << o.error;
  EXPECT_EQ(o.source, Source::reprofiled);
  EXPECT_EQ(o.algo.algo, 5);
  EXPECT_EQ(changed.profile_calls(), 1);
  bool warned = false;
  for (const Diagnostic& d : after.drain()) warned = warned || d.message.find("profiling it again") != std::string::npos;
  EXPECT_TRUE(warned);

  Selector third = make_selector(dir.file("r.json"));
  EXPECT_EQ(third.run(call_at(32).key, 32, changed).source, Source::record) << "the new profile was saved";
}

TEST(ProfileSelector, BatchDependentFailureDoesNotPoisonOtherBatches) {
  ScratchDir dir;
  Selector selector = make_selector(dir.file("r.json"));
  FakeAlgo fft{4, "FFT", 1.0, 0};
  fft.unsupported_from_batch = 100;  // e.g. 32-bit indexing limits at large batches
  FakeProvider fake({fft, FakeAlgo{0, "IMPLICIT_GEMM", 3.0, 0}});
  ASSERT_EQ(selector.run(call_at(32).key, 32, fake).algo.algo, 4);
  Outcome big = selector.run(call_at(128).key, 128, fake);
  EXPECT_EQ(big.algo.algo, 0);
  EXPECT_TRUE(big.fell_back);
  EXPECT_EQ(selector.run(call_at(32).key, 32, fake).algo.algo, 4);
  EXPECT_EQ(selector.run(call_at(128).key, 128, fake).source, Source::memo);
  EXPECT_EQ(fake.profile_calls(), 1);
}

TEST(ProfileSelector, NothingRunsIsAnErrorNotACrash) {
  ScratchDir dir;
  Selector selector = make_selector(dir.file("r.json"), /*cap=*/0);
  FakeProvider fake({FakeAlgo{4, "FFT", 1.0, 100}});
  Outcome o = selector.run(call_at(8).key, 8, fake);
  EXPECT_FALSE(o.ok);
  EXPECT_NE(o.error.find("workspace cap"), std::string::npos) << o.error;
  EXPECT_EQ(selector.stats().failures, 1);
  EXPECT_TRUE(selector.entries().empty());
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

}  // namespace
}  // namespace terra::profile
