"""Never slower than eager: a program whose co-execution is measured slower runs eagerly.

Co-execution gives eager's numbers bit for bit, so whether an iteration co-executes or runs
eagerly is only a question of speed. Where the program reads tensor values often (an `.item()`
per inner step, a branch on the loss right after backward), Python and the graph take turns
instead of overlapping, and a co-executed iteration can take longer than an eager one (see
docs/RUNTIME.md, "Speed check"). `SpeedCheck` measures both on the program itself and keeps the
faster, checking again now and then (the data, the batch size or the machine's load change).

Iterations of a program whose co-execution is slower, with the defaults:

    0-3       tracing
    3-103     co-executed; the last 10 of them are measured (wall time per iteration)
    103-148   eager 5 + 10, co-executed 5 + 10, eager 5 + 10 (5 to settle after each switch):
              medians of 20 per mode; co-execution was slower -> stay eager
    148-348   eager (200 iterations); then the two are measured in turns again ...
              the interval doubles while the decision stays (200, 400, ... 12800)

An iteration's time is the wall time from one start of an iteration to the next, so it covers
everything the loop does (data loading, backward, the optimizer, logging) and, in co-execution,
the waits for a graph that is behind (Python runs at most two iterations ahead of it). Eager
must be faster by more than `margin` before co-execution is left: within the noise of a
measurement, co-execution stays.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

COEXEC, EAGER = "coexec", "eager"


@dataclass(frozen=True)
class SpeedVerdict:
    """One comparison: median seconds per iteration of each mode, and the mode chosen."""

    iteration: int
    coexec_s: float
    eager_s: float
    chosen: str


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

    def __init__(self, enabled: bool = True, *, first_after: int = 100, window: int = 20, settle: int = 5,
                 interval: int = 200, max_interval: int = 12800, margin: float = 0.05) -> None:
        if window < 2 or settle < 0 or first_after < window or interval < 1 or max_interval < interval:
            raise ValueError("SpeedCheck: need window >= 2, settle >= 0, first_after >= window and "
                             "max_interval >= interval >= 1")
        self.enabled = enabled
        self.window = window
        self.settle = settle
        self.first_interval = interval
        self.max_interval = max_interval
        self.margin = margin
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

    def _start_check(self, mode: str, skip: int) -> None:
        other = EAGER if mode == COEXEC else COEXEC
        self._blocks = [other, mode, other]  # the blocks after the current one
        self._samples: dict[str, list[list[float]]] = {COEXEC: [], EAGER: []}  # blocks per mode
        self._measuring: str | None = mode
        self._block_left = self._half
        self._skip = skip
        self._mode = mode

    def observe(self, mode: str, seconds: float, iteration: int) -> str:
        """Counts one iteration that ran in `mode` and took `seconds`; returns the next mode."""
        if not self.enabled:
            return mode
        if self._measuring is None:
            self._left -= 1
            if self._left <= 0:  # check again, starting with the mode we are in
                self._start_check(mode, skip=0)
            return self._mode
        if mode != self._measuring:
            return self._mode
        if self._skip > 0:
            self._skip -= 1
            return self._mode
        if self._block_left == self._half:
            self._samples[mode].append([])
        self._samples[mode][-1].append(seconds)
        self._block_left -= 1
        if self._block_left > 0:
            return self._mode
        if self._blocks:
            following = self._blocks.pop(0)
            self._measuring, self._mode, self._block_left, self._skip = following, following, self._half, self.settle
            return following
        coexec_s = min(statistics.median(b) for b in self._samples[COEXEC])
        eager_s = min(statistics.median(b) for b in self._samples[EAGER])
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
