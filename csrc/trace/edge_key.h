// Control edges are looked up by (parent, key of the child): a node's children have pairwise
// different keys, so this names at most one edge and makes every match step O(1).
#pragma once

#include <cstddef>

#include "trace/node.h"

namespace terra::trace {

struct EdgeKey {
  NodeId from = kNoNode;
  MatchKey key;
  friend bool operator==(const EdgeKey&, const EdgeKey&) = default;
};

struct EdgeKeyHash {
  size_t operator()(const EdgeKey& e) const noexcept {
    return static_cast<size_t>(hash_combine(mix64(e.from), hash_of(e.key)));
  }
};

// All nodes of one (sub)graph that share a key: the candidates a branch may merge back into.
struct GroupKey {
  GraphId graph = kNoGraph;
  MatchKey key;
  friend bool operator==(const GroupKey&, const GroupKey&) = default;
};

struct GroupKeyHash {
  size_t operator()(const GroupKey& g) const noexcept {
    return static_cast<size_t>(hash_combine(mix64(g.graph) + 1, hash_of(g.key)));
  }
};

}  // namespace terra::trace
