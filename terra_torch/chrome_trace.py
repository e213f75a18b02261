"""A timeline of what the two runners did, in Chrome's trace-event JSON (issue 8).

Co-execution is two threads handing work to each other: Python (the PythonRunner) validates ops
and posts decisions and feeds, the GraphRunner computes and publishes fetches. Whether it helps
is a question of where each side waited, which a picture on a time axis answers at a glance.
Chrome's trace-event format is the one both chrome://tracing and https://ui.perfetto.dev load,
so the runtime only has to record events here and `save()` them:

    tl = Timeline()
    t0 = time.monotonic_ns()
    ...
    tl.complete("iteration 7", "exec", "GraphRunner", t0, time.monotonic_ns() - t0)
    tl.instant("diverged", "fallback", "PythonRunner", args={"line": "train.py:12"})
    tl.save("terra_timeline.json")

Times are nanoseconds of the monotonic clock (`time.monotonic_ns()`, C++ `steady_clock` on
Linux), so durations measured in C++ and timestamps taken in Python line up. Recording appends a
tuple under a lock and nothing else; dicts and JSON are built only on export.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

# The kinds of events the runtime records; each becomes a colourable category in the viewer.
CATEGORIES: frozenset[str] = frozenset({"exec", "stall", "feed", "fetch", "decision", "fallback"})

PID = 1
# The two runners get fixed thread ids so that every saved timeline lays out the same way.
PYTHON_RUNNER = "PythonRunner"
GRAPH_RUNNER = "GraphRunner"
_FIXED_TIDS: dict[str, int] = {PYTHON_RUNNER: 1, GRAPH_RUNNER: 2}

# Kept events: enough for hours of per-iteration events, bounded so a long run cannot exhaust
# memory; the oldest events are dropped first.
DEFAULT_MAX_EVENTS = 1_000_000

# (phase, name, cat, tid, start_ns, dur_ns, args); phase is the trace-event "ph" letter.
_Event = tuple[str, str, str, int, int, int, Any]


class Timeline:
    """A thread-safe event recorder that exports Chrome trace-event JSON (Perfetto-loadable)."""

    def __init__(self, origin_ns: int | None = None, max_events: int | None = DEFAULT_MAX_EVENTS) -> None:
        # Timestamps are exported relative to this, so the viewer starts near zero.
        self.origin_ns = time.monotonic_ns() if origin_ns is None else origin_ns
        # maxlen makes dropping the oldest event free. One uncontended lock per event (~0.1 us)
        # keeps the dropped count exact and costs nothing next to what an event describes.
        self._events: collections.deque[_Event] = collections.deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._dropped = 0
        self._tids = dict(_FIXED_TIDS)

    # ---- recording --------------------------------------------------------------------------

    @staticmethod
    def now_ns() -> int:
        """The clock the timeline expects timestamps from."""
        return time.monotonic_ns()

    def complete(
        self,
        name: str,
        cat: str,
        tid_name: str,
        start_ns: int,
        dur_ns: int,
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """A span of `dur_ns` nanoseconds that began at `start_ns` on thread `tid_name`."""
        self._append(("X", name, _check(cat), self._tid(tid_name), start_ns, max(0, dur_ns), args))

    def instant(
        self,
        name: str,
        cat: str,
        tid_name: str,
        ts_ns: int | None = None,
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """A point in time (a decision posted, a fallback) on thread `tid_name`; default now."""
        ts = time.monotonic_ns() if ts_ns is None else ts_ns
        self._append(("i", name, _check(cat), self._tid(tid_name), ts, 0, args))

    def counter(
        self,
        name: str,
        values: Mapping[str, float],
        ts_ns: int | None = None,
        cat: str = "exec",
    ) -> None:
        """Sampled values (queue depths, bytes in flight), drawn as a stacked area per name."""
        ts = time.monotonic_ns() if ts_ns is None else ts_ns
        self._append(("C", name, _check(cat), 0, ts, 0, dict(values)))

    @contextmanager
    def span(self, name: str, cat: str, tid_name: str, args: Mapping[str, Any] | None = None) -> Iterator[None]:
        """Records the `with` body as a complete event, for code that is timed in Python."""
        start = time.monotonic_ns()
        try:
            yield
        finally:
            self.complete(name, cat, tid_name, start, time.monotonic_ns() - start, args)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
            self._dropped = 0

    def __len__(self) -> int:
        return len(self._events)

    @property
    def dropped(self) -> int:
        """Events recorded but no longer kept because `max_events` was reached."""
        return self._dropped

    # ---- export -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The trace as a JSON-ready dict: {"traceEvents": [...], "displayTimeUnit": "ms"}."""
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": PID, "tid": 0, "name": "process_name", "args": {"name": "terra_torch"}},
        ]
        with self._lock:
            tids = sorted(self._tids.items(), key=lambda kv: kv[1])
            recorded = list(self._events)
        for tid_name, tid in tids:
            events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": tid_name}})
            events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        for ph, name, cat, tid, start, dur, args in recorded:
            # Trace-event times are microseconds; floats keep the nanoseconds.
            event: dict[str, Any] = {"ph": ph, "name": name, "cat": cat, "pid": PID, "tid": tid,
                                     "ts": (start - self.origin_ns) / 1000.0}
            if ph == "X":
                event["dur"] = dur / 1000.0
            elif ph == "i":
                event["s"] = "t"  # scoped to its thread's track
            if args:
                event["args"] = dict(args)
            events.append(event)
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def to_json(self) -> str:
        # default=str: args may hold values the runtime did not stringify (paths, dtypes).
        return json.dumps(self.to_dict(), default=str)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON; open it in https://ui.perfetto.dev or chrome://tracing."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    # ---- internals --------------------------------------------------------------------------

    def _append(self, event: _Event) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self._dropped += 1
            self._events.append(event)

    def _tid(self, tid_name: str) -> int:
        tid = self._tids.get(tid_name)  # a dict read is safe without the lock
        if tid is None:
            with self._lock:
                tid = self._tids.setdefault(tid_name, max(self._tids.values()) + 1)
        return tid


def _check(cat: str) -> str:
    # A typo in a category would silently split a colour in the viewer; catch it at the source.
    if cat not in CATEGORIES:
        raise ValueError(f"terra_torch.chrome_trace: unknown category {cat!r}; expected one of {sorted(CATEGORIES)}")
    return cat
