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

}  // namespace
