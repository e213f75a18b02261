// A direct interpreter of the program tree; it is the specification the emitted TorchScript
// graph and the Cursor are both checked against, so it stays as plain as possible.
#include "trace/replay.h"

#include "trace/cursor.h"

namespace terra::trace {
namespace {

class Replayer {
 public:
  Replayer(const Program& p, std::span<const Decision> d) : p_(p), d_(d) {}

  bool run(ProgId id) {
    const ProgNode& n = p_.at(id);
    switch (n.kind) {
      case ProgKind::kSeq:
        for (const ProgId c : n.children) {
          if (!run(c)) return false;
        }
        return true;
      case ProgKind::kBlock:
        out_.ops.insert(out_.ops.end(), n.ops.begin(), n.ops.end());
        return true;
      case ProgKind::kSwitch: {
        uint32_t value = 0;
        if (!take(n.site, value)) return false;
        if (value >= n.children.size()) return fail("case index out of range");
        return run(n.children[value]);
      }
      case ProgKind::kWhile:
        for (;;) {
          if (!run(n.children[0])) return false;
          uint32_t value = 0;
          if (!take(n.site, value)) return false;
          if (value == kLoopExit) return true;
          if (value != kLoopContinue) return fail("loop-cond value out of range");
        }
      case ProgKind::kUnrolled:
        for (uint32_t i = 0; i < n.trip_count; ++i) {
          if (!run(n.children[0])) return false;
        }
        return true;
    }
    return fail("unknown construct");
  }

  ReplayResult finish(bool ok) {
    out_.ok = ok && next_ == d_.size();
    if (ok && !out_.ok) out_.error = "decisions left over";
    out_.decisions_used = next_;
    return std::move(out_);
  }

 private:
  bool take(SiteId site, uint32_t& value) {
    if (next_ >= d_.size()) return fail("ran out of decisions");
    if (d_[next_].site != site) return fail("decision for another site");
    value = d_[next_++].value;
    return true;
  }
  bool fail(const char* why) {
    out_.error = why;
    return false;
  }

  const Program& p_;
  std::span<const Decision> d_;
  size_t next_ = 0;
  ReplayResult out_;
};

}  // namespace

ReplayResult replay(const Program& program, std::span<const Decision> decisions) {
  Replayer r(program, decisions);
  const bool ok = r.run(program.root);
  return r.finish(ok);
}

bool decisions_for(const Program& program, const Trace& trace, std::vector<Decision>& out) {
  out.clear();
  Cursor cursor(program);
  for (const OpRecord& op : trace.ops) {
    const Match m = cursor.step(op);
    if (!m.matched) return false;
    out.insert(out.end(), m.decisions.begin(), m.decisions.end());
  }
  const Match m = cursor.finish();
  if (!m.matched) return false;
  out.insert(out.end(), m.decisions.begin(), m.decisions.end());
  return true;
}

}  // namespace terra::trace
