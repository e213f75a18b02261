"""Never slower than eager: a program whose co-execution is measured slower runs eagerly.

Co-execution gives eager's numbers bit for bit, so whether an iteration co-executes or runs
eagerly is only a question of speed. Where the program reads tensor values often (an `.item()`
per inner step, a branch on the loss right after backward), Python and the graph take turns
instead of overlapping, and a co-executed iteration can take longer than an eager one (see
docs/RUNTIME.md, "Speed check"). `SpeedCheck` measures both on the program itself and keeps the
faster, checking again now and then (the data, the batch size or the machine's load change).

Iterations of a program whose co-execution is slower, with the defaults:

    0-3       tracing
    3-103     co-executed; the last 20 of them are measured (median wall time per iteration)
    103-128   eager: 5 to settle, 20 measured; co-execution was slower -> stay eager
    128-328   eager (200 iterations); then 25 eager and 25 co-executed are measured again ...
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
    """

    def __init__(self, enabled: bool = True, *, first_after: int = 100, window: int = 20, settle: int = 5,
                 interval: int = 200, max_interval: int = 12800, margin: float = 0.05) -> None:
        if window < 1 or settle < 0 or first_after < window or interval < 1 or max_interval < interval:
            raise ValueError("SpeedCheck: need window >= 1, settle >= 0, first_after >= window and "
                             "max_interval >= interval >= 1")
        self.enabled = enabled
        self.window = window
        self.settle = settle
        self.first_interval = interval
        self.max_interval = max_interval
        self.margin = margin
        self.verdicts: list[SpeedVerdict] = []
        self._measuring: str | None = COEXEC  # the mode being measured (None: settled)
        self._skip = first_after - window     # iterations to let pass before measuring
        self._samples: list[float] = []
        self._measured: dict[str, float] = {}  # this round's medians
        self._mode = COEXEC                    # the mode chosen (or being measured)
        self._left = 0                         # settled: iterations until the next check
        self._interval = interval

    @property
    def mode(self) -> str:
        """The mode iterations run in now."""
        return self._mode

    @property
    def next_check_in(self) -> int:
        """Iterations until the next measurement starts (0 while one is in progress)."""
        return self._left if self._measuring is None else 0

    def observe(self, mode: str, seconds: float, iteration: int) -> str:
        """Counts one iteration that ran in `mode` and took `seconds`; returns the next mode."""
        if not self.enabled:
            return mode
        if self._measuring is None:
            self._left -= 1
            if self._left <= 0:  # check again, starting with the mode we are in
                self._measuring, self._skip, self._samples, self._measured = mode, 0, [], {}
            return self._mode
        if mode != self._measuring:
            return self._mode
        if self._skip > 0:
            self._skip -= 1
            return self._mode
        self._samples.append(seconds)
        if len(self._samples) < self.window:
            return self._mode
        self._measured[mode] = statistics.median(self._samples)
        self._samples = []
        other = EAGER if mode == COEXEC else COEXEC
        if other not in self._measured:
            self._measuring, self._skip, self._mode = other, self.settle, other
            return other
        coexec_s, eager_s = self._measured[COEXEC], self._measured[EAGER]
        chosen = EAGER if coexec_s > eager_s * (1.0 + self.margin) else COEXEC
        previous = self.verdicts[-1].chosen if self.verdicts else COEXEC
        self._interval = min(self._interval * 2, self.max_interval) if chosen == previous else self.first_interval
        self.verdicts.append(SpeedVerdict(iteration, coexec_s, eager_s, chosen))
        self._measuring, self._mode, self._left = None, chosen, self._interval
        return chosen

    def restart(self) -> None:
        """The program left the modes this check compares (it fell back and traces again): a
        measurement in progress starts over once it co-executes again."""
        if self._measuring is not None:  # (the first measurement still waits its first_after)
            self._measuring, self._skip = COEXEC, max(self._skip, self.settle)
            self._samples, self._measured, self._mode = [], {}, COEXEC
