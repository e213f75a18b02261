// The cursor moves along TraceGraph edges through the transition table that case assignment
// precomputed, so a step is a hash lookup plus copying that edge's decisions.
#include "trace/cursor.h"

namespace terra::trace {

NodeId Cursor::Policy::advance(NodeId at, const MatchKey& key) {
  const Transition* t = p_.transition(at, key);
  if (t == nullptr) return kNoNode;
  const std::span<const Decision> d = p_.decisions(*t);
  out_.insert(out_.end(), d.begin(), d.end());
  return t->to;
}

bool Cursor::Policy::reach_end(NodeId at) { return advance(at, MatchKey::end()) != kNoNode; }

bool Cursor::Policy::loop_continue(const WalkLevel& level) {
  const LoopInfo& info = p_.loops[level.loop_node];
  if (info.unrolled) return level.trips < info.unrolled;
  out_.push_back(Decision{info.site, kLoopContinue});
  return true;
}

bool Cursor::Policy::loop_exit(const WalkLevel& level) {
  const LoopInfo& info = p_.loops[level.loop_node];
  if (info.unrolled) return level.trips == info.unrolled;
  out_.push_back(Decision{info.site, kLoopExit});
  return true;
}

Cursor::Cursor(const Program& program)
    : program_(program), policy_(program, out_), walker_(policy_, program.start) {}

void Cursor::reset() {
  walker_ = FrameWalker<Policy>(policy_, program_.start);
  out_.clear();
  failed_ = false;
  steps_ = 0;
}

Match Cursor::result(bool ok, NodeId node) {
  if (!ok) failed_ = true;
  Match m;
  m.matched = ok;
  m.node = ok ? node : kNoNode;
  if (ok) m.decisions = std::span<const Decision>(out_.data(), out_.size());
  return m;
}

Match Cursor::step(const OpKey& key, std::span<const LoopFrame> loops) {
  out_.clear();
  if (failed_) return result(false, kNoNode);
  ++steps_;
  const bool ok = walker_.step(key, loops);
  return result(ok, walker_.at());
}

void Cursor::copy_index(std::vector<uint32_t>& out) const {
  out.clear();
  for (const WalkLevel& level : walker_.loop_levels())
    if (program_.loops[level.loop_node].unrolled > 0) out.push_back(level.trips - 1);
}

Match Cursor::finish() {
  out_.clear();
  if (failed_) return result(false, kNoNode);
  return result(walker_.finish(), kNoNode);
}

}  // namespace terra::trace
