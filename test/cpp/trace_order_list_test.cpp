// The order-maintenance list must keep its labels consistent with its links through any mix of
// appends and inserts, including the worst case of inserting again and again at one place.
#include <gtest/gtest.h>

#include <list>
#include <random>
#include <vector>

#include "trace/order_list.h"

namespace terra::trace {
namespace {

void expect_consistent(const OrderList& o, const std::list<OrderList::Slot>& reference) {
  ASSERT_EQ(o.size(), reference.size());
  OrderList::Slot cur = o.head();
  for (const OrderList::Slot s : reference) {
    ASSERT_EQ(cur, s);
    const OrderList::Slot n = o.next(cur);
    if (n != OrderList::kNone) ASSERT_TRUE(o.before(cur, n));
    cur = n;
  }
  EXPECT_EQ(cur, OrderList::kNone);
}

TEST(TraceOrderList, RepeatedInsertAtOnePlaceRelabels) {
  OrderList o;
  std::list<OrderList::Slot> ref;
  const OrderList::Slot first = o.push_back();
  ref.push_back(first);
  ref.push_back(o.push_back());
  // Always insert right after the newest slot, the way a new branch grows.
  auto pos = ref.begin();
  OrderList::Slot last = first;
  for (int i = 0; i < 50000; ++i) {
    last = o.insert_after(last);
    pos = ref.insert(std::next(pos), last);
  }
  // And always right after the first slot: the gap halves every time.
  auto front = ref.begin();
  for (int i = 0; i < 5000; ++i) ref.insert(std::next(front), o.insert_after(first));
  expect_consistent(o, ref);
  EXPECT_GT(o.relabels(), 0u);
}

TEST(TraceOrderList, RandomInsertsMatchAReferenceList) {
  std::mt19937 rng(7);
  OrderList o;
  std::list<OrderList::Slot> ref;
  std::vector<std::list<OrderList::Slot>::iterator> where;
  for (int i = 0; i < 20000; ++i) {
    if (where.empty() || rng() % 8 == 0) {
      ref.push_back(o.push_back());
      where.push_back(std::prev(ref.end()));
    } else {
      auto it = where[rng() % where.size()];
      const OrderList::Slot s = o.insert_after(*it);
      where.push_back(ref.insert(std::next(it), s));
    }
  }
  expect_consistent(o, ref);
}

}  // namespace
}  // namespace terra::trace
