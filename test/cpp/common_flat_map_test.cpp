#include "common/flat_map.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>

namespace {

using terra::common::FlatMap;

TEST(FlatMap, InsertFindAndGrowAgreeWithStdMap) {
  FlatMap<uint64_t, uint64_t> map;
  std::map<uint64_t, uint64_t> expected;
  // Consecutive keys (sequence numbers) and key 0 must both work.
  for (uint64_t k = 0; k < 5000; ++k) {
    auto [v, inserted] = map.try_emplace(k * 3);
    ASSERT_TRUE(inserted);
    *v = k;
    expected[k * 3] = k;
  }
  EXPECT_EQ(map.size(), expected.size());
  for (uint64_t k = 0; k < 15000; ++k) {
    const uint64_t* v = map.find(k);
    auto it = expected.find(k);
    if (it == expected.end()) {
      EXPECT_EQ(v, nullptr) << k;
    } else {
      ASSERT_NE(v, nullptr) << k;
      EXPECT_EQ(*v, it->second);
    }
  }
  auto [again, inserted] = map.try_emplace(9);
  EXPECT_FALSE(inserted);
  EXPECT_EQ(*again, 3u);
}

TEST(FlatMap, PointerKeysAndValuesReleasedWithTheMap) {
  auto owned = std::make_shared<int>(7);
  int slots[64];
  {
    FlatMap<const int*, std::shared_ptr<int>> map(4);
    for (int& s : slots) *map.try_emplace(&s).first = owned;  // grows past its first size
    EXPECT_EQ(map.size(), 64u);
    EXPECT_EQ(owned.use_count(), 65);  // moving values on growth neither copies nor drops them
    ASSERT_NE(map.find(&slots[17]), nullptr);
    EXPECT_EQ(map.find(&slots[17])->get(), owned.get());
    int elsewhere = 0;
    EXPECT_EQ(map.find(&elsewhere), nullptr);
  }
  EXPECT_EQ(owned.use_count(), 1);
}

TEST(FlatMap, ValuesMoveWhenTheTableGrows) {
  FlatMap<uint64_t, std::string> map;
  for (uint64_t k = 1; k <= 1000; ++k) *map.try_emplace(k).first = std::to_string(k);
  EXPECT_EQ(map.size(), 1000u);
  for (uint64_t k = 1; k <= 1000; ++k) {
    const std::string* v = map.find(k);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(*v, std::to_string(k));
  }
}

TEST(FlatMap, EraseEraseIfAndClearAgreeWithStdMap) {
  // Small key range, many collisions and wrapped probe runs: every backward shift is exercised.
  FlatMap<uint64_t, std::shared_ptr<uint64_t>> map;
  std::map<uint64_t, uint64_t> expected;
  uint64_t state = 12345;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 33;
  };
  auto agree = [&] {
    ASSERT_EQ(map.size(), expected.size());
    for (uint64_t k = 0; k < 600; ++k) {
      const auto* v = map.find(k);
      auto it = expected.find(k);
      if (it == expected.end()) {
        ASSERT_EQ(v, nullptr) << k;
      } else {
        ASSERT_NE(v, nullptr) << k;
        ASSERT_EQ(**v, it->second) << k;
      }
    }
    size_t seen = 0;
    map.for_each([&](uint64_t k, const std::shared_ptr<uint64_t>& v) {
      ++seen;
      EXPECT_EQ(expected.at(k), *v);
    });
    ASSERT_EQ(seen, expected.size());
  };
  for (int round = 0; round < 40; ++round) {
    for (int i = 0; i < 300; ++i) {
      const uint64_t k = next() % 600;
      if (next() % 3 == 0) {
        EXPECT_EQ(map.erase(k), expected.erase(k) == 1) << k;
      } else {
        const uint64_t v = next();
        *map.try_emplace(k).first = std::make_shared<uint64_t>(v);
        expected[k] = v;
      }
    }
    agree();
    const uint64_t mod = 2 + round % 5;
    map.erase_if([&](uint64_t k, const std::shared_ptr<uint64_t>&) { return k % mod == 0; });
    for (auto it = expected.begin(); it != expected.end();) it = it->first % mod == 0 ? expected.erase(it) : std::next(it);
    agree();
    if (round % 10 == 9) {
      map.clear();
      expected.clear();
      agree();
    }
  }
}

TEST(FlatMap, ClearAndEraseReleaseValues) {
  auto owned = std::make_shared<int>(1);
  FlatMap<uint64_t, std::shared_ptr<int>> map;
  for (uint64_t k = 0; k < 100; ++k) *map.try_emplace(k).first = owned;
  EXPECT_EQ(owned.use_count(), 101);
  EXPECT_TRUE(map.erase(5));
  EXPECT_FALSE(map.erase(5));
  EXPECT_EQ(owned.use_count(), 100);
  map.erase_if([](uint64_t k, const std::shared_ptr<int>&) { return k < 50; });
  EXPECT_EQ(map.size(), 50u);
  EXPECT_EQ(owned.use_count(), 51);
  map.clear();
  EXPECT_EQ(map.size(), 0u);
  EXPECT_EQ(owned.use_count(), 1);
  EXPECT_EQ(map.find(70), nullptr);
  *map.try_emplace(70).first = owned;  // reusable after clear()
  EXPECT_EQ(map.size(), 1u);
}

}  // namespace
