"""Never slower than eager: a program whose co-execution is measured slower runs eagerly.

Co-execution gives eager's numbers bit for bit, so whether an iteration co-executes or runs
eagerly is only a question of speed. Where the program reads tensor values often (an `.item()`
per inner step, a branch on the loss right after backward), Python and the graph take turns
instead of overlapping, and a co-executed iteration can take longer than an eager one (see
docs/RUNTIME.md, "Speed check"). `SpeedCheck` measures both on the program itself and keeps the
faster, checking again now and then (the data, the batch size or the machine's load change).

Iterations of a program whose co-execution is slower (by less than `decisive`, below), with
the defaults:

    0-3       tracing
    3-43      co-executed; the last 10 of them are measured (wall time per iteration)
    43-88     eager 5 + 10, co-executed 5 + 10, eager 5 + 10 (5 to settle after each switch,
              and at least 50 ms: `settle_s`, below): medians of 20 per mode;
              co-execution was slower -> stay eager
    88-288    eager (200 iterations); then the two are measured in turns again ...
              the interval doubles while the decision stays (200, 400, ... 12800)

Two shortcuts keep the check cheap where one mode is far slower. Co-execution can be 3-7x
slower than eager where the graph's kernels want the core Python holds (docs/RUNTIME.md, "The
worker's intra-op threads"); each such iteration before a verdict costs several eager ones.

- *Probe.* Co-executed iterations 4-14 note how long Python waited for the graph. Where it
  waited more than half of their time, the graph is the limit and eager may well be faster: the
  first check starts at once, with those iterations as its first co-executed block (at 2
  threads `dcgan` co-executes 4-5x slower than eager: each iteration before a verdict costs
  several eager ones).
- *Decisive blocks.* Once one mode has a complete block, a block of the other whose first 3
  iterations each take more (or each less) than `decisive` (1.5x) times the first mode's median,
  or whose median does, ends the check at once for the faster mode. For co-execution, the mode a
  program stays in within the noise, `favoured` (1.25x) is enough: eager iterations each 1.25x
  co-execution's median end the check for co-execution. A mode with a faster block earlier in the
  same check is not decided slower by a later one: load from another process makes a block
  slower, never faster.

*Settling by time.* After a switch to co-execution (from eager iterations or tracing), the
OpenMP team threads of Python's eager kernels spin for libgomp's default spin count on the core
the graph needs: for 35-40 ms on the development VM, co-executed MLP steps took 0.42 ms instead
of 0.13 (eager: 0.20), and a check measuring them chose eager. So co-executed iterations count
only from `settle_s` (50 ms, where torch runs more than one intra-op thread) after a switch;
so do eager ones (after co-executed iterations eager ones are slower for a while too). Where
the Python thread gives its OpenMP pool back as it enters co-execution (the Program does, where
the OpenMP runtime can: csrc/runtime/worker_threads.h), no team of Python's is left to spin, and
co-executed blocks settle for `settle` iterations only (`coexec_settle_s` 0): at 2 threads, the
MLP's first co-executed steps after eager ones took 0.23-0.3 ms against 2-5 ms for 3 of the
first 7 without it. The Program sets `settle_s` to 0 where the worker's small calls cannot take
one thread (csrc/runtime/team_guard.h, not installed): with a full team co-execution on several
threads is 3-10x slower, and each recheck's settling would co-execute for 50 ms.

An iteration's time is the wall time from one start of an iteration to the next, so it covers
everything the loop does (data loading, backward, the optimizer, logging) and, in co-execution,
the waits for a graph that is behind (Python runs at most two iterations ahead of it). Eager
must be faster by more than `margin` before co-execution is left: within the noise of a
measurement, co-execution stays.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

COEXEC, EAGER = "coexec", "eager"

# How long a block settles after a switch where OpenMP teams may spin (SpeedCheck.settle_s).
SETTLE_S = 0.05


@dataclass(frozen=True)
class SpeedVerdict:
    """One comparison: median seconds per iteration of each mode, and the mode chosen."""

    iteration: int
    coexec_s: float
    eager_s: float
    chosen: str


@dataclass
class _Probe:
    """Co-executed iterations still to let pass, and to sum; their seconds and Python's waits."""

    skip: int
    left: int
    times: list[float] = field(default_factory=list)
    waited: float = 0.0


class SpeedCheck:
    """Decides, from measured iteration times, whether a program co-executes or runs eagerly.

    The Program calls `observe(mode, seconds, iteration)` after each iteration that co-executed
    to its end or ran eagerly for this check (traced and fallen-back iterations are not
    measured); the return value is the mode the next iteration should run in.

    A check measures the two modes in turns, `window // 2` iterations at a time (a block), twice
    each, starting with the mode the program is in (after a switch, `settle` iterations are let
    pass), and compares each mode's faster block (the lower of its two block medians): a burst of
    load from another process during one block does not decide.
    """

    def __init__(self, enabled: bool = True, *, first_after: int = 40, window: int = 20, settle: int = 5,
                 settle_s: float | None = None, interval: int = 200, max_interval: int = 12800, margin: float = 0.05,
                 decisive: float = 1.5, favoured: float = 1.25, probe: tuple[int, int] = (4, 10),
                 coexec_settle_s: float | None = None) -> None:
        if window < 2 or settle < 0 or first_after < window or interval < 1 or max_interval < interval:
            raise ValueError("SpeedCheck: need window >= 2, settle >= 0, first_after >= window and "
                             "max_interval >= interval >= 1")
        if not 1.0 + margin < favoured <= decisive:
            raise ValueError("SpeedCheck: need 1 + margin < favoured <= decisive")
        self.enabled = enabled
        self.window = window
        self.settle = settle
        # After a switch, also at least this long: the OpenMP team threads of the mode just left
        # (Python's after eager kernels, the worker's after the graph's) spin for libgomp's
        # default spin count on the core the other mode needs. On the 2-core development VM,
        # 2 threads, an MLP + SGD step co-executed at 0.42 ms for the first 35-40 ms after each
        # switch from eager (80-95 iterations), at 0.13 ms after it (eager: 0.20 ms); measured
        # inside that window, the check chose eager. Eager iterations of `branches` right after
        # co-executed ones took 0.35-0.6 ms against 0.28, and the check chose co-execution.
        # None: SETTLE_S where torch runs more than one intra-op thread, else 0 (one thread has
        # no team to spin, and a settling eager block only delays the verdict).
        self.settle_s = settle_s
        # The same for co-executed blocks only (None: settle_s). The Program sets 0 where this
        # thread gives its OpenMP pool back when it enters co-execution (runtime.py, begin()): no
        # team of Python's is left to spin then. Eager blocks keep settle_s: with it 0 too, the
        # check's eager medians for `cnn_bn` (2 threads) were 1.39-1.51 ms against 1.08-1.12 with
        # 50 ms (runs minutes apart on a noisy VM, so not a proven transient), and one run kept
        # co-executing at 5% apart where co-execution is 30% slower.
        self.coexec_settle_s = coexec_settle_s
        self._skipped_s = 0.0
        self.first_interval = interval
        self.max_interval = max_interval
        self.margin = margin
        self.decisive = decisive
        # The decisive factor where the evidence favours co-execution (eager slower, or
        # co-execution faster). Co-execution is where a program stays within the noise, and each
        # eager iteration of a check costs the gap: quick-suite lstm co-executes 1.4x faster than
        # eager, under `decisive`, so every first check ran all its blocks, 30 eager iterations of
        # the cell's 140. Wrongly kept (load during the eager block), co-execution is measured
        # again `interval` iterations later.
        self.favoured = favoured
        # Probe: after probe[0] co-executed iterations, sum the time and Python's waits of the
        # next probe[1] (None once the probe is over).
        self._probe_shape = probe
        self._probe: _Probe | None = _Probe(*probe) if probe[1] > 0 else None
        self.verdicts: list[SpeedVerdict] = []
        self._half = window // 2
        self._mode = COEXEC  # the mode chosen (or being measured)
        self._left = 0       # settled: iterations until the next check
        self._interval = interval
        self._start_check(COEXEC, skip=first_after - self._half)

    @property
    def mode(self) -> str:
        """The mode iterations run in now."""
        return self._mode

    @property
    def next_check_in(self) -> int:
        """Iterations until the next measurement starts (0 while one is in progress)."""
        return self._left if self._measuring is None else 0

    @property
    def probing(self) -> bool:
        """Whether the next co-executed iteration's `waited` (Python's waits for the graph in it)
        is wanted by `observe`."""
        return self._probe is not None

    def _start_check(self, mode: str, skip: int) -> None:
        other = EAGER if mode == COEXEC else COEXEC
        self._blocks = [other, mode, other]  # the blocks after the current one
        self._samples: dict[str, list[list[float]]] = {COEXEC: [], EAGER: []}  # blocks per mode
        self._measuring: str | None = mode
        self._block_left = self._half
        self._skip = skip
        self._skipped_s = 0.0 if skip > 0 else float("inf")  # (a check in the mode we are in: no switch)
        self._mode = mode

    def observe(self, mode: str, seconds: float, iteration: int, waited: float | None = None) -> str:
        """Counts one iteration that ran in `mode` and took `seconds` (of which Python waited
        `waited` for the graph, where `probing` asked for it); returns the next mode."""
        if not self.enabled:
            return mode
        if self._probe is not None and mode == COEXEC:
            block = self._note_probe(seconds, waited)
            if block is not None:  # the probe's iterations are the check's first co-executed block
                self._samples[COEXEC].append(block)
                return self._next_block(iteration)
        if self._measuring is None:
            self._left -= 1
            if self._left <= 0:  # check again, starting with the mode we are in
                self._start_check(mode, skip=0)
            return self._mode
        if mode != self._measuring:
            return self._mode
        if self._skip > 0 or self._skipped_s < self._settle_seconds():
            self._skip = max(self._skip - 1, 0)
            self._skipped_s += seconds
            return self._mode
        if self._block_left == self._half:
            self._samples[mode].append([])
        block = self._samples[mode][-1]
        block.append(seconds)
        self._block_left -= 1
        other = EAGER if mode == COEXEC else COEXEC
        done = [b for b in self._samples[other] if len(b) == self._half]
        if done and (self._block_left == 0 or len(block) == min(3, self._half)):
            # Decisive: 3 iterations, each beyond `decisive` times the other mode's median, or a
            # whole block's median beyond it, in either direction.
            # A block of this mode measured earlier counts too: one burst of load from another
            # process makes a block slow, never fast.
            best_other = min(statistics.median(b) for b in done)
            low, high = (statistics.median(block),) * 2 if self._block_left == 0 else (min(block), max(block))
            low = min([low] + [statistics.median(b) for b in self._samples[mode][:-1]])
            slower, faster = (self.favoured, self.decisive) if mode == EAGER else (self.decisive, self.favoured)
            if low > slower * best_other or high * faster < best_other:
                return self._conclude(iteration, {mode: statistics.median(block), other: best_other})
        if self._block_left > 0:
            return self._mode
        return self._next_block(iteration)

    def _next_block(self, iteration: int) -> str:
        """A block is complete: switch to the next one, or conclude after the last."""
        if self._blocks:
            following = self._blocks.pop(0)
            self._measuring, self._mode, self._block_left, self._skip = following, following, self._half, self.settle
            self._skipped_s = 0.0
            return following
        return self._conclude(iteration, {m: min(statistics.median(b) for b in self._samples[m]) for m in (COEXEC, EAGER)})

    def _settle_seconds(self) -> float:
        if self._measuring == COEXEC and self.coexec_settle_s is not None:
            return self.coexec_settle_s
        if self.settle_s is not None:
            return self.settle_s
        return SETTLE_S if torch.get_num_threads() > 1 else 0.0

    def _note_probe(self, seconds: float, waited: float | None) -> list[float] | None:
        """Notes one probed iteration. Where the probe ends finding Python mostly waiting for the
        graph before the first check measured anything, the check starts at once: with the
        probe's iterations as its first co-executed block when there are enough of them (returned),
        else measuring from the next iteration."""
        probe = self._probe
        assert probe is not None
        if probe.skip > 0:
            probe.skip -= 1
            return None
        probe.left -= 1
        probe.times.append(seconds)
        probe.waited += waited or 0.0
        if probe.left > 0:
            return None
        self._probe = None
        first_pending = not self.verdicts and self._measuring == COEXEC and not self._samples[COEXEC]
        if not (first_pending and probe.waited > 0.5 * sum(probe.times)):
            return None
        self._skip = 0  # Python mostly waited for the graph: measure now
        return probe.times[-self._half:] if len(probe.times) >= self._half else None

    def _conclude(self, iteration: int, medians: dict[str, float]) -> str:
        coexec_s, eager_s = medians[COEXEC], medians[EAGER]
        chosen = EAGER if coexec_s > eager_s * (1.0 + self.margin) else COEXEC
        previous = self.verdicts[-1].chosen if self.verdicts else COEXEC
        self._interval = min(self._interval * 2, self.max_interval) if chosen == previous else self.first_interval
        self.verdicts.append(SpeedVerdict(iteration, coexec_s, eager_s, chosen))
        self._measuring, self._mode, self._left = None, chosen, self._interval
        return chosen

    def recheck(self) -> None:
        """Co-execution's speed changed (compiled segments arrived, or went back to the
        interpreter): a decision taken before is stale, and one measured while the compiler ran
        (a child process on one of the cores) was unfair to co-execution. Check again after
        `settle` iterations; a measurement in progress starts over."""
        if self._measuring is None:
            self._left = min(self._left, self.settle + 1)
            self._interval = self.first_interval
        else:
            self.restart()

    def restart(self) -> None:
        """The program left the modes this check compares (it fell back and traces again): a
        measurement in progress starts over once it co-executes again."""
        if self._measuring is not None:  # (the first measurement still waits its first_after)
            self._start_check(COEXEC, skip=max(self._skip, self.settle))
        if self._probe is not None:  # (the probe's iterations must be of one graph)
            self._probe = _Probe(*self._probe_shape)
