// Walks one trace through the loop structure of a TraceGraph. Merging, the coverage check and the
// runtime cursor all move through the graph in exactly the same way and differ only in what
// they do at each move, so the walk is written once and the "what" is a policy:
//
//   NodeId advance(NodeId at, const MatchKey& key)  next node (kNoNode: no match)
//   bool   reach_end(NodeId at)                     the path of this (sub)graph ends at `at`
//   NodeId body_start(NodeId loop)                  start node of a loop node's body
//   bool   loop_continue(const WalkLevel& level)    another iteration begins (before the count
//                                                   is incremented)
//   bool   loop_exit(const WalkLevel& level)        the loop instance ends after level.trips
//
// Loop frames of consecutive ops decide the moves: frames shared with the open loops continue
// them, a larger iteration index starts the next iteration, anything else leaves the loop.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "trace/node.h"
#include "trace/op_record.h"

namespace terra::trace {

struct WalkLevel {
  NodeId at = kNoNode;         // latest matched node in this (sub)graph
  NodeId loop_node = kNoNode;  // the loop node whose body this is (kNoNode at top level)
  uint64_t loop_id = 0;
  uint32_t iteration = 0;      // iteration index of the ops being matched
  uint32_t trips = 0;          // iterations of this instance seen so far
};

template <class Policy>
class FrameWalker {
 public:
  FrameWalker(Policy& policy, NodeId root_start) : policy_(&policy) {
    levels_.push_back(WalkLevel{root_start, kNoNode, 0, 0, 0});
  }

  bool step(const OpKey& key, std::span<const LoopFrame> frames) {
    const size_t open = levels_.size() - 1;
    size_t keep = 0;
    bool new_iteration = false;
    while (keep < open && keep < frames.size()) {
      const WalkLevel& level = levels_[keep + 1];
      const LoopFrame& frame = frames[keep];
      if (frame.loop_id != level.loop_id || frame.iteration < level.iteration) {
        break;
      }
      ++keep;
      if (frame.iteration > level.iteration) {
        new_iteration = true;
        break;
      }
    }
    while (levels_.size() - 1 > keep) {
      if (!close_loop()) return false;
    }
    if (new_iteration && !next_iteration(frames[keep - 1].iteration)) return false;
    for (size_t d = keep; d < frames.size(); ++d) {
      if (!enter_loop(frames[d])) return false;
    }
    return advance(MatchKey::op(key));
  }

  // The iteration is over: leave every open loop, then end the top-level path.
  bool finish() {
    while (levels_.size() > 1) {
      if (!close_loop()) return false;
    }
    return policy_->reach_end(levels_.back().at);
  }

  NodeId at() const { return levels_.back().at; }
  size_t open_loops() const { return levels_.size() - 1; }
  // The open loops, outermost first.
  std::span<const WalkLevel> loop_levels() const { return {levels_.data() + 1, levels_.size() - 1}; }

 private:
  bool advance(const MatchKey& key) {
    const NodeId next = policy_->advance(levels_.back().at, key);
    if (next == kNoNode) return false;
    levels_.back().at = next;
    return true;
  }

  bool close_loop() {
    const WalkLevel& level = levels_.back();
    if (!policy_->reach_end(level.at) || !policy_->loop_exit(level)) return false;
    levels_.pop_back();
    return true;
  }

  bool next_iteration(uint32_t iteration) {
    WalkLevel& level = levels_.back();
    if (!policy_->reach_end(level.at) || !policy_->loop_continue(level)) return false;
    level.at = policy_->body_start(level.loop_node);
    level.iteration = iteration;
    ++level.trips;
    return true;
  }

  bool enter_loop(const LoopFrame& frame) {
    if (!advance(MatchKey::loop(frame.loop_id))) return false;
    const NodeId loop = levels_.back().at;
    const NodeId body = policy_->body_start(loop);
    levels_.push_back(WalkLevel{body, loop, frame.loop_id, frame.iteration, 1});
    return true;
  }

  Policy* policy_;  // a pointer, so that a walker can be reset by assignment
  std::vector<WalkLevel> levels_;
};

}  // namespace terra::trace
