"""Generate the TorchScript graph of recorded iterations and run it (docs/ARCHITECTURE.md).

    a = graph.record(step, x_pos)          # run eagerly, capture the trace
    b = graph.record(step, x_neg)          # another iteration, another path
    g = graph.build([a, b])                # TraceGraph -> case assignment -> TorchScript graph
    print(g)                               # prim::If on terra::case_select, terra::feed, ...
    out = g.run(a)                         # replay a's decisions and inputs in the interpreter
    assert torch.equal(out.outputs[0], a.outputs[0])

`record` marks every tensor in the function's result as read by Python (a `terra::fetch`
op recorded at the end of the region), so the generated graph delivers them; `.item()`,
`bool(t)` and other reads inside the function become fetches too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from terra_torch import _C, debug


@dataclass
class Recording:
    """One eagerly executed iteration and its captured trace."""

    result: Any
    region: Any  # _C.Region: owns the trace and keeps its external tensors alive
    outputs: list[torch.Tensor]  # tensors of `result`, in pytree order; output k is fetch tag k

    @property
    def trace(self) -> debug.Trace:
        return debug._trace_of(self.region)

    @property
    def externals(self) -> list[torch.Tensor]:
        """Tensors the iteration read but did not produce, indexed like the trace's externals."""
        return _C.emit.external_tensors(self.region)


def record(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Recording:
    """Run `fn(*args, **kwargs)` eagerly in a capture region (recording mode)."""
    region = _C.Region("record", sys._getframe(0))
    region.open()
    try:
        result = fn(*args, **kwargs)
        outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        for tag, t in enumerate(outputs):
            torch.ops.terra.fetch(tag, t)  # recorded: "Python reads t"; a no-op when it runs
    finally:
        region.close()
    return Recording(result, region, outputs)


@dataclass
class RunResult:
    outputs: list[torch.Tensor | None]  # per fetch tag (the recording's outputs), last value
    reads: list[torch.Tensor]  # tensors read inside the function (.item(), bool()), in order
    fetched: list[tuple[int, torch.Tensor]] = field(repr=False)  # (fetch slot, value), in order


class Graph:
    """The TorchScript graph generated from a list of recordings."""

    def __init__(self, recordings: Sequence[Recording], optimize: bool = True) -> None:
        builder = _C.emit.Builder()
        self._index = {id(r): builder.add(r.region) for r in recordings}
        self._recordings = list(recordings)  # keeps ids in _index meaningful
        self._graph = builder.build(optimize)
        self._fetch_table = self._graph.fetches

    @property
    def text(self) -> str:
        return self._graph.text

    def __str__(self) -> str:
        return self._graph.text

    @property
    def stats(self) -> dict[str, float]:
        """Emitted op/switch/loop counts, node count after the passes, and timings in ms."""
        return self._graph.stats

    @property
    def feeds(self) -> list[tuple[int, int, bool, bool]]:
        """Per feed slot: (TraceGraph node, input slot, whether Python may send none, whether
        the graph may write the fed memory, directly or through a view)."""
        return self._graph.feeds

    @property
    def fetches(self) -> list[tuple[int, int, int]]:
        """Per fetch slot: (TraceGraph node, input slot, tag: output index or -1)."""
        return self._fetch_table

    def decisions(self, recording: Recording) -> list[tuple[int, int]]:
        """The (site, value) decisions the recording's path sends to the graph."""
        return self._graph.decisions(self._index[id(recording)])

    def describe(self) -> str:
        return self._graph.describe_tracegraph() + "\n" + self._graph.describe_program()

    def run(
        self,
        recording: Recording,
        externals: Sequence[torch.Tensor] | None = None,
        mode: str = "interpreter",
    ) -> RunResult:
        """Execute the graph on `recording`'s path with its external tensors (or `externals`,
        indexed like `recording.externals`, e.g. clones taken before an in-place update).
        `mode`: "interpreter" (Code + InterpreterState), "graph_executor" (profiling) or "fused"
        (straight-line stretches run compiled once compile_segments() compiled them and their
        first compiled run matched the interpreter: within a tolerance of eager, not bitwise)."""
        index = self._index[id(recording)]
        fetched = self._graph.run(index, None if externals is None else list(externals), mode)
        outputs: list[torch.Tensor | None] = [None] * len(recording.outputs)
        reads = []
        for slot, value in fetched:
            tag = self._fetch_table[slot][2]
            if tag >= 0:
                outputs[tag] = value
            else:
                reads.append(value)
        return RunResult(outputs, reads, fetched)


    def compile_segments(self, wait_s: float = 0.0) -> list[dict[str, Any]]:
        """Compile (AOTInductor, terra_torch/_fused.py) every segment that runs with
        mode="fused" have requested so far, waiting up to `wait_s` for each further request;
        returns the segments' report (ops, state, reason, compiled and interpreted runs)."""
        from terra_torch import _fused

        while _fused.compile_one(self._graph.fused, wait_s):
            pass
        return self.segments

    @property
    def segments(self) -> list[dict[str, Any]]:
        """Per segment of mode "fused": ops, state (new, requested, compiling, loaded, trusted,
        interpreted), reason (why interpreted), compiled_runs, interpreted_runs, max_difference,
        the speed trial's compiled_us and interpreted_us, first_run_us (the first run, which
        decides whether it is worth compiling: FusedExecutor::min_segment_us), package (the
        path of its compiled package, "" before it has one), and inlined (its
        ops run in place, uncalled: waiting for the compiler, or interpreted for good)."""
        return list(self._graph.fused.report())


def build(recordings: Sequence[Recording], optimize: bool = True) -> Graph:
    """Merge the recordings' traces and generate their graph."""
    return Graph(recordings, optimize)
