#include "capture/program_location.h"

// Python 3.11's frame structs (_PyInterpreterFrame, PyFrameObject's fields), as
// torch/csrc/dynamo/cpython_defs.c reads them: walk_without_gil() reads them directly.
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define TERRA_WALK_FRAME_STRUCTS 1
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <stdexcept>
#include <memory>
#include <tuple>

#include "trace/hash.h"

namespace terra::capture {

namespace {


}  // namespace

// Process-wide: a code object's loops never change, and computing them (Python's dis) costs
// around a millisecond for a large function; every region would otherwise pay it again. The
// cache holds a reference to each code object so that its address is never reused. Looked up
// for every frame of every op's stack (a module's forward is several frames deep): an
// open-addressing table; each range list has its own allocation so that references to it
// survive the table growing. Only touched with the GIL held.
struct LoopRangeCache {
  PyObject* finder = nullptr;  // terra_torch._locations.code_facts
  common::FlatMap<PyCodeObject*, std::unique_ptr<LocationTracker::CodeFacts>> ranges{256};
};

LoopRangeCache& loop_range_cache() {
  static LoopRangeCache* cache = new LoopRangeCache();  // leaked on purpose: lives to exit
  return *cache;
}

LocationTracker::LocationTracker(PyFrameObject* stop_frame) : stop_frame_(stop_frame) {
  Py_XINCREF(stop_frame_);
  if (stop_frame_ != nullptr) anchor_ = PyFrame_GetBack(stop_frame_);  // new reference (or null)
  auto& cache = loop_range_cache();
  if (cache.finder == nullptr) {
    PyObject* mod = PyImport_ImportModule("terra_torch._locations");
    if (mod == nullptr) throw std::runtime_error("terra_torch: cannot import terra_torch._locations");
    cache.finder = PyObject_GetAttrString(mod, "code_facts");
    Py_DECREF(mod);
    if (cache.finder == nullptr) throw std::runtime_error("terra_torch._locations.code_facts missing");
  }
}

LocationTracker::~LocationTracker() {
  Py_XDECREF(stop_frame_);
  Py_XDECREF(anchor_);  // destroyed with the GIL held (regions end from Python)
}

void LocationTracker::restart(PyFrameObject* stop_frame) {
  Py_XINCREF(stop_frame);
  Py_XDECREF(stop_frame_);
  stop_frame_ = stop_frame;
  Py_XDECREF(anchor_);
  anchor_ = stop_frame_ != nullptr ? PyFrame_GetBack(stop_frame_) : nullptr;  // new reference (or null)
  guard_depth_ = 0;
  outer_guarded_.reset();
  loop_state_.clear();
  active_.clear();
  previous_active_.clear();
  ++generation_;
  // A program whose locations never repeat (code generated per call) would grow these forever.
  constexpr size_t kMaxInterned = size_t(1) << 16;
  if (frames_.size() > kMaxInterned) frames_.clear();
  if (derived_.size() > kMaxInterned) derived_.clear();
}

namespace {

// [(a, b), ...] from Python into `out`; false (with the Python error cleared) if malformed.
template <typename Pair>
bool read_pairs(PyObject* list, std::vector<Pair>& out) {
  if (list == nullptr || !PyList_Check(list)) return false;
  for (Py_ssize_t i = 0; i < PyList_Size(list); ++i) {
    PyObject* pair = PyList_GetItem(list, i);
    if (!PyTuple_Check(pair) || PyTuple_Size(pair) != 2) return false;
    out.push_back({static_cast<int>(PyLong_AsLong(PyTuple_GetItem(pair, 0))),
                   static_cast<int>(PyLong_AsLong(PyTuple_GetItem(pair, 1)))});
  }
  return true;
}

}  // namespace

const LocationTracker::CodeFacts& LocationTracker::code_facts(PyCodeObject* code) {
  if (const CodeFacts* const* known = known_codes_.find(code)) return **known;
  auto& cache = loop_range_cache();
  std::unique_ptr<CodeFacts>* facts = cache.ranges.find(code);
  if (facts == nullptr) {
    CodeFacts found;
    PyObject* result = PyObject_CallOneArg(cache.finder, reinterpret_cast<PyObject*>(code));
    bool ok = result != nullptr && PyTuple_Check(result) && PyTuple_Size(result) == 3 &&
              read_pairs(PyTuple_GetItem(result, 0), found.loops) && read_pairs(PyTuple_GetItem(result, 1), found.guarded);
    if (ok) {
      found.identity = PyLong_AsUnsignedLongLong(PyTuple_GetItem(result, 2));
      ok = !PyErr_Occurred();
    }
    Py_XDECREF(result);
    if (!ok) {
      // No bytecode facts is a degraded location, not an error; the address stands for the
      // identity (such locations mean nothing in another process).
      PyErr_Clear();
      found = CodeFacts{};
      found.identity = reinterpret_cast<uintptr_t>(code);
    }
    // Inserted only now: while Python ran the finder, another thread may have taken the GIL
    // and grown the table (or cached this very code object).
    bool inserted;
    std::tie(facts, inserted) = cache.ranges.try_emplace(code);
    if (inserted) {
      Py_INCREF(reinterpret_cast<PyObject*>(code));
      *facts = std::make_unique<CodeFacts>(std::move(found));
    }
  }
  *known_codes_.try_emplace(code).first = facts->get();
  return **facts;
}

void LocationTracker::position_in_loop(size_t depth, const LoopRange& loop, std::vector<int64_t>* out) {
  // The op's position inside the loop body: instruction offsets from the loop's frame inwards,
  // where a nested loop counts as its head (its own iterations must not look like ours).
  // Within one iteration positions never decrease; a smaller one means the body started over.
  out->clear();
  for (size_t e = depth; e < scratch_.size(); ++e) {
    int offset = scratch_[e].lasti;
    bool nested = false;
    for (const LoopRange& inner : scratch_facts_[e]->loops) {
      bool encloses_ours = e == depth && inner.start <= loop.start && inner.end >= loop.end;
      if (!encloses_ours && offset >= inner.start && offset <= inner.end) {
        offset = inner.start;
        nested = true;
        break;
      }
    }
    out->push_back(offset);
    if (nested) return;
  }
}

bool LocationTracker::walk_without_gil() {
#ifdef TERRA_WALK_FRAME_STRUCTS
  // TERRA_FRAME_WALK=api walks through the C API only (with the GIL), to compare the two walks
  // (test_capture.py) or to step around an interpreter build whose structs differ.
  static const bool structs = [] {
    const char* v = std::getenv("TERRA_FRAME_WALK");
    return v == nullptr || std::string(v) != "api";
  }();
  if (!structs) return false;
  // What PyEval_GetFrame and PyFrame_GetBack would give, from the interpreter's own frames:
  // incomplete frames (being set up, no instruction run yet) are skipped as they skip them. The
  // stop frame and the anchor are compared through their objects' current frame pointers, read
  // now: one that has returned owns a copy of its frame, which no running frame can equal.
  PyThreadState* tstate = PyGILState_GetThisThreadState();
  if (tstate == nullptr || tstate->cframe == nullptr) return false;
  if (!outer_guarded_) return false;  // (asked once per region, with the GIL: capture())
  auto complete = [](_PyInterpreterFrame* f) {
    while (f != nullptr && _PyFrame_IsIncomplete(f)) f = f->previous;
    return f;
  };
  const _PyInterpreterFrame* stop = stop_frame_ != nullptr ? stop_frame_->f_frame : nullptr;
  const _PyInterpreterFrame* anchor = anchor_ != nullptr ? anchor_->f_frame : nullptr;
  scratch_.clear();
  scratch_facts_.clear();
  guard_depth_ = SIZE_MAX;
  for (_PyInterpreterFrame* f = complete(tstate->cframe->current_frame); f != nullptr && f != stop;
       f = complete(f->previous)) {
    const CodeFacts* const* known = known_codes_.find(f->f_code);
    if (known == nullptr) return false;  // capture() asks Python for its facts (GIL)
    const int lasti = _PyInterpreterFrame_LASTI(f);
    scratch_.push_back({f->f_code, lasti < 0 ? -1 : lasti * static_cast<int>(sizeof(_Py_CODEUNIT))});
    scratch_facts_.push_back(*known);
    if (f == anchor && guard_depth_ == SIZE_MAX) guard_depth_ = scratch_.size();
  }
  return true;
#else
  return false;
#endif
}

void LocationTracker::walk_with_api() {
  scratch_.clear();
  scratch_facts_.clear();
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  guard_depth_ = SIZE_MAX;
  while (frame != nullptr && frame != stop_frame_) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    scratch_.push_back({code, PyFrame_GetLasti(frame)});
    scratch_facts_.push_back(&code_facts(code));  // (pins the code object)
    if (frame == anchor_ && guard_depth_ == SIZE_MAX) guard_depth_ = scratch_.size();
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
}

uint64_t LocationTracker::capture(bool walked, c10::SmallVectorImpl<LoopFrame>* loops, bool* guarded) {
  if (!walked) {
    walk_with_api();
    outer_guarded();  // (so that walk_without_gil() never needs to ask it)
  }
  // Both walks go innermost -> outermost; locations read top-down.
  std::reverse(scratch_.begin(), scratch_.end());
  std::reverse(scratch_facts_.begin(), scratch_facts_.end());

  uint64_t id = 0x7e77a;
  active_.clear();
  if (loops) loops->clear();
  for (size_t d = 0; d < scratch_.size(); ++d) {
    const FrameRef& f = scratch_[d];
    uint64_t prefix = id;
    const uint64_t code = scratch_facts_[d]->identity;
    id = trace::hash_combine(trace::hash_combine(id, code), static_cast<uint64_t>(f.lasti));
    // Every loop of this frame whose range holds lasti encloses the op (outer ranges first).
    if (d == 0 && ignore_outermost_loops_) continue;
    for (const LoopRange& r : scratch_facts_[d]->loops) {
      if (f.lasti < r.start || f.lasti > r.end) continue;
      uint64_t loop_id = trace::hash_combine(trace::hash_combine(prefix, code), 0x100000000ULL + r.start);
      active_.push_back(loop_id);
      LoopState& state = *loop_state_.try_emplace(loop_id).first;
      bool was_active = std::find(previous_active_.begin(), previous_active_.end(), loop_id) != previous_active_.end();
      position_in_loop(d, r, &position_);
      if (!was_active) {
        state.iteration = 0;  // (re-)entered
      } else if (position_ < state.last_position) {
        ++state.iteration;  // the body started over
      }
      state.last_position.assign(position_.begin(), position_.end());
      if (loops) loops->push_back({loop_id, state.iteration});
    }
  }
  std::swap(active_, previous_active_);

  auto [interned, inserted] = frames_.try_emplace(id);
  if (inserted) interned->frames = scratch_;
  if (inserted || interned->generation != generation_) {
    interned->generation = generation_;
    // Frames from the innermost out to the anchor, if the walk met it; the stop frame's own
    // guard otherwise (outer_guarded). scratch_ runs outermost first.
    const bool met_anchor = guard_depth_ != SIZE_MAX;
    interned->guarded = !met_anchor && outer_guarded();
    const size_t first = met_anchor ? scratch_.size() - guard_depth_ : 0;
    for (size_t d = 0; d < scratch_.size(); ++d) {
      if (d < first) continue;
      const FrameRef& f = scratch_[d];
      for (const auto& [start, end] : scratch_facts_[d]->guarded) interned->guarded |= f.lasti >= start && f.lasti < end;
    }
  }
  if (guarded) *guarded = interned->guarded;
  return id;
}

bool LocationTracker::outer_guarded() {
  if (outer_guarded_) return *outer_guarded_;
  bool guarded = false;
  if (stop_frame_ != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(stop_frame_);  // new reference
    const int lasti = PyFrame_GetLasti(stop_frame_);
    for (const auto& [start, end] : code_facts(code).guarded) guarded |= lasti >= start && lasti < end;
    Py_DECREF(code);  // (code_facts pinned it)
  }
  outer_guarded_ = guarded;
  return guarded;
}

uint64_t LocationTracker::derived_id(uint64_t base, uint64_t tag, uint64_t index) {
  return trace::hash_combine(trace::hash_combine(trace::hash_combine(base, 0xbacc), tag), index);
}

std::vector<std::string> LocationTracker::describe(uint64_t id) const {
  std::vector<std::string> out;
  if (const Derived* derived = derived_.find(id)) {
    out = describe(derived->base);
    out.push_back("backward: " + derived->label + " op " + std::to_string(derived->index));
    return out;
  }
  const Interned* interned = frames_.find(id);
  if (interned == nullptr) return out;
  for (const FrameRef& f : interned->frames) {
    PyObject* file = f.code->co_filename;
    PyObject* name = f.code->co_name;
    int line = PyCode_Addr2Line(f.code, f.lasti);
    out.push_back(std::string(PyUnicode_AsUTF8(file)) + ":" + std::to_string(line) + " in " +
                  PyUnicode_AsUTF8(name));
  }
  return out;
}

}  // namespace terra::capture
