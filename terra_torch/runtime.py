"""Co-execution of an imperative PyTorch program (docs/ARCHITECTURE.md; docs/RUNTIME.md).

A `Program` is one co-executed training loop: a wrapped model (`terra_torch.wrap`) or a step
function (`@terra_torch.function`). Its iterations go through the paper's phases:

* tracing: the iteration runs eagerly in a recording region; its trace is merged into the
  TraceGraph. When an iteration adds nothing new (the graph already covered it), the graph is
  generated and the next iteration co-executes;
* co-execution: every op is validated against the TraceGraph and answered with a placeholder
  while the generated graph runs on a C++ worker thread; Python waits only for data;
* fallback: an op the graph does not have (a divergence) stops the graph where Python was, gives
  every live placeholder its value, and the iteration finishes eagerly; its trace is merged and
  the program goes back to tracing.

An iteration runs from one call of the model (or function) to the next: the loss, backward,
optimizer step and logging between two forward calls belong to it.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import torch

from terra_torch import _C, _fused, _log, _warm_start
from terra_torch._speed import COEXEC, EAGER, SpeedCheck
from terra_torch.chrome_trace import GRAPH_RUNNER, PYTHON_RUNNER, Timeline
from terra_torch.debug import Location
from terra_torch.explanation import Fallback, explanation_from

logger = logging.getLogger("terra_torch")

PHASES = ("tracing", "coexec", "eager")
_ITERATIONS_KEPT = 200_000  # iterations a timeline shows (the oldest are dropped first)

# A program that has not converged after this many iterations in a row that were traced or fell
# back (none co-executed to its end) stops paying for capture: it runs eagerly for a while, then
# traces again (issue 16, item 2).
MAX_UNCONVERGED_ITERATIONS = 20
# Eager iterations before the first retry; each retry that fails again doubles it.
EAGER_BACKOFF = 50
# optimize="fused": co-executed iterations in a row the speed check leaves unmeasured while
# compiled segments are checked and timed (Program._speed_observe). Settling takes 17 runs of a
# segment (the check, then FusedExecutor::kTrialRuns of each kind); a segment on a path taken
# now and then takes more iterations, one whose inputs never fit its plan again never settles.
MAX_SETTLING_ITERATIONS = 100

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)


@dataclass
class Stats:
    """What `terra_torch.stats(model)` returns. Times in seconds."""

    iterations: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})
    transitions: list[tuple[int, str, str]] = field(default_factory=list)  # (iteration, from, to)
    fallbacks: int = 0
    graph_builds: int = 0
    python_exec_s: float = 0.0  # PythonRunner: time in co-executed iterations minus its stalls
    python_stall_s: float = 0.0  # PythonRunner blocked on the graph (reads, fallbacks)
    graph_exec_s: float = 0.0  # GraphRunner: running the graph minus its stalls
    graph_stall_s: float = 0.0  # GraphRunner blocked on decisions, feeds and gates
    tracing_s: float = 0.0  # time in traced (eager, recorded) iterations
    # Of the iteration boundaries after traced iterations: merging the trace into the TraceGraph
    # (merge_s) and generating the graph from it (build_s), both on the program's own thread.
    merge_s: float = 0.0
    build_s: float = 0.0
    eager_reason: str = ""  # why the program last moved to phase "eager" ("" if it never did)
    # When it gave up converging: {"op", "line", "how", "iterations", "eager_for"} (else None).
    not_converged: dict[str, Any] | None = None
    runner: dict[str, int] = field(default_factory=dict)  # raw counters of the C++ runners
    # A wrapped model's calls in eval mode or under no_grad, a program of their own (api.wrap).
    evaluation: "Stats | None" = None
    # The speed check's comparisons (terra_torch/_speed.py): {"iteration", "coexec_ms",
    # "eager_ms", "chosen"} per check, oldest first.
    speed_checks: list[dict[str, Any]] = field(default_factory=list)
    # Warm start (terra_torch/_warm_start.py), None when off: {"path", "loaded", "traces",
    # "load_s"} (traces kept by an earlier run and merged at the first iteration, and the
    # seconds that took with generating their graph; of them "import_s" merging the traces and
    # "build_s" generating the graph), plus "kept" (times this run saved it).
    warm_start: dict[str, Any] | None = None
    # The graph worker's guarded calls (csrc/runtime/team_guard.h: matrix products, norms,
    # softmaxes, VML functions): "one_thread_calls" and "team_calls" (this program's calls on one
    # thread, on torch's teams), and the process's verdicts on the layouts seen: "same"
    # (calibrated to one thread), "differ" (other bits with one thread, or an error), "large"
    # (never calibrated), "calibration_s", "why" (the first layout that differed, and how). None
    # where the guard is not installed (no MKL per-thread team, or TERRA_TEAM_GUARD=0).
    worker_team: dict[str, Any] | None = None


_active: Program | None = None  # the program whose iteration is open (one region at a time)
_active_thread = 0  # the thread that opened it: capture is per thread (the TLS dispatch key)
_programs: "weakref.WeakSet[Program]" = weakref.WeakSet()
_lock = threading.RLock()
_forked_child = False  # this process was forked while terra_torch was loaded (_after_fork_in_child)


def _after_fork_in_child() -> None:
    """A child forked from a process that co-executes (a DataLoader's worker processes, forked by
    iter(loader) inside the training loop, collate their batches there) has copies of its
    programs and of the open capture region, but none of the graph threads behind them: an op
    captured there, or a wait for a graph, would never finish. The child captures nothing, and its
    wrapped models and functions run eagerly."""
    global _forked_child, _active, _lock
    _forked_child = True
    _active = None
    _lock = threading.RLock()  # (another thread of the parent may have held it at the fork)
    _C.forget_regions_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


# Whether a file is torch's or terra_torch's, by its name (code objects of one file share the
# name string, whose hash is cached: one dict probe per frame instead of two prefix tests).
_internal_files: dict[str, bool] = {}


def _user_frame(start: FrameType | None) -> FrameType | None:
    """The first frame from `start` up that is neither torch's nor terra_torch's: the user's frame
    that called the model or function."""
    f = start
    internal = _internal_files
    while f is not None:
        name = f.f_code.co_filename
        inside = internal.get(name)
        if inside is None:
            inside = internal[name] = name.startswith(_TORCH_DIR) or name.startswith(_OWN_DIR)
        if not inside:
            return f
        f = f.f_back
    return None


def _stop_frame(start: FrameType | None = None) -> FrameType | None:
    """The frame above the user's frame that called the model or function (walking up from
    `start`, by default the caller's frame): locations start at the user's frame (its statements
    tell call sites apart), whose own loops, the training loop among them, are ignored
    (Program.begin)."""
    user = _user_frame(start if start is not None else sys._getframe(1))
    return user.f_back if user is not None else None


def _fused_source(program: "weakref.ref[Program]") -> Callable[[], Any]:
    def source() -> Any:
        p = program()
        if p is None:
            raise LookupError("the program is gone")
        return p._session.fused

    return source


def every_core_hint() -> str:
    """Why co-execution lost, where torch's intra-op team takes every core this process may use:
    the graph's parallel kernels then wait for a team member on the core Python runs on
    (docs/RUNTIME.md, "The worker's intra-op threads"). Empty otherwise."""
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads <= 1 or threads < cores:
        return ""
    return (f". torch runs its kernels on all {cores} cores (torch.get_num_threads() == {threads}), which "
            f"leaves none to Python beside the graph: with torch.set_num_threads({cores - 1}) co-execution "
            f"usually wins (the reference is then eager with {cores - 1} thread{'s' if cores > 2 else ''})")


class Program:
    """One co-executed program and its phase machine."""

    def __init__(self, name: str, mode: str = "coexec", optimize: bool | str = False,
                 speed_check: bool = False, warm_start: Path | None = None,
                 structure: Callable[[], list[Any]] | None = None) -> None:
        if mode not in ("coexec", "lazy", "trace"):
            raise ValueError(f"terra_torch: mode must be 'coexec', 'lazy' or 'trace', got {mode!r}")
        if optimize not in (False, True, "fused"):
            raise ValueError(f"terra_torch: optimize must be False, True or 'fused', got {optimize!r}")
        self.name = name
        self.mode = mode
        self.phase = "tracing"
        self.iteration = 0
        self.fallbacks: list[Fallback] = []
        self._stats = Stats()
        self._other_thread_logged = False  # (begin: a call from a second thread runs eagerly)
        self._partial_before = False  # (end: the previous traced iteration was cut by synchronize())
        fused = optimize == "fused"
        # Warm start: the folder of the kept program (None: off); the entry itself is named at
        # the first iteration, when the calling code is known (_warm_start.KeptProgram).
        self._warm_folder = warm_start if mode != "trace" else None
        self._structure = structure
        self._kept: _warm_start.KeptProgram | None = None
        self._kept_refused = False
        self._session_args = ("lazy" if mode == "lazy" else "coexec", optimize is True, fused,
                              self._warm_folder is not None)
        self._session = _C.runtime.Session(*self._session_args)
        # optimize="fused": segments compile in the background (terra_torch/_fused.py). The thread
        # holds the program weakly and ends with it.
        self._compiler = _fused.SegmentCompiler(_fused_source(weakref.ref(self))) if fused else None
        self._region: Any = None
        self._region_phase = ""
        self._t0 = 0
        self._timeline = Timeline()  # phase changes and fallbacks; iterations are in _iteration_log
        # Traced iterations, (iteration, phase, start ns, end ns): bounded like a timeline. The
        # session logs the co-executed ones (Session.iteration_spans).
        self._iteration_log: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=_ITERATIONS_KEPT)
        self._monitor = _log.DivergenceMonitor()
        self.evaluation: Program | None = None  # a wrapped model's eval-mode program (api.wrap)
        # Convergence (MAX_UNCONVERGED_ITERATIONS): iterations in a row that were traced or fell
        # back, where each one left the program, the ops of the last traced one, the back-off.
        self._unconverged = 0
        self._differences: list[dict[str, str]] = []
        self._previous_ops: list[Any] = []
        self._eager_left: int | None = None
        self._backoff = EAGER_BACKOFF
        # Co-execution or eager, whichever is faster (terra_torch/_speed.py); TERRA_SPEED_CHECK=0
        # turns it off everywhere.
        self._speed = SpeedCheck(speed_check and mode == "coexec" and os.environ.get("TERRA_SPEED_CHECK", "1") != "0")
        # Blocks settle for a time after a switch (terra_torch/_speed.py): co-executed ones not
        # where this thread gives its OpenMP pool back as it enters co-execution (begin()), none
        # without the worker's one-thread small calls (csrc/runtime/team_guard.h), where
        # co-execution on several threads is 3-10x slower and each recheck's settling would
        # co-execute for 50 ms.
        self._can_release_pool = _C.runtime.can_release_openmp_pool()
        if self._can_release_pool:
            self._speed.coexec_settle_s = 0.0
        if not _C.runtime.team_guard()["installed"]:
            self._speed.settle_s = 0.0
        self._speed_eager = False  # phase "eager" because eager was measured faster
        self._worker_pool_held = False  # a co-executed iteration ran since the last release_worker_pool()
        # An iteration's time for the check is begin to begin (so that ending the previous
        # iteration, Session.close and this bookkeeping, counts too): end() notes the mode of an
        # iteration that counts, the next begin() measures it.
        self._speed_pending: str | None = None
        self._speed_compiles = 0  # the segment compiler's `changes` the speed check has seen
        self._speed_held = 0  # co-executed iterations in a row not measured: compiled segments settling
        self._stall_mark_ns = 0  # the session's Python stall sum when the check last probed
        self._last_begin_ns = 0
        _programs.add(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickling a wrapped module comes here (copy.deepcopy makes an unwrapped copy instead,
        # api._copy_unwrapped): a program owns a worker thread and the graph's values.
        raise TypeError(f"terra_torch: {self.name} is wrapped by terra_torch, and a wrapped module cannot be "
                        "pickled; save its state_dict() (which can be saved while wrapped), or "
                        "terra_torch.unwrap it first")

    # ---- iteration boundaries -----------------------------------------------------------------

    def begin(self, stop_frame: FrameType | None) -> None:
        """Start an iteration (ending the open one, of this or another program)."""
        global _active, _active_thread
        if _forked_child:
            return
        start = time.monotonic_ns()
        with _lock:
            if _active is not None and _active_thread != threading.get_ident():
                # One capture region per process (csrc/capture/region.cpp), opened and closed by
                # its thread, whose dispatch TLS turns interception on: ending it from here
                # tore both threads' iterations apart (a hang, "reads a value that no earlier
                # record produced", a double free). This call runs eagerly instead.
                if not self._other_thread_logged:
                    self._other_thread_logged = True
                    owner = _thread_name(_active_thread)
                    logger.warning("%s is called from thread %s while thread %s co-executes %s: calls "
                                   "from a second thread run eagerly (a thread that is done with its models "
                                   "hands co-execution over by calling terra_torch.synchronize() in %s)",
                                   self.name, threading.current_thread().name, owner, _active.name, owner)
                return
            _end_open_iteration(self)
            if self._speed_pending is not None and self._last_begin_ns:
                self._speed_observe(self._speed_pending, (start - self._last_begin_ns) / 1e9)
            self._speed_pending, self._last_begin_ns = None, start
            if self._warm_folder is not None and self._kept is None and self.phase == "tracing":
                # (not for a program already sent to eager, e.g. an unsupported DDP wrapper)
                self._warm_start(_user_frame(sys._getframe(1)))
            previous_phase, self._region_phase = self._region_phase, self.phase
            self._t0 = start
            _active, _active_thread = self, threading.get_ident()
            if self.phase != "coexec" and self._worker_pool_held:
                # Kernels run on this thread now: the graph worker's idle OpenMP pool would make
                # both teams sleep at every barrier (csrc/runtime/worker_threads.h).
                self._session.release_worker_pool()
                self._worker_pool_held = False
            elif self.phase == "coexec" and previous_phase != "coexec" and self._can_release_pool:
                # The graph's kernels run on the worker now, and the idle team threads of this
                # thread's eager kernels (tracing, eager iterations) would spin on its core for
                # libgomp's spin count: at 2 threads, co-executed MLP steps right after a switch
                # took 2-5 ms instead of 0.25 (3 of the first 7), without this none.
                _C.runtime.release_openmp_pool()
            if self.phase == "eager":
                return
            if self.phase == "coexec":
                self._worker_pool_held = True
                try:
                    # (the session logs the iteration's span and Python's stalls in it)
                    self._region = self._session.open(stop_frame, True, self.iteration)
                except RuntimeError as e:
                    # The graph failed in an op whose arguments only the data could refuse (an
                    # index out of range): eager would have raised there. Raise it now and
                    # trace the next iteration.
                    self.fallbacks.append(Fallback(self.iteration, f"the graph failed: {e}", "<graph>"))
                    self._move("tracing", "the graph failed")
                    _active = None
                    raise
            else:
                self._region = _C.Region("record", stop_frame)
                self._region.ignore_outermost_loops()
                self._region.open()

    def end(self, partial: bool = False) -> None:
        """End the open iteration: merge its trace, move between phases. `partial`: the iteration
        was cut short (synchronize), so its trace teaches nothing and is not merged."""
        global _active
        if _forked_child:
            return
        with _lock:
            region, self._region = self._region, None
            if _active is self:
                _active = None
            if partial:  # (synchronize() between two iterations: that period is not measured)
                self._speed_pending, self._last_begin_ns = None, 0
            if region is None:
                if self.phase == "eager" and self._t0:
                    self._stats.iterations["eager"] += 1
                    self.iteration += 1
                    if self._speed_eager and not partial:
                        self._speed_pending = EAGER
                    self._t0 = 0
                    if self._eager_left is not None:
                        self._eager_left -= 1
                        if self._eager_left <= 0:
                            self._eager_left = None
                            self._unconverged = 0
                            self._differences.clear()
                            self._move("tracing", f"retrying after {self._backoff // 2} eager iterations")
                return
            phase = self._region_phase
            self._stats.iterations[phase] += 1
            unsupported = region.unsupported()
            if unsupported:
                # The iteration ran for real from that op on and its trace is incomplete.
                if phase == "coexec":
                    self._session.close(region, True)
                else:
                    region.close()
                self.iteration += 1
                reason = f"{unsupported}; {self.name} runs eagerly"
                warnings.warn(f"terra_torch: {reason}", stacklevel=3)
                self.run_eagerly(reason)
                return
            if phase == "coexec":
                # (its span, stalls and channel traffic are logged by the session: timeline())
                diverged = self._session.close(region, partial)
                if diverged:
                    fallback = self._record_fallback(region)
                    unsupported = self._session.diverged_at_unsupported()
                    t_merge = time.monotonic_ns()
                    covered = self._session.add(region)
                    self._stats.merge_s += (time.monotonic_ns() - t_merge) / 1e9
                    self._unconverged += 1
                    self._differences.append({"op": fallback.op, "line": fallback.source_line or "<unknown line>",
                                              "how": fallback.reason})
                    # At an op the graph cannot express, a new graph would stop there too: the
                    # path runs eagerly from that op on, the program stays in co-execution.
                    if self._unconverged >= MAX_UNCONVERGED_ITERATIONS and self.mode != "trace":
                        self._give_up()
                    elif not (unsupported and covered):
                        self._move("tracing", f"fell back at {fallback.source_line}: {fallback.reason}")
                    self._speed.restart()
                    self._speed_pending = None
                else:
                    self._unconverged = 0
                    self._differences.clear()
                    if not partial:
                        self._speed_pending = COEXEC
            else:
                now = time.monotonic_ns()
                # One tuple per iteration; timeline() turns them into events (nothing is formatted
                # at an iteration boundary).
                self._iteration_log.append((self.iteration, phase, self._t0, now))
                region.close()
                self._stats.tracing_s += (now - self._t0) / 1e9
                # A synchronize() cuts an iteration short, and its trace is left out; but a program
                # that synchronizes at the same point of every iteration (timing each step) cuts
                # them all there alike, and left out they never converged: from the second such
                # iteration in a row, the traces are merged.
                partial_again, self._partial_before = partial and self._partial_before, partial
                if partial and not partial_again:
                    self.iteration += 1
                    return
                t_merge = time.monotonic_ns()
                covered = self._session.add(region)
                self._stats.merge_s += (time.monotonic_ns() - t_merge) / 1e9
                self._unconverged += 1
                if not covered:
                    self._differences.append(self._difference(region, self._session.last_uncovered))
                self._previous_ops = region.ops()
                if not covered and self._unconverged >= MAX_UNCONVERGED_ITERATIONS and self.mode != "trace":
                    self._give_up()
                elif covered and self.mode != "trace":
                    t_build = time.monotonic_ns()
                    try:
                        self._session.build()
                    except RuntimeError as e:
                        # Not expressible as a graph (ops it cannot express cost only their
                        # paths, so this is rarer): stay correct, run eagerly, retry later.
                        self.fallbacks.append(Fallback(self.iteration, str(e), "<graph generation>"))
                        self._differences.append({"op": "<graph generation>", "line": "<graph generation>",
                                                  "how": str(e)})
                        self._give_up(str(e))
                    else:
                        self._stats.graph_builds += 1
                        self._stats.build_s += (time.monotonic_ns() - t_build) / 1e9
                        if self._kept is not None:
                            self._keep()
                        for _node, why in self._session.unsupported():
                            # Once per build: every path through that op runs eagerly from it on.
                            logger.warning("%s: the graph cannot run an op, its paths run eagerly: %s", self.name, why)
                        self._move("coexec", "the last traced iteration added nothing new")
            self.iteration += 1

    # ---- warm start (terra_torch/_warm_start.py) -------------------------------------------

    def _warm_start(self, user: FrameType | None) -> None:
        """At the first iteration: merge the traces an earlier run kept and co-execute at once."""
        structure = self._structure() if self._structure is not None else []
        kept = self._kept = _warm_start.KeptProgram(self._warm_folder, self.name,
                                                    user.f_code if user is not None else None, structure)
        info: dict[str, Any] = {"path": str(kept.path), "loaded": False, "traces": 0, "load_s": 0.0,
                                "import_s": 0.0, "build_s": 0.0, "kept": 0}
        self._stats.warm_start = info
        t0 = time.perf_counter()
        text = kept.load()
        if text is None:
            return
        try:
            t1 = time.perf_counter()
            self._session.import_program(text)
            t2 = time.perf_counter()
            self._session.build()
            info.update(import_s=t2 - t1, build_s=time.perf_counter() - t2)
        except (ValueError, RuntimeError) as e:  # (an operator unknown here, a graph it cannot build)
            kept.ignore(str(e))
            self._session = _C.runtime.Session(*self._session_args)
            return
        info.update(loaded=True, traces=self._session.num_traces, load_s=time.perf_counter() - t0)
        self._stats.graph_builds += 1
        self._move("coexec", f"warm start: {info['traces']} traces kept by an earlier run ({kept.path})")

    def _keep(self) -> None:
        """Save the traces merged so far for the next run (after each graph build)."""
        assert self._kept is not None
        try:
            text = self._session.export_program()
            self._kept.save(text)
        except (ValueError, OSError) as e:
            if not self._kept_refused:
                self._kept_refused = True
                logger.warning("%s: not kept for warm start: %s", self.name, e)
            return
        if self._stats.warm_start is not None:
            self._stats.warm_start["kept"] += 1

    def _difference(self, region: Any, k: int) -> dict[str, str]:
        """Where (op, user line) and how the trace of `region` left the program at record `k`,
        compared with the previous traced iteration: an attribute value, an output shape, another
        op at that line, or an op or end the earlier iterations did not have there."""
        ops = region.ops()
        if not ops:
            return {"op": "<no op>", "line": "<unknown line>", "how": "the iteration issued no op"}
        prev = self._previous_ops
        if k >= len(ops):
            last = ops[-1]
            return {"op": last[0], "line": Location(last[5], region).user_frame,
                    "how": f"the iteration ended after {len(ops)} ops where earlier iterations went on"}
        name, attrs, _h, _inputs, outputs, loc = ops[k][:6]
        line = Location(loc, region).user_frame
        # (by position: an op's arguments may hold script objects that cannot be compared, the
        # profiler's _RecordFunction handle that DataLoader and optimizer steps pass around)
        same_line = [j for j, p in enumerate(prev) if p[5] == loc]
        same_op = [j for j in same_line if prev[j][0] == name]
        if same_op:
            j = min(same_op, key=lambda q: abs(q - k))
            p = prev[j]
            changed = [f"argument {i}: {a!r} -> {b!r}" for i, (a, b) in enumerate(zip(p[1], attrs)) if repr(a) != repr(b)]
            shapes = [f"output {i}: {list(a[1])} -> {list(b[1])}" for i, (a, b) in enumerate(zip(p[4], outputs))
                      if list(a[1]) != list(b[1])]
            if changed:
                how = "attribute value differs (" + "; ".join(changed) + ")"
            elif shapes:
                how = "shape differs (" + "; ".join(shapes) + ")"
            else:
                how = f"issued at another place in the op sequence (op {k}, op {j} before)"
        elif same_line:
            how = f"another op at this line ({name}, {prev[same_line[0]][0]} before)"
        elif k < len(prev):
            how = f"an op the previous iteration did not issue here ({prev[k][0]} there before)"
        else:
            how = f"an op after the {len(prev)} ops the previous iteration ended with"
        return {"op": name, "line": line, "how": how}

    def _give_up(self, reason: str | None = None) -> None:
        """Stop tracing a program that does not converge: one warning naming what keeps
        differing, then eager iterations without capture cost until the back-off ends."""
        diffs = self._differences or [{"op": "<unknown op>", "line": "<unknown line>", "how": reason or "unknown"}]
        # The site that differed most often in this run, with its latest way of differing.
        counts: dict[tuple[str, str], int] = {}
        for d in diffs:
            counts[(d["op"], d["line"])] = counts.get((d["op"], d["line"]), 0) + 1
        op, line = max(counts, key=lambda key: counts[key])
        how = [d for d in diffs if (d["op"], d["line"]) == (op, line)][-1]["how"]
        eager_for = self._backoff
        self._backoff *= 2
        self._eager_left = eager_for
        what = (f"did not converge after {self._unconverged} traced or fallen-back iterations: {op} at {line} keeps "
                f"differing ({how})")
        if reason is not None:
            what = f"graph generation failed ({reason})"
        self._stats.not_converged = {"op": op, "line": line, "how": how, "iterations": self._unconverged,
                                     "eager_for": eager_for}
        self._stats.eager_reason = what
        logger.warning("%s: %s; running eagerly for %d iterations, then tracing again", self.name, what, eager_for)
        self._unconverged = 0
        self._differences.clear()
        self._move("eager", what)

    def _speed_observe(self, mode: str, seconds: float) -> None:
        """Feeds one measured iteration to the speed check and moves to the mode it asks for."""
        if not self._speed.enabled:
            return
        if self._compiler is not None and self._compiler.changes != self._speed_compiles and self._compiler.idle:
            self._speed_compiles = self._compiler.changes
            self._speed.recheck()
        if mode == COEXEC and self._compiler is not None:
            # Loaded compiled code is checked on its first run, then timed against the interpreter
            # (FusedExecutor::settling): such iterations are slower than the steady ones, and a
            # check measuring them chose eager, where the segments never settle (half of the
            # timed iterations of several quick-suite programs ran eagerly). So they are not
            # measured; a segment that never runs again stops holding the check after a while.
            fused = self._session.fused
            if fused is not None and fused.settling():
                self._speed_held += 1
                if self._speed_held <= MAX_SETTLING_ITERATIONS:
                    return
            else:
                self._speed_held = 0
        waited = None
        if mode == COEXEC and self._speed.probing:
            # Python's waits for the graph in this iteration (the session's sums only grow, and
            # start again at zero with a new session)
            stall_ns = self._session.python_times()[1]
            waited = max(0, stall_ns - self._stall_mark_ns) / 1e9
            self._stall_mark_ns = stall_ns
        checks = len(self._speed.verdicts)
        wanted = self._speed.observe(mode, seconds, self.iteration, waited)
        if wanted == mode and len(self._speed.verdicts) == checks:
            return  # (nearly every iteration: nothing to report, nothing to move)
        if len(self._speed.verdicts) > checks:
            v = self._speed.verdicts[-1]
            self._stats.speed_checks.append({"iteration": v.iteration, "coexec_ms": v.coexec_s * 1e3,
                                             "eager_ms": v.eager_s * 1e3, "chosen": v.chosen})
            why = (f"speed check: co-executed iterations took {v.coexec_s * 1e3:.3f} ms, eager ones "
                   f"{v.eager_s * 1e3:.3f} ms (medians, measured in turns)")
            if v.chosen == EAGER:
                first = not any(c["chosen"] == EAGER for c in self._stats.speed_checks[:-1])
                (logger.warning if first else logger.info)(
                    "%s: %s; running eagerly (the same numbers), checking again in %d iterations%s", self.name, why,
                    self._speed.next_check_in, every_core_hint() if first else "")
                self._stats.eager_reason = why
        else:
            why = f"speed check: measuring {wanted} iterations"
        if wanted == mode:
            return
        if wanted == EAGER:
            # The graph finishes, every placeholder gets its value and the runner forgets them:
            # eager iterations write those tensors for real from now on.
            self._session.synchronize(True)
            self._speed_eager = True
            self._move("eager", why)
        else:
            self._speed_eager = False
            self._move("coexec", why)

    def run_eagerly(self, reason: str) -> None:
        """Run every iteration eagerly from now on, without capture, for `reason` (no retry)."""
        self._stats.eager_reason = reason
        self._eager_left = None
        self._move("eager", reason)

    def synchronize(self) -> None:
        """End the open iteration, wait for the graph, give every live placeholder its value."""
        if _forked_child:
            return
        with _lock:
            self.end(partial=True)
            self._session.synchronize(True)

    def materialize(self, t: torch.Tensor) -> None:
        if not _forked_child:
            self._session.materialize(t)

    def catch_up(self) -> None:
        """Wait until the graph has run every op Python validated (terra_torch/_rng.py)."""
        if not _forked_child:
            self._session.catch_up()

    def close(self) -> None:
        """Synchronize and stop the graph for good."""
        if _forked_child:
            return
        with _lock:
            self.synchronize()
            self._session.shut_down()

    # ---- reporting ------------------------------------------------------------------------------

    def stats(self) -> Stats:
        s = self._stats
        raw = dict(self._session.stats)
        s.runner = raw
        s.fallbacks = len(self.fallbacks)
        exec_ns, stall_ns = self._session.python_times()
        s.python_exec_s, s.python_stall_s = exec_ns / 1e9, stall_ns / 1e9
        s.graph_exec_s = max(0, raw.get("graph_exec_ns", 0) - raw.get("graph_stall_ns", 0)) / 1e9
        s.graph_stall_s = raw.get("graph_stall_ns", 0) / 1e9
        guard = dict(_C.runtime.team_guard())
        if guard.pop("installed"):
            guard["calibration_s"] = guard.pop("calibration_ns") / 1e9
            s.worker_team = {"one_thread_calls": raw.get("graph_one_thread_calls", 0),
                           "team_calls": raw.get("graph_team_calls", 0), **guard}
        return s

    @property
    def graph_text(self) -> str:
        return self._session.text

    def _move(self, phase: str, reason: str = "") -> None:
        old, self.phase = self.phase, phase
        self._stats.transitions.append((self.iteration, old, phase))
        _log.phase_transition(self.name, old, phase, self.iteration, reason)
        self._timeline.instant(f"{old} -> {phase}", "decision", PYTHON_RUNNER, args={"reason": reason})

    @staticmethod
    def _coexec_events(out: Timeline, span: tuple[int, ...]) -> None:
        """The events of one co-executed iteration (Session.iteration_spans). Where in the
        iteration Python waited is not recorded, only how long: the stall is drawn at the
        iteration's end, and the channel traffic as counters."""
        iteration, t0, t1, stall, decisions, feeds, reads = span
        out.complete(f"iteration {iteration} (coexec)", "exec", PYTHON_RUNNER, t0, t1 - t0)
        if stall > 0:
            out.complete("stalled on the graph", "stall", PYTHON_RUNNER, t1 - stall, stall, {"position": "approximate"})
        out.counter("channel", {"decisions": decisions, "feeds": feeds, "python_reads": reads}, t1, cat="feed")

    def timeline(self) -> Timeline:
        """Both runners on one time axis (Chrome trace JSON: .save(path), open in Perfetto)."""
        out = Timeline(origin_ns=self._timeline.origin_ns, max_events=None)
        for iteration, phase, t0, t1 in self._iteration_log:
            out.complete(f"iteration {iteration} ({phase})", "exec", PYTHON_RUNNER, t0, t1 - t0)
        for span in self._session.iteration_spans():
            self._coexec_events(out, span)
        out._events.extend(self._timeline._events)  # noqa: SLF001 - same module family
        for k, (start, end) in enumerate(self._session.graph_spans()):
            out.complete(f"graph run {k}", "exec", GRAPH_RUNNER, start, end - start)
        return out

    def explain(self) -> Any:
        s = self.stats()
        phases = {"iterations": dict(s.iterations), "transitions": list(s.transitions),
                  "python_exec_s": s.python_exec_s, "python_stall_s": s.python_stall_s,
                  "graph_exec_s": s.graph_exec_s, "graph_stall_s": s.graph_stall_s, "phase": self.phase}
        fused = self._session.fused
        return explanation_from(self._session if self._session.num_traces else None, phases, self.fallbacks,
                                self._session.text or None, not_converged=s.not_converged,
                                eager_reason=s.eager_reason,
                                segments=list(fused.report()) if fused is not None else None,
                                runner=dict(s.runner))

    def _record_fallback(self, region: Any) -> Fallback:
        reason, record = self._session.divergence()
        line = "<end of iteration>"
        op = "<end of iteration>"
        if record >= 0:
            ops = region.ops()
            if record < len(ops):
                line = Location(ops[record][5], region).user_frame
                op = ops[record][0]
        fallback = Fallback(self.iteration, reason, line, op)
        self.fallbacks.append(fallback)
        logger.info("%s: iteration %d fell back to eager at %s: %s", self.name, self.iteration, line, reason)
        self._timeline.instant("fallback", "fallback", PYTHON_RUNNER, args={"line": line, "reason": reason})
        self._monitor.record(self.iteration, line, reason, line)
        return fallback


def _end_open_iteration(next_program: Program | None) -> None:
    """Under _lock, on the thread that opened it: end the open iteration whole. Values flow
    between programs only as real tensors, so unless `next_program` goes on with the same program,
    every placeholder of the ended one gets its value."""
    previous = _active
    if previous is None:
        return
    previous.end()
    if previous is not next_program:
        previous._session.synchronize(True)


def _thread_name(ident: int) -> str:
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return str(ident)


def active() -> Program | None:
    """The program whose iteration the calling thread has open. Other threads (a DataLoader's, the
    segment compiler's) get None: their tensors are never placeholders, and routing their reads
    to the program made the compiler's torch.tensor() wait for the graph while holding the GIL."""
    return _active if _active_thread == threading.get_ident() else None


def synchronize_all() -> None:
    for p in list(_programs):
        p.synchronize()


_transform_logged: set[str] = set()


# Whether a torch.func transform runs: its dispatch keys are in this thread's TLS. Read without
# touching functorch's own TLS: `peek_interpreter_stack()` creates it, and from then on every
# ThreadLocalState capture (each backward, each `at::launch`) deep-copies it, which eager never
# pays (`python -m benchmarks.step_ab --variants eager,terra:TERRA_AB_PHASE=eager`, docs/BENCHMARKS.md).
_functorch_transforms_active: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", lambda: torch._C._functorch.peek_interpreter_stack() is not None)


def stepped_aside_for_transform(name: str) -> bool:
    """True, after ending the open iteration, when a torch.func transform (grad, vmap, jvp,
    functional_call inside one) is running: then the call runs eagerly, outside every capture
    region. Its ops act on functorch's wrapper tensors, which placeholders cannot stand in for,
    and functorch refuses the copies that give placeholders their values inside a transform
    ("in-place operation (aten::copy_) that would mutate a captured Tensor"); so the values are
    given with functorch's keys off (they are terra's bookkeeping, no op of the program)."""
    if not _functorch_transforms_active():
        return False
    with torch._C._DisableFuncTorch(), _lock:
        # The open iteration ends here as at a call of another program (Program.begin): whole,
        # so that its trace counts (a per-step synchronize() would cut every iteration short).
        # Only by its own thread (see Program.begin): another thread's iteration stays open.
        if not _forked_child and _active_thread == threading.get_ident():
            _end_open_iteration(None)
    if name not in _transform_logged:
        _transform_logged.add(name)
        logger.info("%s is called under a torch.func transform: such calls run eagerly", name)
    return True


@atexit.register
def close_all() -> None:
    """Close every program: each graph finishes its work and the placeholders a program still
    holds get their values; no iteration stays open. A failure is logged, not raised.

    Registered at exit (before _C's own hook, registered earlier); tests call it after each
    test so that one that fails midway leaves nothing open for the next."""
    global _active
    if _forked_child:
        return
    for p in list(_programs):
        try:
            p.close()
        except Exception as e:  # noqa: BLE001 - exit must go on
            logger.warning("terra_torch: closing %s failed: %s", p.name, e)
    _active = None
