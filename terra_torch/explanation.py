"""What terra_torch made of a program, in one object a user can print or draw (issue 8).

After a few iterations a user wants to know: how many paths were recorded, which branches and
loops the graph has, which phase the model is in, and where (and why) it fell back to eager.
`Explanation` gathers that as plain data; `str()` is a readable summary, `to_dot()` /
`save_png()` draw the TraceGraph with its switches, merges and loops (csrc/trace/dot.h).

The runtime builds one with `explanation_from(...)` from what it holds; the public
`terra_torch.explain(obj)` entry point belongs to the runtime, which knows the wrapped model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from terra_torch import graph as graph_mod

# How many fallback sites __str__ lists before summarising the rest: a summary is for reading.
_LISTED_SITES = 10


@dataclass(frozen=True)
class Fallback:
    """One divergence: in `iteration` the program left the graph at `source_line` ("file:line",
    None when unknown) for `reason`, and that iteration finished eagerly."""

    iteration: int
    reason: str
    source_line: str | None = None
    op: str | None = None  # the operator it left the graph at ("aten::select.int"), when known


@dataclass
class Explanation:
    """A snapshot of what terra_torch knows about one wrapped program."""

    nodes: int = 0     # TraceGraph nodes (ops, loops, and each (sub)graph's start and end)
    switches: int = 0  # branches: switch-case constructs in the generated program
    loops: int = 0     # loops folded by the TraceGraph, unrolled ones included
    unrolled_loops: int = 0
    graph_text: str | None = None  # the generated TorchScript graph
    phases: dict[str, Any] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    # A program that did not converge and runs eagerly for a while (runtime.MAX_UNCONVERGED_
    # ITERATIONS): {"op", "line", "how", "iterations", "eager_for"}; None otherwise.
    not_converged: dict[str, Any] | None = None
    eager_reason: str = ""  # why the program last moved to phase "eager"
    # optimize="fused": per compiled segment of the current graph, its report (ops, state, inlined,
    # reason, compiled_runs, interpreted_runs, max_difference); None otherwise.
    segments: list[dict[str, Any]] | None = None
    # Calls co-execution runs without their Python (docs/RUNTIME.md): {"backward": ..., "calls":
    # ...}, each {"replayed", "recorded", "per_op", "reason"} (reason: why the last one that was
    # not replayed was not); empty before co-execution.
    replays: dict[str, dict[str, Any]] = field(default_factory=dict)
    outside_ops: int = 0  # ops run outside the program, unrecorded (csrc/capture/outside_program.h)
    # The _C.emit.Graph the picture is drawn from; None before any graph was built.
    _graph: Any = field(default=None, repr=False, compare=False)

    @property
    def has_graph(self) -> bool:
        return self._graph is not None

    def to_dot(self) -> str:
        """Graphviz DOT of the TraceGraph: ops with source lines, switches with their cases,
        merges, loops as clusters. Without a graph, a one-node picture saying so."""
        if self._graph is None:
            return 'digraph terra {\n  empty [shape=plaintext, label="terra_torch: no graph built yet"];\n}\n'
        return self._graph.to_dot(self._title())

    def save_png(self, path: str | os.PathLike[str]) -> None:
        """Render `to_dot()` with Graphviz's `dot -Tpng` into `path`."""
        dot = shutil.which("dot")
        if dot is None:
            raise RuntimeError(
                "terra_torch: Graphviz's `dot` program is not on PATH, so the graph cannot be "
                "rendered; install Graphviz (Debian/Ubuntu: apt-get install graphviz, macOS: brew "
                "install graphviz), or write Explanation.to_dot() to a .dot file and render it "
                "elsewhere (e.g. https://dreampuf.github.io/GraphvizOnline)"
            )
        done = subprocess.run([dot, "-Tpng", "-o", os.fspath(path)], input=self.to_dot(),
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"terra_torch: `dot -Tpng` failed ({done.returncode}): {done.stderr.strip()}")

    def __str__(self) -> str:
        out = ["terra_torch explanation"]
        if self._graph is None and self.graph_text is None:
            out.append("  no graph built yet")
        else:
            loops = f"{_plural(self.loops, 'loop')}"
            if self.unrolled_loops:
                loops += f" ({self.unrolled_loops} unrolled)"
            out.append(f"  TraceGraph: {_plural(self.nodes, 'node')}, {_plural(self.switches, 'switch')}, {loops}")
        if self.graph_text is not None:
            out.append(f"  TorchScript graph: {len(self.graph_text.splitlines())} lines")
        if self.phases:
            out.append("  phases: " + ", ".join(f"{k}={v}" for k, v in self.phases.items()))
        if self.not_converged:
            nc = self.not_converged
            out.append(f"  not converged after {nc['iterations']} iterations: {nc['op']} at {nc['line']} keeps "
                       f"differing ({nc['how']}); eager for {nc['eager_for']} iterations, then traced again")
        elif self.eager_reason:
            out.append(f"  eager: {self.eager_reason}")
        if self.segments is not None:
            trusted = [s for s in self.segments if s["state"] == "trusted"]
            out.append(f"  compiled segments: {len(trusted)} of {len(self.segments)} run compiled "
                       f"({sum(s['ops'] for s in trusted)} of {sum(s['ops'] for s in self.segments)} ops)")
            waiting = [s for s in self.segments if s["state"] in ("requested", "compiling")]
            if waiting:
                out.append(f"    {_plural(len(waiting), 'segment')} waiting for the compiler, run in place meanwhile")
            # (one line for all that are too small to compile: a long loop body has dozens)
            def too_small(s: dict[str, Any]) -> bool:
                return s["state"] == "interpreted" and "TERRA_FUSED_MIN_SEGMENT_US" in s["reason"]

            small = [s for s in self.segments if too_small(s)]
            if small:
                out.append(f"    {_plural(len(small), 'segment')} ({sum(s['ops'] for s in small)} ops) not compiled: "
                           f"each ran in under {max(s['first_run_us'] for s in small):.3g} us, less than a "
                           "compiled call costs (TERRA_FUSED_MIN_SEGMENT_US)")
            for k, s in enumerate(self.segments):
                if s["state"] == "interpreted" and not too_small(s):
                    where = ", in place" if s.get("inlined") else ""
                    out.append(f"    segment {k} ({s['ops']} ops{where}) stays interpreted: {s['reason']}")
        for what, label in (("backward", "backward()"), ("calls", "optimizer steps and clip_grad_norm_")):
            r = self.replays.get(what)
            if r and (r["replayed"] or r["recorded"] or r["per_op"]):
                line = (f"  {label} without Python: {r['replayed']} replayed, {r['recorded']} recorded, "
                        f"{r['per_op']} op by op")
                out.append(line + (f" (last: {r['reason']})" if r["reason"] else ""))
        if self.outside_ops:
            out.append(f"  ops outside the program (a DataLoader's batches, outside_program() blocks): "
                       f"{self.outside_ops}, run where Python issued them")
        out.append(f"  fallbacks: {len(self.fallbacks)}")
        # Grouped by line: a site that falls back every iteration is one line to fix, not many.
        sites: dict[str | None, list[Fallback]] = {}
        for fb in self.fallbacks:
            sites.setdefault(fb.source_line, []).append(fb)
        ranked = sorted(sites.items(), key=lambda kv: -len(kv[1]))
        for line, fbs in ranked[:_LISTED_SITES]:
            its = ", ".join(str(fb.iteration) for fb in fbs[:5]) + (", ..." if len(fbs) > 5 else "")
            out.append(f"    {line or 'unknown line'}: {_plural(len(fbs), 'time')} "
                       f"(iteration {its}): {fbs[-1].reason}")
        if len(ranked) > _LISTED_SITES:
            out.append(f"    ... and {len(ranked) - _LISTED_SITES} more lines")
        return "\n".join(out)

    def _title(self) -> str:
        return (f"terra_torch TraceGraph: {_plural(self.nodes, 'node')}, {_plural(self.switches, 'switch')}, "
                f"{_plural(self.loops, 'loop')}, {_plural(len(self.fallbacks), 'fallback')}")


def explanation_from(
    graph: graph_mod.Graph | Any | None,
    phases: dict[str, Any],
    fallbacks: Iterable[Fallback | Sequence[Any]],
    graph_text: str | None = None,
    not_converged: dict[str, Any] | None = None,
    eager_reason: str = "",
    segments: list[dict[str, Any]] | None = None,
    runner: dict[str, Any] | None = None,
) -> Explanation:
    """Build an Explanation from what the runtime holds.

    `graph`: a terra_torch.graph.Graph, a _C.emit.Graph, or None. `fallbacks`: Fallback objects
    or (iteration, reason, source_line) tuples. `graph_text` defaults to the graph's own text
    (pass it when the runtime runs a different, e.g. co-execution, graph). `runner`: the
    runtime's counters (Stats.runner), for the replays."""
    # graph.Graph keeps its _C.emit.Graph private; this module is its package sibling.
    native = getattr(graph, "_graph", graph)
    counts: dict[str, Any] = native.structure if native is not None else {}
    return Explanation(
        nodes=int(counts.get("nodes", 0)),
        switches=int(counts.get("switches", 0)),
        loops=int(counts.get("loops", 0)),
        unrolled_loops=int(counts.get("unrolled_loops", 0)),
        graph_text=graph_text if graph_text is not None or native is None else native.text,
        phases=dict(phases),
        fallbacks=[fb if isinstance(fb, Fallback) else Fallback(*fb) for fb in fallbacks],
        not_converged=dict(not_converged) if not_converged else None,
        eager_reason=eager_reason,
        segments=segments,
        replays={what: {k: runner.get(f"{what}_{k}", 0 if k != "reason" else "")
                        for k in ("replayed", "recorded", "per_op", "reason")}
                 for what in ("backward", "calls") if runner and f"{what}_replayed" in runner},
        outside_ops=int(runner.get("outside_ops", 0)) if runner else 0,
        _graph=native,
    )


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"1 {word}"
    return f"{n} {word}es" if word.endswith(("s", "sh", "ch", "x")) else f"{n} {word}s"
