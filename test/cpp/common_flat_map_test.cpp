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

TEST(FlatMap, PointerKeysAndClearReleasesValues) {
  auto owned = std::make_shared<int>(7);
  FlatMap<const int*, std::shared_ptr<int>> map(4);
  int slots[64];
  for (int& s : slots) *map.try_emplace(&s).first = owned;
  EXPECT_EQ(owned.use_count(), 65);
  EXPECT_NE(map.find(&slots[17]), nullptr);
  map.clear();
  EXPECT_TRUE(map.empty());
  EXPECT_EQ(owned.use_count(), 1);  // clear() drops what the values held
  EXPECT_EQ(map.find(&slots[17]), nullptr);
  *map.try_emplace(&slots[3]).first = owned;
  EXPECT_EQ(map.size(), 1u);
}

TEST(FlatMap, ValuesMoveWhenTheTableGrows) {
  FlatMap<uint64_t, std::string> map;
  for (uint64_t k = 1; k <= 1000; ++k) *map.try_emplace(k).first = std::to_string(k);
  size_t visited = 0;
  map.for_each([&](uint64_t k, const std::string& v) {
    EXPECT_EQ(v, std::to_string(k));
    ++visited;
  });
  EXPECT_EQ(visited, 1000u);
}

}  // namespace
