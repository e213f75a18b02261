// The per-call path (conv_runner.h) with a counting fake provider: one plan build per exact
// problem, one execute per call, no profile with a warm record, the fallback order
// (ranked -> least memory -> heuristics -> re-profile), per-thread plan caches; and the PlanKey
// the cache is keyed by.
#include <gtest/gtest.h>

#include <thread>

#include "profile/conv_runner.h"
#include "profile/fake_provider.h"
#include "profile_test_util.h"

namespace terra::profile {
namespace {

using testing::h200;
using testing::resnet_call;
using testing::ScratchDir;

KeyedCall call_at(int64_t batch, int64_t channels = 64) {
  return make_key(resnet_call(batch, channels), Pass::forward);
}

PlanKey plan_at(int64_t batch, int64_t channels = 64, uint8_t align = 16) {
  KeyedCall kc = call_at(batch, channels);
  return *make_plan_key(kc.key, batch, 0, align);
}

std::unique_ptr<Selector> make_selector(const std::string& path, WorkspaceCap cap = std::nullopt) {
  RecordStore store(path, h200());
  store.load();
  return std::make_unique<Selector>(std::move(store), SelectorOptions{cap, true});
}

TEST(ProfilePlanKey, RoundTripsToTheRecordKey) {
  for (Pass pass : {Pass::forward, Pass::grad_input, Pass::grad_weight}) {
    ConvCall call = resnet_call(8);
    call.stride = {2, 1};
    call.output = {8, 64, 28, 56};
    call.dtype = "bfloat16";
    call.layout = "nhwc";
    call.deterministic = true;
    KeyedCall kc = make_key(call, pass);
    auto pk = make_plan_key(kc.key, kc.batch);
    ASSERT_TRUE(pk);
    EXPECT_EQ(pk->batch, 8);
    EXPECT_EQ(record_key(*pk), kc.key) << kc.key.id();
  }
}

TEST(ProfilePlanKey, BatchAlignmentAndShapeAllCount) {
  const PlanKey base = plan_at(32);
  EXPECT_EQ(base, plan_at(32));
  EXPECT_EQ(base.hash(), plan_at(32).hash());
  for (const PlanKey& other : {plan_at(33), plan_at(32, 128), plan_at(32, 64, 8)}) {
    EXPECT_FALSE(base == other);
    EXPECT_NE(base.hash(), other.hash());
    // ... while batch and alignment do not change the record key.
  }
  EXPECT_EQ(record_key(plan_at(33)), record_key(base));
  EXPECT_EQ(record_key(plan_at(32, 64, 8)), record_key(base));
}

TEST(ProfilePlanKey, KernelsAndRecordKeysBuildTheSameKey) {
  // What the CUDA kernels pass (raw arrays, batch first) against the fake path's ConvKey route.
  const int64_t x[] = {32, 64, 56, 56}, w[] = {64, 64, 3, 3}, y[] = {32, 64, 56, 56};
  const int64_t pad[] = {1, 1}, stride[] = {1, 1}, dil[] = {1, 1};
  ProblemDims d;
  d.x = x, d.w = w, d.y = y, d.padding = pad, d.stride = stride, d.dilation = dil;
  EXPECT_EQ(*make_plan_key(d), plan_at(32));
  d.spatial = 4;
  EXPECT_FALSE(make_plan_key(d)) << "ranks beyond 3-d are left to PyTorch";
  ConvKey odd = call_at(1).key;
  odd.dtype = "int8";
  EXPECT_FALSE(make_plan_key(odd, 1));
}

TEST(ProfilePlanKey, MathModeAndLayoutAgreeWithTheRecordKeys) {
  // The kernels build PlanKeys from enums, the fake path from ConvKey strings: the same choices.
  for (const char* dtype : {"float32", "float16", "bfloat16", "float64"})
    for (bool tf32 : {false, true})
      EXPECT_EQ(math_mode_name(math_mode_for(*parse_dtype(dtype), tf32)), default_math_mode(dtype, tf32))
          << dtype << " tf32=" << tf32;
  EXPECT_EQ(layout_name(layout_for(true, 2)), "nhwc");
  EXPECT_EQ(layout_name(layout_for(false, 3)), "ncdhw");
  EXPECT_EQ(layout_name(layout_for(true, 3)), "ndhwc");
}

TEST(ProfilePlanKey, ByteAlignment) {
  alignas(16) static char buffer[64];
  EXPECT_EQ(byte_alignment(buffer), 16);
  EXPECT_EQ(byte_alignment(buffer + 4), 4);
  EXPECT_EQ(byte_alignment(buffer + 2), 2);
  EXPECT_EQ(byte_alignment(buffer + 1), 1);
  EXPECT_EQ(byte_alignment(buffer + 32), 16);
}

TEST(ProfileRunner, OnePlanBuildPerShapeAndOneExecutePerCall) {
  ScratchDir dir;
  auto selector = make_selector(dir.file("r.json"));
  FakeProvider fake;
  PlanCache cache;
  for (int step = 0; step < 50; ++step)
    for (int64_t batch : {32, 64}) {
      Outcome o = run_convolution(*selector, plan_at(batch), fake, cache);
      ASSERT_TRUE(o.ok) << o.error;
      EXPECT_EQ(o.config->engine, 4);
    }
  EXPECT_EQ(fake.profile_calls(), 1) << "one key, profiled once";
  EXPECT_EQ(fake.build_calls(), 2) << "one plan per (key, shape)";
  EXPECT_EQ(fake.execute_calls(), 100) << "one execute per call, no retries";
  EXPECT_EQ(cache.size(), 2u);
  SelectorStats s = selector->stats();
  EXPECT_EQ(s.calls, 100);
  EXPECT_EQ(s.plan_hits, 98);
  EXPECT_EQ(s.plan_builds, 2);
  // A pointer with another alignment is another plan: cuDNN finalizes plans for it.
  ASSERT_TRUE(run_convolution(*selector, plan_at(32, 64, 4), fake, cache).ok);
  EXPECT_EQ(fake.build_calls(), 3);
}

TEST(ProfileRunner, AWarmRecordProfilesNothing) {
  ScratchDir dir;
  {
    auto cold = make_selector(dir.file("r.json"));
    FakeProvider fake;
    PlanCache cache;
    for (int64_t channels : {64, 128, 256}) ASSERT_TRUE(run_convolution(*cold, plan_at(32, channels), fake, cache).ok);
    EXPECT_EQ(fake.profile_calls(), 3);
  }
  auto warm = make_selector(dir.file("r.json"));
  FakeProvider fake;
  PlanCache cache;
  for (int step = 0; step < 10; ++step)
    for (int64_t channels : {64, 128, 256}) ASSERT_TRUE(run_convolution(*warm, plan_at(16, channels), fake, cache).ok);
  EXPECT_EQ(fake.profile_calls(), 0);
  EXPECT_EQ(fake.heuristics_calls(), 0);
  EXPECT_EQ(fake.build_calls(), 3);
  EXPECT_EQ(fake.execute_calls(), 30);
  EXPECT_EQ(warm->stats().record_hits, 3);
}

// Recorded at batch 32: 4, 1, 0. Engine 9 is never timed (beyond cuDNN's benchmark limit) but is
// among the heuristics' choices.
std::vector<FakeAlgo> batch_limited_script() {
  FakeAlgo fast{4, "FFT", 1.0, 0};
  fast.unsupported_from_batch = 100;
  FakeAlgo mid{1, "PRECOMP", 2.0, 0};
  mid.unsupported_from_batch = 100;
  FakeAlgo slow{0, "GEMM", 3.0, 0};
  slow.unsupported_from_batch = 200;
  FakeAlgo heuristic{9, "HEURISTIC", 5.0, 0};
  heuristic.in_profile = false;
  heuristic.unsupported_from_batch = 400;
  return {fast, mid, slow, heuristic};
}

TEST(ProfileRunner, FallbackOrderIsRankedThenHeuristicsThenReprofile) {
  ScratchDir dir;
  auto selector = make_selector(dir.file("r.json"));
  FakeProvider fake(batch_limited_script());
  PlanCache cache;
  ASSERT_EQ(run_convolution(*selector, plan_at(32), fake, cache).config->engine, 4);
  ASSERT_EQ(fake.built(), (std::vector<int64_t>{4}));

  // Batch 128: the recorded best does not build, the next ranked one neither, the third does.
  Outcome o128 = run_convolution(*selector, plan_at(128), fake, cache);
  ASSERT_TRUE(o128.ok);
  EXPECT_EQ(o128.source, Source::record);
  EXPECT_EQ(o128.config->engine, 0);
  EXPECT_TRUE(o128.fell_back);
  EXPECT_EQ(fake.built(), (std::vector<int64_t>{4, 4, 1, 0}));
  EXPECT_EQ(fake.heuristics_calls(), 0);

  // Batch 256: no recorded configuration builds; the heuristics' engine 9 does.
  Outcome o256 = run_convolution(*selector, plan_at(256), fake, cache);
  ASSERT_TRUE(o256.ok);
  EXPECT_EQ(o256.source, Source::heuristics);
  EXPECT_EQ(o256.config->engine, 9);
  EXPECT_EQ(fake.built(), (std::vector<int64_t>{4, 4, 1, 0, 4, 1, 0, 9})) << "failed ones are not rebuilt";
  EXPECT_EQ(fake.profile_calls(), 1);

  // Batch 512: nothing recorded nor heuristic builds: re-profiled at 512, which finds nothing
  // either (every engine is unsupported there), so the call goes to PyTorch with a reason.
  Outcome o512 = run_convolution(*selector, plan_at(512), fake, cache);
  EXPECT_FALSE(o512.ok);
  EXPECT_EQ(fake.profile_calls(), 2);
  EXPECT_NE(o512.error.find("no engine configuration"), std::string::npos) << o512.error;
  SelectorStats s = selector->stats();
  EXPECT_EQ(s.heuristic_runs, 1);
  EXPECT_EQ(s.fallbacks, 2);
  EXPECT_EQ(s.failures, 1);
  // The cached plans of the batches that worked still run without a build.
  const int builds = fake.build_calls();
  for (int64_t batch : {32, 128, 256}) EXPECT_EQ(run_convolution(*selector, plan_at(batch), fake, cache).source, Source::plan_cache);
  EXPECT_EQ(fake.build_calls(), builds);
}

TEST(ProfileRunner, ReprofileFindsWhatRunsAtTheNewBatch) {
  ScratchDir dir;
  auto selector = make_selector(dir.file("r.json"));
  // Engine 2 is only good for large batches and only a profile there finds it.
  FakeAlgo small_only{4, "SMALL", 1.0, 0};
  small_only.unsupported_from_batch = 100;
  FakeAlgo large{2, "LARGE", 9.0, 0};
  large.in_heuristics = false;
  large.unsupported_from_batch = 0;
  FakeProvider fake({small_only});
  PlanCache cache;
  ASSERT_TRUE(run_convolution(*selector, plan_at(32), fake, cache).ok);
  fake.script(call_at(32).key.id(), {small_only, large});
  Outcome o = run_convolution(*selector, plan_at(256), fake, cache);
  ASSERT_TRUE(o.ok) << o.error;
  EXPECT_EQ(o.source, Source::reprofiled);
  EXPECT_EQ(o.config->engine, 2);
  EXPECT_EQ(fake.profile_calls(), 2);
  EXPECT_EQ(selector->entries().at(0).profiled_batch, 256) << "the entry was replaced";
  EXPECT_EQ(run_convolution(*selector, plan_at(32), fake, cache).source, Source::plan_cache)
      << "the batch-32 plan stays valid after the re-profile";
}

TEST(ProfileRunner, EachThreadBuildsItsOwnPlansOnce) {
  ScratchDir dir;
  auto selector = make_selector(dir.file("r.json"));
  FakeProvider fake;
  // Sequential threads: the fake provider counts without locks.
  auto steps = [&] {
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(run_convolution(*selector, plan_at(32), fake, thread_plan_cache()).ok);
  };
  std::thread(steps).join();
  EXPECT_EQ(fake.build_calls(), 1);
  std::thread(steps).join();  // e.g. autograd's device thread: a handle, and so plans, of its own
  EXPECT_EQ(fake.build_calls(), 2);
  EXPECT_EQ(fake.execute_calls(), 10);
  EXPECT_EQ(fake.profile_calls(), 1) << "the record is shared between threads";
}

TEST(ProfileRunner, AFullPlanCacheStartsOverWithoutProfiling) {
  ScratchDir dir;
  auto selector = make_selector(dir.file("r.json"));
  FakeProvider fake;
  PlanCache cache(/*max_plans=*/3);
  for (int64_t batch = 1; batch <= 7; ++batch) ASSERT_TRUE(run_convolution(*selector, plan_at(batch), fake, cache).ok);
  EXPECT_LE(cache.size(), 3u);
  EXPECT_EQ(fake.build_calls(), 7);
  EXPECT_EQ(fake.profile_calls(), 1) << "the record still has the entry";
  EXPECT_EQ(run_convolution(*selector, plan_at(7), fake, cache).source, Source::plan_cache) << "the newest plan is kept";
}

TEST(ProfileRunner, ReloadingOrAnotherSelectorForgetsThePlans) {
  ScratchDir dir;
  auto selector = make_selector(dir.file("r.json"));
  FakeProvider fake;
  PlanCache cache;
  ASSERT_TRUE(run_convolution(*selector, plan_at(32), fake, cache).ok);
  ASSERT_EQ(run_convolution(*selector, plan_at(32), fake, cache).source, Source::plan_cache);
  selector->load();
  EXPECT_EQ(run_convolution(*selector, plan_at(32), fake, cache).source, Source::record);
  auto other = make_selector(dir.file("r.json"));
  EXPECT_EQ(run_convolution(*other, plan_at(32), fake, cache).source, Source::record);
  EXPECT_EQ(fake.build_calls(), 3);
}

}  // namespace
}  // namespace terra::profile
