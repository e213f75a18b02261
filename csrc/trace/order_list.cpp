// Labels are 64-bit integers. Appends leave wide gaps; an insertion in the middle takes a small
// step past its predecessor (a new branch is built op after op at the same place, and small steps
// let thousands of such inserts fit before anything must move); when a gap runs out, a window
// around the slot grows until its labels can be spread evenly with room to spare.
#include "trace/order_list.h"

#include <stdexcept>

namespace terra::trace {
namespace {
constexpr uint64_t kAppendGap = uint64_t{1} << 32;
constexpr uint64_t kInsertStep = uint64_t{1} << 20;
constexpr uint64_t kSpreadGap = uint64_t{1} << 24;
}  // namespace

OrderList::Slot OrderList::push_back() {
  if (tail_ == kNone) {
    return link_after(kNone, kAppendGap);
  }
  if (label(tail_) > UINT64_MAX - 2 * kAppendGap) {
    relabel_around(tail_);
  }
  return link_after(tail_, label(tail_) + kAppendGap);
}

OrderList::Slot OrderList::insert_after(Slot s) {
  if (s == tail_) {
    return push_back();
  }
  uint64_t gap = label(next(s)) - label(s);
  if (gap < 2) {
    relabel_around(s);
    gap = label(next(s)) - label(s);
  }
  const uint64_t step = gap / 2 < kInsertStep ? gap / 2 : kInsertStep;
  return link_after(s, label(s) + step);
}

OrderList::Slot OrderList::link_after(Slot s, uint64_t lbl) {
  const Slot id = static_cast<Slot>(entries_.size());
  Entry e;
  e.label = lbl;
  e.prev = s;
  e.next = s == kNone ? head_ : entries_[s].next;
  entries_.push_back(e);
  if (e.prev == kNone) {
    head_ = id;
  } else {
    entries_[e.prev].next = id;
  }
  if (e.next == kNone) {
    tail_ = id;
  } else {
    entries_[e.next].prev = id;
  }
  return id;
}

void OrderList::relabel_around(Slot s) {
  ++relabels_;
  // The window is the open interval (left, right) of slots; the ends are virtual (0 and the
  // largest label) once the window reaches the list's ends.
  Slot left = prev(s);
  Slot right = next(s);
  uint64_t count = 1;
  for (;;) {
    const uint64_t lo = left == kNone ? 0 : label(left);
    const uint64_t hi = right == kNone ? UINT64_MAX - kAppendGap : label(right);
    const bool whole = left == kNone && right == kNone;
    if ((hi - lo) / (count + 1) >= kSpreadGap || whole) {
      const uint64_t step = (hi - lo) / (count + 1);
      if (step < 4) {
        throw std::length_error("OrderList: out of labels");
      }
      Slot cur = left == kNone ? head_ : next(left);
      for (uint64_t i = 1; cur != right; ++i, cur = next(cur)) {
        entries_[cur].label = lo + step * i;
      }
      return;
    }
    // Double the window: it then costs O(window) and buys room for O(window) more inserts.
    for (uint64_t grow = count; grow > 0 && left != kNone; --grow, ++count) {
      left = prev(left);
    }
    for (uint64_t grow = count; grow > 0 && right != kNone; --grow, ++count) {
      right = next(right);
    }
  }
}

}  // namespace terra::trace
