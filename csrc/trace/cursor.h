// The PythonRunner's view of the generated program during co-execution: each op it issues is
// validated against the TraceGraph in O(1) and turned into the decisions (case selects, loop
// conds) the GraphRunner waits for. A failed step is the divergence that sends the program back
// to the tracing phase.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "trace/program.h"
#include "trace/walker.h"

namespace terra::trace {

struct Match {
  bool matched = false;
  NodeId node = kNoNode;  // step: the node the op was matched to; finish: kNoNode
  // Decisions to send, in order, before the GraphRunner may run the matched op. Valid until
  // the next call on the cursor.
  std::span<const Decision> decisions;
};

class Cursor {
 public:
  explicit Cursor(const Program& program);
  Cursor(const Cursor&) = delete;  // the walker points into this object
  Cursor& operator=(const Cursor&) = delete;

  // Each step costs O(1) plus the loop levels it enters or leaves plus the decisions it emits;
  // over a trace that is linear in the constructs the GraphRunner executes.
  Match step(const OpKey& key, std::span<const LoopFrame> loops);
  Match step(const OpRecord& op) { return step(op.key, op.loops); }
  // The iteration is over: leave the open loops and end the top-level path.
  Match finish();
  // Start a new iteration.
  void reset();

  // Trip indices (0-based) of the open unrolled loops, outermost first: the copy of the body
  // the last matched op belongs to, as the graph emitter numbers copies (emit/value_flow.h).
  void copy_index(std::vector<uint32_t>& out) const;

  bool failed() const { return failed_; }
  size_t steps() const { return steps_; }

  class Policy {
   public:
    Policy(const Program& p, std::vector<Decision>& out) : p_(p), out_(out) {}
    NodeId advance(NodeId at, const MatchKey& key);
    bool reach_end(NodeId at);
    NodeId body_start(NodeId loop) const { return p_.loops[loop].body_start; }
    bool loop_continue(const WalkLevel& level);
    bool loop_exit(const WalkLevel& level);

   private:
    const Program& p_;
    std::vector<Decision>& out_;
  };

 private:
  Match result(bool ok, NodeId node);

  const Program& program_;
  std::vector<Decision> out_;
  Policy policy_;
  FrameWalker<Policy> walker_;
  bool failed_ = false;
  size_t steps_ = 0;
};

}  // namespace terra::trace
