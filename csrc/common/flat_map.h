// An open-addressing hash map for the capture layer's per-op tables (tensor and storage
// addresses, autograd sequence numbers, location ids).
//
// Why not std::unordered_map: it allocates a node per insert, and the capture layer inserts on
// nearly every intercepted op; those mallocs were a large share of the per-op cost (see
// docs/ARCHITECTURE.md, "Per-op cost"). Here slots live in one array: an insert into a table
// that has grown allocates nothing. Entries are never erased (a region drops its tables whole),
// so linear probing needs no tombstones.
//
// Pointers to values stay valid until the next insert that grows the table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "trace/hash.h"

namespace terra::common {

template <typename K, typename V>
class FlatMap {
  static_assert(std::is_integral_v<K> || std::is_pointer_v<K>, "keys are addresses or integers");

 public:
  explicit FlatMap(size_t expected = 0) { reserve(expected); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  // Room for `n` entries without growing.
  void reserve(size_t n) {
    size_t want = 16;
    while (want * 3 < n * 4) want *= 2;  // keep the load at or below 3/4
    if (want > slots_.size()) rehash(want);
  }

  V* find(K key) {
    if (size_ == 0) return nullptr;
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (!s.used) return nullptr;
      if (s.key == key) return &s.value;
    }
  }
  const V* find(K key) const { return const_cast<FlatMap*>(this)->find(key); }

  // The value under `key`, default-constructed if absent; the bool says whether it was inserted.
  std::pair<V*, bool> try_emplace(K key) {
    if ((size_ + 1) * 4 > slots_.size() * 3) rehash(slots_.size() * 2);
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (!s.used) {
        s.used = true;
        s.key = key;
        ++size_;
        return {&s.value, true};
      }
      if (s.key == key) return {&s.value, false};
    }
  }

 private:
  struct Slot {
    K key{};
    bool used = false;
    V value{};
  };

  // splitmix64's finaliser: addresses are 16-byte aligned and sequence numbers consecutive, so
  // the low bits alone would crowd a few slots.
  static uint64_t scramble(uint64_t x) { return trace::mix64(x); }
  size_t home(K key) const {
    uint64_t bits;
    if constexpr (std::is_pointer_v<K>)
      bits = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(key));
    else
      bits = static_cast<uint64_t>(key);
    return static_cast<size_t>(scramble(bits)) & mask_;
  }

  void rehash(size_t capacity) {
    std::vector<Slot> old(capacity);
    old.swap(slots_);
    mask_ = capacity - 1;
    size_ = 0;
    for (Slot& s : old) {
      if (!s.used) continue;
      auto [value, inserted] = try_emplace(s.key);
      *value = std::move(s.value);
    }
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace terra::common
