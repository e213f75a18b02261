"""`torch.compile(model, backend="terra")`: Dynamo's graphs run through terra_torch (issue 6).

Why this exists: users who already call `torch.compile` should get terra_torch by naming a
backend, without rewriting their loop around `terra_torch.wrap`. Dynamo hands the backend one FX
graph per region between graph breaks; AOTAutograd splits each into a forward and a backward
graph (or one inference graph), and each of those runs in one of three modes:

* "graph" (default): the graph is static (Dynamo's guards promise the same FX graph on every
  call), so its first call is recorded through terra's pipeline and later calls feed their
  inputs straight to the generated TorchScript graph, with no per-op Python (`_direct.py`).
  With `overlap=True`, calls of graphs without side effects return before the graph has run
  and the first op that follows waits for it;
* "coexec" / "lazy": every call is one co-executed iteration of a `runtime.Program`: each op
  validates itself and returns a placeholder while terra's worker thread runs the generated
  graph. Mode "graph" also falls back to this for a graph it cannot run directly.

Every tensor Dynamo, AOTAutograd or the user's code sees between two graphs is an ordinary
tensor. Keeping a co-executed iteration open until the next graph call (terra_torch.function's
rule) made every frame recompile: Dynamo's tensor guards compare dispatch key sets, which
include the thread's included keys (terra's interception key while a region is open) and a
placeholder's own keys, and the recompile then fake-ifies a placeholder. docs/DYNAMO_BACKEND.md
has the design, the measurements and the reproductions.

Registered with Dynamo through the `torch_dynamo_backends` entry point (pyproject.toml), so
`backend="terra"` works without importing terra_torch first.
"""

from __future__ import annotations

import logging
import operator
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch._dynamo

from terra_torch import _C, _direct, runtime

logger = logging.getLogger("terra_torch")

# Dynamo must treat terra_torch's Python as opaque. terra_torch replaces Tensor.numpy (and other
# data reads) with Python wrappers (_materialize.py). Traced into, they graph-break on terra's C++
# calls and leave resume functions inside terra_torch; and when Dynamo had already run before
# terra_torch was imported, the code it generates for a `.numpy()` call enters the wrapper,
# which Dynamo compiles into another `.numpy()` call: unbounded recursion (a reproduction is in
# docs/DYNAMO_BACKEND.md). Skipped, `.numpy()` in compiled code is a plain graph break.
try:
    torch._dynamo.trace_rules.add("terra_torch")
except Exception as _e:  # noqa: BLE001 - a private Dynamo API: the backend still works without it
    logger.warning("terra backend: cannot keep Dynamo out of terra_torch's code (%s); "
                   "a `.numpy()` inside a compiled function may recurse", _e)

# The options `torch.compile(..., backend="terra", options={...})` accepts, with their defaults.
# Kept explicit (not **kwargs passed through) so that a misspelt option fails at compile time
# instead of silently doing nothing.
OPTION_DEFAULTS: dict[str, Any] = {"mode": "graph", "optimize": False, "overlap": False}
MODES = ("graph", "coexec", "lazy")


class TerraBackendOptionError(ValueError):
    """An option `backend="terra"` does not know, or a value it cannot take."""


@dataclass(frozen=True)
class TerraOptions:
    """What the backend was asked for.

    mode: "graph" (each call feeds its inputs straight to the generated graph on terra's worker,
        no per-op Python), "coexec" (the graph runs on the worker while Python validates each
        op) or "lazy" (co-execution whose graph runs only when Python needs a value).
    optimize: True runs TorchScript's optimization passes on the generated graph; "fused"
        compiles its straight-line segments with AOTInductor in the background (results within
        a tolerance of eager, docs/RUNTIME.md "Compiled segments"; mode "graph" compiles each
        Dynamo graph as one segment where its ops allow, "coexec"/"lazy" as wrap() does).
    overlap: mode "graph": a call of a graph without side effects returns before its graph has
        run; the first op of the program that follows waits for it. Off by default: in every
        program measured the next op came too soon to hide the hand-off to the worker thread
        (docs/DYNAMO_BACKEND.md, "Overlap").
    """

    mode: str = "graph"
    optimize: bool | str = False
    overlap: bool = False


def parse_options(kwargs: Mapping[str, Any]) -> TerraOptions:
    """Turn what Dynamo passes the backend into TerraOptions, rejecting anything unknown.

    torch.compile passes `options={...}` as the keyword `options`, and its own `mode=` (which
    it forbids together with options) as the keyword `mode`; a direct call of terra_backend may
    also give the options as keywords. All three spellings are accepted; a conflict is an error.
    """
    merged: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "options":
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise TerraBackendOptionError(
                    f"terra backend: options must be a dict, got {type(value).__name__}")
            items = list(value.items())
        else:
            items = [(key, value)]
        for name, v in items:
            if name in merged and merged[name] != v:
                raise TerraBackendOptionError(f"terra backend: option {name!r} given twice ({merged[name]!r}, {v!r})")
            merged[name] = v
    unknown = sorted(set(merged) - set(OPTION_DEFAULTS))
    if unknown:
        raise TerraBackendOptionError(
            f"terra backend: unknown option(s) {', '.join(map(repr, unknown))}; allowed options: "
            f"mode ({' | '.join(map(repr, MODES))}, default {OPTION_DEFAULTS['mode']!r}), "
            f"optimize (bool or 'fused', default {OPTION_DEFAULTS['optimize']!r}), "
            f"overlap (bool, default {OPTION_DEFAULTS['overlap']!r})")
    mode = merged.get("mode", OPTION_DEFAULTS["mode"])
    if mode not in MODES:
        raise TerraBackendOptionError(
            f"terra backend: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r} "
            f"(torch.compile's own modes such as 'max-autotune' are Inductor's)")
    flags = {name: merged.get(name, OPTION_DEFAULTS[name]) for name in ("optimize", "overlap")}
    for name, value in flags.items():
        if name == "optimize" and value == "fused":
            continue
        if not isinstance(value, bool):
            kinds = "a bool or 'fused'" if name == "optimize" else "a bool"
            raise TerraBackendOptionError(f"terra backend: {name} must be {kinds}, got {value!r}")
    return TerraOptions(mode=mode, **flags)


@dataclass
class CompiledGraph:
    """One graph the backend compiled: an AOTAutograd forward, backward or inference graph."""

    name: str
    kind: str  # "forward" | "backward" | "inference"
    dynamo_graph: int  # which Dynamo graph (backend call) it came from
    num_ops: int  # call_function nodes in the FX graph
    program: runtime.Program | None  # co-execution (modes coexec and lazy, graph's fallback)
    options: TerraOptions = field(default_factory=TerraOptions)
    # Set when the graph cannot be co-executed: every call runs the graph module eagerly.
    eager_reason: str | None = None
    # Mode "graph": one generated graph per input signature (_direct.signature), and why the
    # graph cannot run directly if it cannot (it is then co-executed).
    direct: dict[Any, _direct.DirectGraph] = field(default_factory=dict)
    direct_reason: str | None = None
    direct_offsets: bool = False  # signatures include storage offsets (the graph has as_strided)
    direct_calls: int = 0  # calls that ran the generated graph directly
    traced_calls: int = 0  # calls recorded to generate a graph (they ran eagerly)
    deferred_calls: int = 0  # direct calls that returned before their graph ran (overlap)
    closed: bool = False
    # Graphs with side effects Python could observe besides their outputs (in-place updates,
    # random draws) end each call with a full Program.synchronize().
    full_sync: bool = True
    calls: int = 0
    sync_s: float = 0.0  # time Python waited for the graph in calls (direct: the whole run)
    eager_calls: int = 0  # calls that ran the graph module eagerly, see eager_reasons
    eager_reasons: list[str] = field(default_factory=list)

    def stats(self) -> runtime.Stats | None:
        return None if self.program is None else self.program.stats()

    def start_coexec(self, gm: torch.fx.GraphModule) -> None:
        """Hand the graph to co-execution from now on (mode "graph" when it cannot run directly)."""
        self.eager_reason = _eager_reason(gm)
        if self.eager_reason is not None:
            logger.warning("terra backend: %s runs eagerly: %s", self.name, self.eager_reason)
        elif self.program is None:
            self.program = runtime.Program(self.name, "coexec", self.options.optimize)

    def close(self) -> None:
        """Stop the graph's workers: its program's and its direct graphs'."""
        self.closed = True
        direct, self.direct = list(self.direct.values()), {}
        for graph in direct:
            graph.close()
        if self.program is not None:
            program, self.program = self.program, None
            program.close()

    @property
    def _terra_program(self) -> runtime.Program | None:  # terra_torch.stats(graph) works too
        return self.program


_registry_lock = threading.Lock()
_graphs: list[CompiledGraph] = []
_num_dynamo_graphs = 0


def graphs() -> list[CompiledGraph]:
    """Every graph compiled since the last reset, in compilation order."""
    with _registry_lock:
        return list(_graphs)


def num_dynamo_graphs() -> int:
    """How many graphs Dynamo has handed this backend since the last reset."""
    with _registry_lock:
        return _num_dynamo_graphs


def reset() -> None:
    """Stop every program the backend made and forget them. torch._dynamo.reset() calls this
    (it resets every backend that has a `reset`), since it drops the compiled code that would
    have called them; a graph called after this (an autograd graph kept across the reset) runs
    eagerly."""
    global _num_dynamo_graphs
    with _registry_lock:
        old = list(_graphs)
        _graphs.clear()
        _num_dynamo_graphs = 0
    for g in old:
        try:
            g.close()
        except Exception as e:  # noqa: BLE001 - one broken program must not keep the others running
            logger.warning("terra backend: closing %s failed: %s", g.name, e)


class _GraphCall:
    """The callable AOTAutograd gets for one graph (boxed calling convention: one list argument,
    which the callee may empty so that inputs die as early as possible)."""

    def __init__(self, gm: torch.fx.GraphModule, record: CompiledGraph) -> None:
        # An instance attribute, not a class one: AOTAutograd wraps the backward callable in
        # torch._dynamo.disable, whose functools.wraps copies only the instance's __dict__.
        self._boxed_call = True
        self._gm = gm
        self._record = record
        self._warned: set[str] = set()

    @property
    def _terra_program(self) -> runtime.Program | None:  # lets terra_torch.stats(call) work
        return self._record.program

    def __call__(self, args: list[Any]) -> Any:
        flat = list(args)
        args.clear()
        record = self._record
        record.calls += 1
        if record.eager_reason is not None:
            return self._eager(flat, record.eager_reason)
        if record.closed:
            return self._eager(flat, "its program was closed by reset()")
        outer = runtime.active()
        if outer is not None and outer is not record.program:
            # The user co-executes the surrounding loop with terra_torch.wrap/function: the open
            # iteration records this graph's ops as its own, which is what that program expects.
            return self._eager(flat, f"it runs inside {outer.name}'s open iteration")
        if record.options.mode == "graph" and record.direct_reason is None:
            return self._direct(flat)
        return self._coexec(flat)

    def _direct(self, flat: list[Any]) -> Any:
        """Mode "graph": the generated graph runs in the TorchScript interpreter on this thread
        with the call's inputs, no per-op Python; with overlap, graphs without side effects are
        queued on the deferred worker instead (terra_torch/_direct.py)."""
        record = self._record
        why_not = _direct_refusal(flat)
        if why_not is not None:
            return self._eager(flat, why_not)
        if _C.runtime.direct_failed():
            _C.runtime.wait_direct()  # raises what a deferred graph raised
        key = _direct.signature(flat, record.direct_offsets)
        graph = record.direct.get(key)
        if graph is None:
            return self._record_direct(flat, key)
        t0 = time.perf_counter()
        out = graph.run(flat)
        record.sync_s += time.perf_counter() - t0
        record.direct_calls += 1
        if graph.deferred is not None:
            record.deferred_calls += 1
        return out

    def _record_direct(self, flat: list[Any], key: _direct.Signature) -> Any:
        """A new input signature: this call runs eagerly while terra records its graph."""
        record = self._record
        if len(record.direct) >= _direct.MAX_SIGNATURES:
            return self._eager(flat, f"more than {_direct.MAX_SIGNATURES} input signatures "
                                     "(sizes, strides, scalar inputs) were seen")
        may_defer = record.options.overlap and not record.full_sync
        result, graph, problem = _direct.record_and_build(self._gm, flat, record.options.optimize, may_defer)
        record.traced_calls += 1
        if graph is not None:
            if graph.uses_offsets and not record.direct_offsets:
                record.direct_offsets = True  # keys made so far lack offsets: start over
                record.direct.clear()
                key = _direct.signature(flat, True)
            record.direct[key] = graph
            logger.debug("terra backend: %s: graph generated for signature %d", record.name, len(record.direct))
        else:
            record.direct_reason = problem
            logger.info("terra backend: %s cannot run its graph directly (%s); co-executing it instead",
                        record.name, problem)
            record.start_coexec(self._gm)
        return result

    def _coexec(self, flat: list[Any]) -> Any:
        """Modes "coexec" and "lazy" (and "graph" where a graph cannot run directly): each call
        is one co-executed iteration of the graph's runtime.Program."""
        record = self._record
        program = record.program
        if record.eager_reason is not None:
            return self._eager(flat, record.eager_reason)
        assert program is not None
        # The stop frame is this frame, so op locations are those of the graph module's code
        # alone, whichever Dynamo/AOTAutograd wrappers called it (they differ on the first call).
        phase, fallbacks = program.phase, len(program.fallbacks)
        program.begin(sys._getframe())
        try:
            out = self._gm(*flat)
        except BaseException:
            program.synchronize()  # ends the iteration as partial: it taught nothing
            raise
        program.end()
        # Values leave the program as real tensors: Dynamo's guards and AOTAutograd's wrappers
        # look at what this returns, and they must not see a placeholder (see the module doc).
        t0 = time.perf_counter()
        clean_coexec = phase == "coexec" and program.phase == "coexec" and len(program.fallbacks) == fallbacks
        if clean_coexec and not record.full_sync:
            # Only the outputs escape the call, so only they need values; Program.synchronize
            # would also refresh every other value the runtime still tracks and wait for the
            # graph's whole iteration, which nothing outside the call can observe here.
            for leaf in torch.utils._pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    program.materialize(leaf)
        else:
            program.synchronize()
        record.sync_s += time.perf_counter() - t0
        return out

    def _eager(self, flat: list[Any], reason: str) -> Any:
        self._record.eager_calls += 1
        if reason not in self._warned:
            self._warned.add(reason)
            self._record.eager_reasons.append(reason)
            logger.info("terra backend: %s runs eagerly: %s", self._record.name, reason)
        return self._gm(*flat)


def _direct_refusal(flat: list[Any]) -> str | None:
    """Why this call cannot run on the worker, or None. The worker runs with grad mode off and
    no autocast (docs/RUNTIME.md, "Threading"); AOTAutograd calls its compiled graphs with grad
    mode off, so these only catch graphs called some other way."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat):
        return "it was called with grad mode on and inputs that require grad"
    if torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu"):
        return "it was called with autocast enabled"
    return None


def _eager_reason(gm: torch.fx.GraphModule) -> str | None:
    """Why this graph must run eagerly, or None if it can be co-executed."""
    outputs = torch.utils._pytree.tree_leaves(gm.graph.output_node().args)
    for k, node in enumerate(outputs):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        # The runtime gives a placeholder its value by copying into memory laid out as the
        # placeholder says; a layout where several elements share one location (expand's
        # stride 0) refuses that copy (docs/DYNAMO_BACKEND.md, "Runtime issues").
        overlapping = any(st == 0 and sz > 1 for sz, st in zip(val.shape, val.stride()))
        if overlapping or torch._debug_has_internal_overlap(val) == 1:
            return (f"output {k} ({node.name}, sizes {tuple(val.shape)}, strides {tuple(val.stride())}) "
                    f"has elements sharing memory, which a placeholder cannot be given yet")
    return None


def _has_side_effects(gm: torch.fx.GraphModule) -> bool:
    """True if a call of `gm` may do more than compute its outputs: an op that mutates an
    argument, draws random numbers, or anything that is not a plain aten op (conservatively)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return True
        if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
            return True
    return False


def _graph_compiler(kind: str, dynamo_graph: int, options: TerraOptions) -> Callable[..., Any]:
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> _GraphCall:
        num_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        name = f"dynamo{dynamo_graph}.{kind}"
        record = CompiledGraph(name, kind, dynamo_graph, num_ops, None, options, full_sync=_has_side_effects(gm))
        if options.mode != "graph":
            # Direct runs have no placeholders to materialize, so _eager_reason does not apply.
            record.eager_reason = _eager_reason(gm)
            if record.eager_reason:
                logger.warning("terra backend: %s runs eagerly: %s", name, record.eager_reason)
            else:
                record.program = runtime.Program(name, options.mode, options.optimize)
        with _registry_lock:
            _graphs.append(record)
        logger.debug("terra backend: %s: %d ops, mode %s", name, num_ops, options.mode)
        return _GraphCall(gm, record)

    return compile_graph


def terra_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable[..., Any]:
    """The Dynamo backend: `torch.compile(model, backend="terra", options={"mode": "lazy"})`.

    Dynamo calls it once per graph between graph breaks. AOTAutograd (no decompositions, so the
    aten ops are eager's and the results match eager bitwise) makes the forward/backward or
    inference graphs, and each runs in the selected mode (see the module doc).
    """
    opts = parse_options(options)
    from torch._dynamo.backends.common import aot_autograd

    global _num_dynamo_graphs
    with _registry_lock:
        dynamo_graph = _num_dynamo_graphs
        _num_dynamo_graphs += 1
    torch._dynamo.utils.counters["terra"]["dynamo_graphs"] += 1
    compiler = aot_autograd(
        fw_compiler=_graph_compiler("forward", dynamo_graph, opts),
        bw_compiler=_graph_compiler("backward", dynamo_graph, opts),
        inference_compiler=_graph_compiler("inference", dynamo_graph, opts),
    )
    return compiler(gm, example_inputs)


# torch._dynamo.reset() calls `reset` on every backend it has cached.
terra_backend.reset = reset  # type: ignore[attr-defined]
