// An order-maintenance list: slots in a total order that answers "is a before b" in O(1) and
// can insert a slot right after any other. The TraceGraph keeps its nodes in such a list as a
// topological order, so that merging a branch back (adding an edge) is usually known to keep the
// graph acyclic by one comparison instead of a search.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace terra::trace {

class OrderList {
 public:
  using Slot = uint32_t;
  static constexpr Slot kNone = UINT32_MAX;

  Slot push_back();
  Slot insert_after(Slot s);

  uint64_t label(Slot s) const { return entries_[s].label; }
  bool before(Slot a, Slot b) const { return entries_[a].label < entries_[b].label; }
  Slot next(Slot s) const { return entries_[s].next; }
  Slot prev(Slot s) const { return entries_[s].prev; }
  Slot head() const { return head_; }
  size_t size() const { return entries_.size(); }
  size_t relabels() const { return relabels_; }

 private:
  struct Entry {
    uint64_t label = 0;
    Slot prev = kNone;
    Slot next = kNone;
  };

  Slot link_after(Slot s, uint64_t label);
  // Spreads the labels around `s` out so that a new slot fits after it.
  void relabel_around(Slot s);

  std::vector<Entry> entries_;
  Slot head_ = kNone;
  Slot tail_ = kNone;
  size_t relabels_ = 0;
};

}  // namespace terra::trace
