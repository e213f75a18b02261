// Hash mixing shared by the trace tables. Keys are already hashes or interned ids, which are
// often small consecutive integers, so they must be scrambled before they index a hash table.
#pragma once

#include <cstddef>
#include <cstdint>

namespace terra::trace {

// The splitmix64 finaliser: cheap and spreads consecutive ids across all bits.
inline constexpr uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline constexpr uint64_t hash_combine(uint64_t seed, uint64_t value) {
  return mix64(seed ^ (value + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2)));
}

}  // namespace terra::trace
