// An open-addressing hash map for the capture layer's per-op tables (tensor and storage
// addresses, autograd sequence numbers, location ids).
//
// Why not std::unordered_map: it allocates a node per insert, and the capture layer inserts on
// nearly every intercepted op; those mallocs were a large share of the per-op cost (see
// docs/ARCHITECTURE.md, "Per-op cost"). Here slots live in one array: an insert into a table
// that has grown allocates nothing. Linear probing without tombstones: erase() shifts the
// rest of the probe run back into the hole (the runtime's per-iteration tables drop entries).
// Iteration order is the slot order, which depends on the keys' hashes.
//
// Pointers to values stay valid until the next insert that grows the table or the next erase.
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
  // Slots: what erase_if() and clear() walk.
  size_t capacity() const { return slots_.size(); }

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

  // Empties the table but keeps its slots: a table refilled every iteration allocates nothing.
  void clear() {
    if (size_ == 0) return;
    for (Slot& s : slots_) s = Slot{};
    size_ = 0;
  }

  // Removes `key`; false when it was absent.
  bool erase(K key) {
    if (size_ == 0) return false;
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      if (!slots_[i].used) return false;
      if (slots_[i].key == key) {
        erase_slot(i);
        return true;
      }
    }
  }

  // Removes every entry for which drop(key, value) is true.
  template <typename Drop>
  void erase_if(Drop drop) {
    for (size_t i = 0; i < slots_.size();) {
      Slot& s = slots_[i];
      // After an erase, slot i may hold an entry shifted back from later in the run: look again.
      if (s.used && drop(static_cast<const K&>(s.key), s.value)) erase_slot(i);
      else ++i;
    }
  }

  // Calls f(key, value) for every entry.
  template <typename F>
  void for_each(F f) const {
    for (const Slot& s : slots_)
      if (s.used) f(s.key, s.value);
  }

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

  // Backward-shift deletion: each later entry of the run whose home is not between the hole and
  // itself (cyclically) moves into the hole, which moves to where it was.
  void erase_slot(size_t hole) {
    for (size_t j = (hole + 1) & mask_;; j = (j + 1) & mask_) {
      Slot& s = slots_[j];
      if (!s.used) break;
      const size_t h = home(s.key);
      const bool reachable = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
      if (reachable) continue;  // its probe from h reaches j without passing the hole
      slots_[hole] = std::move(s);
      hole = j;
    }
    slots_[hole] = Slot{};
    --size_;
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
