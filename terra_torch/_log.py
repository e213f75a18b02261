"""terra_torch's log and its one warning about the user's program (issue 8).

terra_torch changes how a training loop runs (tracing, then co-execution, sometimes back to
eager), and a user who sees a step get slower needs to know which of those happened and why,
without a debugger. Two channels serve that:

* the `terra_torch` logger: one INFO line per phase transition, DEBUG for detail. Its level comes
  from the environment variable TERRA_LOG (debug, info, warning, error; default warning). When
  TERRA_LOG is set, terra_torch adds a stderr handler of its own, which stays quiet whenever the
  application has configured logging itself (its handlers get the records instead), so nothing
  is printed twice;
* `TerraDivergenceWarning`: raised through `warnings` by `DivergenceMonitor` when one place in
  the program keeps leaving the recorded graph. That is a property of the user's code that only
  the user can change, so it must be visible without opting in to logging.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import warnings
from collections.abc import Hashable
from typing import TextIO

LOGGER_NAME = "terra_torch"
ENV_VAR = "TERRA_LOG"
_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
}

logger = logging.getLogger(LOGGER_NAME)


class TerraDivergenceWarning(UserWarning):
    """A program location keeps diverging from the recorded graph, so terra_torch keeps falling
    back to eager execution there and gains nothing."""


class _StderrUnlessConfigured(logging.StreamHandler):
    """Writes to stderr only while the application has no handler that would also get the
    record: checked per record, because applications usually configure logging after import."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self.setFormatter(logging.Formatter("terra_torch %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if _application_has_handlers():
            return
        super().emit(record)


def _application_has_handlers() -> bool:
    node: logging.Logger | None = logger
    while node is not None:
        if any(not isinstance(h, _StderrUnlessConfigured) for h in node.handlers):
            return True
        if not node.propagate:
            return False
        node = node.parent  # type: ignore[assignment]
    return False


def configure(env: str | None = None) -> logging.Logger:
    """(Re)apply TERRA_LOG (or `env`, for tests): set the level, add or remove our handler.
    Runs at import; call it again after changing the environment."""
    value = os.environ.get(ENV_VAR) if env is None else env
    ours = [h for h in logger.handlers if isinstance(h, _StderrUnlessConfigured)]
    if not value:
        logger.setLevel(logging.WARNING)
        for h in ours:
            logger.removeHandler(h)
        return logger
    if not ours:
        logger.addHandler(_StderrUnlessConfigured())
    level = _LEVELS.get(value.strip().lower())
    logger.setLevel(logging.WARNING if level is None else level)
    if level is None:
        logger.warning("%s=%r is not one of %s; using warning", ENV_VAR, value, ", ".join(sorted(_LEVELS)))
    return logger


def phase_transition(model_name: str, old: str, new: str, iteration: int, reason: str) -> None:
    """One INFO line per phase change of a wrapped model (tracing -> co-execution, fallbacks)."""
    logger.info("%s: %s -> %s at iteration %d (%s)", model_name, old, new, iteration, reason)


class DivergenceMonitor:
    """Warns once per site that falls back more than `n` times within the last `m` iterations.

    A few early fallbacks are how tracing learns the paths a program takes; a site that keeps
    diverging will never converge (a branch on a value that changes every step), and the user
    should hear about it once, with the line and what to change, rather than every iteration.
    """

    def __init__(self, n: int = 3, m: int = 10) -> None:
        if n < 0 or m < 1:
            raise ValueError(f"DivergenceMonitor needs n >= 0 and m >= 1, got n={n}, m={m}")
        self.n = n
        self.m = m
        self._lock = threading.Lock()  # the runtime may report from more than one thread
        # Per site, the iterations of its latest fallbacks: n + 1 of them decide the rule.
        self._recent: dict[Hashable, collections.deque[int]] = {}
        self._warned: set[Hashable] = set()

    def record(self, iteration: int, site: Hashable, reason: str, source_line: str | None = None) -> bool:
        """Note a fallback at `site` (a source line "file:line", or any key with `source_line`
        naming it) in `iteration`. Returns True if this call issued the warning."""
        with self._lock:
            if site in self._warned:
                return False
            recent = self._recent.setdefault(site, collections.deque(maxlen=self.n + 1))
            recent.append(iteration)
            # n + 1 fallbacks whose oldest is within the last m iterations: more than n in m.
            if len(recent) <= self.n or iteration - recent[0] >= self.m:
                return False
            self._warned.add(site)
            count = len(recent)
            del self._recent[site]
        where = source_line if source_line is not None else str(site)
        warnings.warn(_advice(where, reason, count, self.m), TerraDivergenceWarning, stacklevel=2)
        logger.debug("divergence warning issued for %s", where)
        return True

    def warned(self, site: Hashable) -> bool:
        return site in self._warned


def _advice(where: str, reason: str, count: int, m: int) -> str:
    return (
        f"terra_torch: the program left its recorded graph at {where} {count} times in the last {m} "
        f"iterations ({reason}), so terra_torch falls back to eager execution there and gains nothing. "
        f"If this is a branch or loop on a value that changes every iteration, make it depend on a "
        f"value fixed per run (a config flag, an epoch-level setting) or move the changing part out "
        f"of the wrapped step; otherwise mark the region around {where} to run eagerly."
    )


configure()
