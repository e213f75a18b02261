// The file format: canonical bytes, round trips, and untrusted input that is reported, not thrown.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "profile/record_json.h"
#include "profile_test_util.h"

namespace terra::profile {
namespace {

using testing::h200;
using testing::config;
using testing::resnet_call;

Entry entry_for(int64_t channels, Pass pass = Pass::forward) {
  KeyedCall kc = make_key(resnet_call(32, channels), pass);
  return *make_entry(kc.key, kc.batch,
                     {config(1, 0.816864, 4096, {{3, 0}, {2, 4}}, {"TENSOR_CORE"}),
                      config(0, 1.5, 0),
                      config(3, 0.809984, 1 << 24, {{17, 1}}, {"FFT", "REQUIRES_FILTER_INT8x32_REORDER"})});
}

TEST(ProfileJson, RanksFastestFirstAndKeepsLeastMemory) {
  Entry e = entry_for(64);
  ASSERT_EQ(e.configs.size(), 3u);
  EXPECT_EQ(e.configs[0].engine, 3);  // the Fig. 1 example of seed 001: 0.809984 < 0.816864
  EXPECT_EQ(e.configs[1].engine, 1);
  EXPECT_EQ(e.configs[2].engine, 0);
  EXPECT_EQ(e.least_memory.engine, 0);
  // Knobs are kept sorted by type: one spelling per configuration.
  EXPECT_EQ(e.configs[1].knobs, (std::vector<Knob>{{2, 4}, {3, 0}}));
  EXPECT_EQ(e.profiled_batch, 32);
}

TEST(ProfileJson, DuplicateAlgorithmsKeepTheFastestTiming) {
  std::vector<EngineConfig> configs{config(1, 2.0, 0, {{2, 1}}), config(1, 1.0, 0, {{2, 1}}),
                                    config(1, 3.0, 0, {{2, 2}})};
  rank(configs);
  ASSERT_EQ(configs.size(), 2u);  // (1, k2=1) once; (1, k2=2) kept: another kernel of that engine
  EXPECT_DOUBLE_EQ(configs[0].time_ms, 1.0);
  EXPECT_EQ(configs[1].knobs, (std::vector<Knob>{{2, 2}}));
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
    for (const EngineConfig& c : e.configs) found = found || c.time_ms == 0.809984;
  EXPECT_TRUE(found);
}

TEST(ProfileJson, V2SchemaRoundTripsByteIdentically) {
  Record a{h200(), {entry_for(64), entry_for(128, Pass::grad_input)}};
  const std::string bytes = encode(a);
  auto doc = nlohmann::json::parse(bytes);
  EXPECT_EQ(doc["header"]["format_version"], 2);
  const auto& e = doc["entries"][0];
  // Every field of the v2 schema is written, and read back exactly.
  for (const char* field : {"id", "key", "profiled_batch", "configs", "least_memory"}) EXPECT_TRUE(e.contains(field)) << field;
  const auto& best = e["configs"][0];
  EXPECT_EQ(best["engine"], 3);
  EXPECT_EQ(best["knobs"], nlohmann::json::parse("[[17, 1]]"));
  EXPECT_EQ(best["numerical_notes"], nlohmann::json({"FFT", "REQUIRES_FILTER_INT8x32_REORDER"}));
  EXPECT_EQ(best["tag"], "eng3_k17=1");
  EXPECT_EQ(e["least_memory"]["engine"], 0);

  Decoded d = decode(bytes);
  ASSERT_EQ(d.status, DecodeStatus::ok);
  ASSERT_EQ(d.record.entries.size(), 2u);
  EXPECT_EQ(encode(d.record), bytes);
  // And a decoded entry equals the one encoded, field by field (knobs, notes, doubles).
  for (const Entry& original : a.entries) {
    bool matched = false;
    for (const Entry& back : d.record.entries) matched = matched || back == original;
    EXPECT_TRUE(matched) << original.key.id();
  }
  // Re-encoding text that was written by hand in another key order gives the canonical bytes.
  EXPECT_EQ(encode(decode(doc.dump(2)).record), bytes);
}

TEST(ProfileJson, UnsortedKnobsAreRejected) {
  auto doc = nlohmann::json::parse(encode(Record{h200(), {entry_for(64)}}));
  doc["entries"][0]["configs"][1]["knobs"] = nlohmann::json::parse("[[3, 0], [2, 4]]");
  Decoded d = decode(doc.dump());
  ASSERT_EQ(d.status, DecodeStatus::ok);
  EXPECT_TRUE(d.record.entries.empty());
  ASSERT_EQ(d.problems.size(), 1u);
  EXPECT_NE(d.problems[0].find("not sorted"), std::string::npos) << d.problems[0];
}

// A format-1 file as the previous build wrote it (docs/PROFILE_RECORD.md before format 2).
const char* kV1Record =
    "{\n \"format\": \"terra_torch.conv_profile_record\",\n \"header\": {\"compute_capability\":\"9.0\","
    "\"cuda_version\":13000,\"cudnn_version\":92400,\"device_name\":\"NVIDIA H200\",\"format_version\":1,"
    "\"torch_version\":\"2.14.1\"},\n \"entries\": [\n  {\"algorithms\":[{\"algo\":1,\"math_type\":0,"
    "\"name\":\"IMPLICIT_PRECOMP_GEMM\",\"time_ms\":0.81,\"workspace_bytes\":4096}],\"id\":\"x\",\"key\":{},"
    "\"least_memory\":{\"algo\":1,\"math_type\":0,\"name\":\"IMPLICIT_PRECOMP_GEMM\",\"time_ms\":0.81,"
    "\"workspace_bytes\":4096},\"profiled_batch\":32}\n ]\n}\n";

TEST(ProfileJson, V1IsOutdatedNotCorrupt) {
  Decoded d = decode(kV1Record);
  EXPECT_EQ(d.status, DecodeStatus::outdated);
  EXPECT_TRUE(d.record.entries.empty());
  ASSERT_EQ(d.problems.size(), 1u);
  EXPECT_NE(d.problems[0].find("format version 1"), std::string::npos) << d.problems[0];
  EXPECT_NE(d.problems[0].find("1 entries"), std::string::npos) << d.problems[0];
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
                           "{\"format\": \"terra_torch.conv_profile_record\", \"header\": {\"format_version\": 2}}"}) {
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
  EXPECT_NE(d.problems[0].find("format version 3"), std::string::npos) << d.problems[0];
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
