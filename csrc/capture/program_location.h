// Program locations: where in the user's Python program an aten op was issued.
//
// A location is the Python call stack at the op, as (code object, instruction offset) pairs from
// the region's outermost frame to the innermost one, interned to a 64-bit id. A code object
// enters the id by its identity (file, qualified name, bytecode: CodeFacts::identity), not its
// address, so ids are equal across processes running the same source. The same statement
// in two iterations of the training loop gives the same id; the same op reached from two call
// sites gives different ids. Loops are recognised from bytecode: each code object's backward
// jumps, computed once and cached, give the instruction ranges of its loops; an op inside such a
// range carries a LoopFrame with the loop's id and its iteration number. See docs/LOCATIONS.md.
// The same per-code-object pass finds the instructions an `except` clause of the user's covers:
// a location is *guarded* when any of its frames stands in one (the program may catch what an
// op there raises). The stop frame counts for that too, though it is not part of the location:
// a `try` around the call of the training step catches one iteration's error and trains on.
// Its callers do not: a `try` around the whole training loop ends it on an error, and there an
// error that surfaces a few ops late costs nothing, while checking first costs a wait per op.
//
// Only Python.h (and, on 3.11, the interpreter's frame header) is needed here, so this TU stays
// cheap to compile. Every call needs the GIL but walk_without_gil() and the capture() after it.
#pragma once

#include <Python.h>

#include <c10/util/SmallVector.h>

#include "common/flat_map.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace terra::capture {

struct LoopFrame {
  uint64_t loop_id = 0;    // same loop reached through the same call path -> same id
  uint32_t iteration = 0;  // 0-based iteration of that loop since it was entered
  bool operator==(const LoopFrame&) const = default;
};

struct FrameRef {
  PyCodeObject* code = nullptr;  // kept alive by the process-wide loop range cache
  int lasti = -1;                // byte offset of the instruction that issued the call
};

class LocationTracker {
 public:
  // `stop_frame`: the walk stops below this frame (it and its callers are not part of
  // locations). nullptr: walk to the bottom of the stack.
  explicit LocationTracker(PyFrameObject* stop_frame);
  // The outermost frame below the stop frame runs the training loop itself (terra_torch.wrap:
  // one region per iteration of it): its statements are locations, its loops are not loops.
  void ignore_outermost_loops(bool ignore) { ignore_outermost_loops_ = ignore; }
  ~LocationTracker();
  // The next region's tracker, as if made anew with `stop_frame`: loop state starts over,
  // interned locations stay (ids are the same in every region; their guards are worked out
  // again, since they depend on the stop frame). Needs the GIL.
  void restart(PyFrameObject* stop_frame);
  LocationTracker(const LocationTracker&) = delete;
  LocationTracker& operator=(const LocationTracker&) = delete;

  // Walks the calling thread's Python frames for the next capture() without the GIL. True when
  // that capture() may then run without it: Python 3.11, whose frame structs are read directly
  // (no frame objects are made, and a thread's own frames cannot change while it is inside a
  // call), and every code object on the stack already known to this tracker. False: capture()
  // needs the GIL (it walks again). The caller serializes it with capture(), as for capture().
  bool walk_without_gil();
  // Location of the current Python stack; fills `loops` (outermost first) and, if given,
  // `guarded`. `walked`: walk_without_gil() just returned true for this op, so capture() uses
  // its walk and needs no GIL; otherwise it walks through the C API (GIL needed).
  uint64_t capture(bool walked, c10::SmallVectorImpl<LoopFrame>* loops, bool* guarded = nullptr);

  // An id for a location derived from another (backward ops: forward location + tag).
  // `label` (the autograd node's name) is asked for only the first time an id is seen, since
  // building it costs a demangling.
  template <typename Label>
  uint64_t derive(uint64_t base, uint64_t tag, uint64_t index, Label&& label);

  // "file:line in function" per frame, outermost first. Needs the GIL.
  std::vector<std::string> describe(uint64_t id) const;

 private:
  bool ignore_outermost_loops_ = false;

 public:

  struct LoopRange {
    int start;  // jump target (loop head)
    int end;    // offset of the backward jump
  };
  struct CodeFacts {
    std::vector<LoopRange> loops;
    std::vector<std::pair<int, int>> guarded;  // [start, end) offsets covered by an except clause
    // Stands for the code object in location ids: the same in every process that runs the same
    // source (terra_torch._locations.code_identity), so traces can be kept across runs.
    uint64_t identity = 0;
  };

 private:
  struct LoopState {
    std::vector<int64_t> last_position;
    uint32_t iteration = 0;
  };

  static uint64_t derived_id(uint64_t base, uint64_t tag, uint64_t index);
  // The facts of `code`: this tracker's table, else the process-wide cache (GIL needed).
  const CodeFacts& code_facts(PyCodeObject* code);
  // Fills scratch_ (innermost first), scratch_facts_ and guard_depth_ through the C API (GIL).
  void walk_with_api();
  void position_in_loop(size_t depth, const LoopRange& loop, std::vector<int64_t>* out);

  bool outer_guarded();

  PyFrameObject* stop_frame_;
  // The stop frame's caller (the training loop, for terra_torch.wrap). Ops the program issues
  // after the stop frame returned (the next step's, before its model call) have a stack without
  // the stop frame: their guard is looked for up to this frame, not in the frames above it.
  PyFrameObject* anchor_ = nullptr;
  size_t guard_depth_ = 0;  // this capture: how many frames (innermost first) count for guards
  // Whether an except clause of the stop frame covers the call that entered the region: the
  // frame is suspended in that call while the region is open, so it is asked once.
  std::optional<bool> outer_guarded_;
  // The code objects this tracker has met (entries of the process-wide cache, which never
  // frees them): read without the GIL, filled with it.
  common::FlatMap<PyCodeObject*, const CodeFacts*> known_codes_{64};
  struct Interned {
    std::vector<FrameRef> frames;
    bool guarded = false;
    uint32_t generation = 0;  // the restart() `guarded` was worked out in
  };
  uint32_t generation_ = 0;  // restarts so far
  common::FlatMap<uint64_t, Interned> frames_;  // interned locations
  struct Derived {
    uint64_t base = 0;
    uint64_t index = 0;
    std::string label;
  };
  common::FlatMap<uint64_t, Derived> derived_;  // derived id -> what it derives from
  common::FlatMap<uint64_t, LoopState> loop_state_;
  // Reused buffers: a capture allocates nothing once they have grown.
  std::vector<uint64_t> active_;           // loops enclosing the current op
  std::vector<uint64_t> previous_active_;  // ... and the previous op
  std::vector<int64_t> position_;
  std::vector<FrameRef> scratch_;
  std::vector<const CodeFacts*> scratch_facts_;  // scratch_[d]'s facts
};

template <typename Label>
uint64_t LocationTracker::derive(uint64_t base, uint64_t tag, uint64_t index, Label&& label) {
  uint64_t id = derived_id(base, tag, index);
  auto [entry, inserted] = derived_.try_emplace(id);
  if (inserted) *entry = Derived{base, index, label()};
  return id;
}

}  // namespace terra::capture
