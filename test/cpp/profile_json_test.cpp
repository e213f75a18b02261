// The file format: canonical bytes, round trips, and untrusted input that is reported, not thrown.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "profile/record_json.h"
#include "profile_test_util.h"

namespace terra::profile {
namespace {

using testing::h200;
using testing::resnet_call;

Entry entry_for(int64_t channels, Pass pass = Pass::forward) {
  KeyedCall kc = make_key(resnet_call(32, channels), pass);
  return *make_entry(kc.key, kc.batch,
                     {AlgoPerf{1, 0, "IMPLICIT_PRECOMP_GEMM", 0.816864, 4096},
                      AlgoPerf{0, 0, "IMPLICIT_GEMM", 1.5, 0},
                      AlgoPerf{3, 1, "FFT_TILING", 0.809984, 1 << 24}});
}

TEST(ProfileJson, RanksFastestFirstAndKeepsLeastMemory) {
  Entry e = entry_for(64);
  ASSERT_EQ(e.algorithms.size(), 3u);
  EXPECT_EQ(e.algorithms[0].algo, 3);  // the Fig. 1 example of seed 001: 0.809984 < 0.816864
  EXPECT_EQ(e.algorithms[1].algo, 1);
  EXPECT_EQ(e.algorithms[2].algo, 0);
  EXPECT_EQ(e.least_memory.algo, 0);
  EXPECT_EQ(e.profiled_batch, 32);
}

TEST(ProfileJson, DuplicateAlgorithmsKeepTheFastestTiming) {
  std::vector<AlgoPerf> perfs{{1, 0, "a", 2.0, 0}, {1, 0, "a", 1.0, 0}, {1, 1, "a", 3.0, 0}};
  rank(perfs);
  ASSERT_EQ(perfs.size(), 2u);  // (1, math 0) once, (1, math 1) kept: a different kernel
  EXPECT_DOUBLE_EQ(perfs[0].time_ms, 1.0);
  EXPECT_EQ(perfs[1].math_type, 1);
}

TEST(ProfileJson, RoundTripsAndIsCanonical) {
  Record a{h200(), {entry_for(64), entry_for(128), entry_for(64, Pass::grad_weight)}};
  Record b{h200(), {entry_for(64, Pass::grad_weight), entry_for(128), entry_for(64)}};
  std::string bytes = encode(a);
  EXPECT_EQ(bytes, encode(b)) << "insertion order must not change the bytes";

  Decoded d = decode(bytes);
  ASSERT_EQ(d.status, DecodeStatus::ok);
  EXPECT_TRUE(d.problems.empty());
  EXPECT_EQ(d.record.header, h200());
  ASSERT_EQ(d.record.entries.size(), 3u);
  EXPECT_EQ(encode(d.record), bytes) << "decode(encode(x)) must re-encode to the same bytes";
  for (size_t i = 1; i < d.record.entries.size(); ++i)
    EXPECT_LT(d.record.entries[i - 1].key.id(), d.record.entries[i].key.id());
  // Doubles survive exactly (the selection compares them).
  bool found = false;
  for (const Entry& e : d.record.entries)
    for (const AlgoPerf& p : e.algorithms) found = found || p.time_ms == 0.809984;
  EXPECT_TRUE(found);
}

TEST(ProfileJson, BatchIsNotPartOfTheStoredKey) {
  auto doc = nlohmann::json::parse(encode(Record{h200(), {entry_for(64)}}));
  const auto& entry = doc["entries"][0];
  EXPECT_EQ(entry["key"]["input"], nlohmann::json({64, 56, 56}));
  EXPECT_EQ(entry["profiled_batch"], 32);
  EXPECT_FALSE(entry["key"].contains("batch"));
  EXPECT_EQ(doc["header"]["format_version"], kFormatVersion);
}

TEST(ProfileJson, GarbageIsCorruptNotACrash) {
  for (const char* text : {"", "{", "null", "[]", "{\"format\": 3}", "\x01\x02 binary",
                           "{\"format\": \"terra_torch.conv_profile_record\"}",
                           "{\"format\": \"terra_torch.conv_profile_record\", \"header\": {\"format_version\": 1}}"}) {
    Decoded d = decode(text);
    EXPECT_EQ(d.status, DecodeStatus::corrupt) << text;
    EXPECT_FALSE(d.problems.empty()) << text;
  }
}

TEST(ProfileJson, OtherFormatVersionIsIncompatible) {
  auto doc = nlohmann::json::parse(encode(Record{h200(), {entry_for(64)}}));
  doc["header"]["format_version"] = kFormatVersion + 1;
  Decoded d = decode(doc.dump());
  EXPECT_EQ(d.status, DecodeStatus::incompatible);
  EXPECT_TRUE(d.record.entries.empty());
  ASSERT_EQ(d.problems.size(), 1u);
  EXPECT_NE(d.problems[0].find("format version 2"), std::string::npos) << d.problems[0];
}

TEST(ProfileJson, BadEntriesAreDroppedOthersKept) {
  auto doc = nlohmann::json::parse(encode(Record{h200(), {entry_for(64), entry_for(128)}}));
  const int64_t spoiled = doc["entries"][0]["key"]["input"][0].get<int64_t>();
  doc["entries"][0]["key"]["groups"] = "three";
  doc["entries"].push_back(doc["entries"][1]);  // a duplicate key
  doc["entries"].push_back(nlohmann::json{{"key", 5}});
  Decoded d = decode(doc.dump());
  ASSERT_EQ(d.status, DecodeStatus::ok);
  ASSERT_EQ(d.record.entries.size(), 1u);
  EXPECT_EQ(d.record.entries[0].key.input[0], spoiled == 64 ? 128 : 64);
  ASSERT_EQ(d.problems.size(), 3u);
  EXPECT_NE(d.problems[0].find("'groups' is not an integer"), std::string::npos) << d.problems[0];
  EXPECT_NE(d.problems[1].find("repeats key"), std::string::npos) << d.problems[1];
}

TEST(ProfileJson, InconsistentKeyIsRejected) {
  auto doc = nlohmann::json::parse(encode(Record{h200(), {entry_for(64)}}));
  doc["entries"][0]["key"]["filter"] = nlohmann::json({64, 64, 3});  // rank too small
  Decoded d = decode(doc.dump());
  ASSERT_EQ(d.status, DecodeStatus::ok);
  EXPECT_TRUE(d.record.entries.empty());
  ASSERT_EQ(d.problems.size(), 1u);
  EXPECT_NE(d.problems[0].find("invalid key"), std::string::npos);
}

}  // namespace
}  // namespace terra::profile
