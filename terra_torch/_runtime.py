"""Drive the co-execution GraphRunner from Python (docs/RUNTIME.md).

Until the PythonRunner derives decisions, feeds and fetches from the Cursor while the user's
program runs, a recorded iteration stands in for it: its script says what the Python side posts
(decisions, external tensors) and which fetches it waits for.

    plan = _runtime.Plan([rec_a, rec_b])          # same graph as terra_torch.graph.build
    with plan.runner() as runner:                 # a C++ worker thread + its channel
        out = _runtime.run_iteration(runner, plan.script(rec_a))
        assert torch.equal(out.outputs[0], rec_a.outputs[0])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from terra_torch import _C
from terra_torch.graph import Recording, RunResult


@dataclass
class Script:
    """What one iteration sends and receives, in program order."""

    decisions: list[tuple[int, int]]  # (site, case index or 1 = loop again / 0 = exit)
    feeds: list[tuple[int, torch.Tensor | None]]  # (slot, tensor); None: the graph's own value
    fetches: list[tuple[int, int]]  # (slot, tag: output index or -1 for a read inside fn)
    num_outputs: int
    # Python numbers fed per execution (terra::feed_scalar, feed_int): (channel key, value),
    # posted as decisions in this order.
    scalars: list[tuple[int, int]] = field(default_factory=list)


class Plan:
    """The graph of some recordings, and the script of each (see _C.runtime.Plan)."""

    def __init__(self, recordings: Sequence[Recording], optimize: bool = True) -> None:
        self._recordings = list(recordings)  # keeps the ids below meaningful
        self._index = {id(r): i for i, r in enumerate(self._recordings)}
        self._plan = _C.runtime.Plan([r.region for r in self._recordings], optimize)

    @property
    def text(self) -> str:
        return self._plan.text

    @property
    def graph(self) -> torch._C.Graph:
        return self._plan.graph

    @property
    def sites(self) -> list[str]:
        return self._plan.sites

    def script(self, recording: Recording, externals: Sequence[torch.Tensor] | None = None) -> Script:
        """`externals` replaces the recording's external tensors (same order as
        `recording.externals`), e.g. the runner's own copies of parameters."""
        decisions, feeds, fetches, scalars = self._plan.script(
            self._index[id(recording)], None if externals is None else list(externals))
        return Script(decisions, feeds, fetches, len(recording.outputs), scalars)

    def runner(self, mode: str = "interpreter", channel: _C.runtime.Channel | None = None):
        return _C.runtime.GraphRunner(self._plan, channel, mode)


def post(channel: _C.runtime.Channel, script: Script) -> None:
    """Send an iteration's decisions and feeds; never blocks."""
    for site, value in script.decisions:
        channel.post_decision(site, value)
    for key, value in script.scalars:
        channel.post_decision(key, value)
    for slot, tensor in script.feeds:
        channel.post_feed(slot, tensor)


def collect(channel: _C.runtime.Channel, script: Script, timeout: float | None = None) -> RunResult:
    """Wait for every fetch of the iteration (GIL released while waiting)."""
    outputs: list[torch.Tensor | None] = [None] * script.num_outputs
    reads, fetched = [], []
    for slot, tag in script.fetches:
        value = channel.wait_fetch(slot, timeout)
        fetched.append((slot, value))
        if tag >= 0:
            outputs[tag] = value
        else:
            reads.append(value)
    return RunResult(outputs, reads, fetched)


def run_iteration(runner: _C.runtime.GraphRunner, script: Script, timeout: float | None = None) -> RunResult:
    """One iteration: start it, post, collect the fetches, wait for the end (re-raising its error)."""
    runner.start_iteration()
    post(runner.channel, script)
    result = collect(runner.channel, script, timeout)
    runner.wait_iteration(timeout)
    return result
