"""Direct execution of a static graph (issue 6, `backend="terra"`, mode "graph").

Why this exists: a graph handed to a Dynamo backend is static. Dynamo's guards already promise
that the same FX graph runs on every call, and it holds no Python control flow, so validating
each of its ops against a TraceGraph (co-execution) buys nothing. Here one call is recorded
through terra's pipeline (capture region -> TraceGraph -> generated TorchScript graph, the same
emitter co-execution uses); the graph's feed slots become graph inputs and its fetches graph
outputs (`_C.runtime.DirectGraph`), and every later call hands the inputs to the TorchScript
interpreter and gets the outputs back: no per-op Python, no channel, no copies.

What the recording fixes, and what therefore keys the generated graph (`signature`): sizes,
strides and storage offsets of the tensor inputs and the values of the non-tensor inputs (the
ints a dynamic-shape graph takes for its symbolic sizes). The trace bakes them into op
attributes (view sizes, expand sizes), so a call with another signature records again, up to
MAX_SIGNATURES graphs per FX graph; calls beyond that run the graph module eagerly.

Outputs leave the interpreter by reference: an output that is an input, a view of one, or a
view of the same intermediate as another output aliases exactly what it aliased in eager mode,
which AOTAutograd's wrappers rely on. Anything the graph cannot express this way raises
DirectUnavailable at build time, and the caller co-executes that graph instead.
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from terra_torch import _C, _fused

logger = logging.getLogger("terra_torch")

MAX_SIGNATURES = 4
# The channel ops that become graph inputs and outputs. Any other terra:: op (a branch decision,
# a scalar fed per iteration) needs a channel, which a direct call does not have.
_SERVED_OPS = frozenset({"feed", "feed_or_none", "fetch"})

Signature = tuple[Any, ...]


class DirectUnavailable(Exception):
    """The graph cannot run directly; the message says why (the caller co-executes it)."""


def signature(flat: Sequence[Any], with_offsets: bool = False) -> Signature:
    """What the recorded trace baked in about the inputs (see the module doc). Dtypes and
    devices are left to Dynamo's guards, which check them on every frame input. Storage offsets
    reach an op attribute only through as_strided (AOTAutograd regenerates aliases with it), so
    only graphs that contain one pay for them (`with_offsets`)."""
    if with_offsets:
        return tuple([(a.shape, a.stride(), a.storage_offset()) if isinstance(a, torch.Tensor) else (type(a), a)
                      for a in flat])
    return tuple([(a.shape, a.stride()) if isinstance(a, torch.Tensor) else (type(a), a) for a in flat])


@dataclass(frozen=True)
class _Output:
    """Where one output of a direct call comes from: the graph's result `index`, or (non-tensor
    outputs, the sizes a dynamic forward graph hands its backward) a value the signature fixes."""

    index: int = -1
    value: Any = None

    def build(self, results: Sequence[Any]) -> Any:
        return results[self.index] if self.index >= 0 else self.value


def _constant_ids(gm: torch.fx.GraphModule) -> set[int]:
    """Tensors the graph module itself holds (parameters, buffers, lifted constants)."""
    ids = {id(t) for t in gm.parameters()} | {id(t) for t in gm.buffers()}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor):
                ids.add(id(value))
    return ids


def mutated_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Indices of the inputs some op of the graph writes (BatchNorm's running stats, copy_)."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written: set[int] = set()
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        for arg, value in zip(target._schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and value in index:
                written.add(index[value])
    return sorted(written)


@dataclass
class DirectGraph:
    """One generated graph for one input signature."""

    graph: Any  # _C.runtime.DirectGraph
    inputs: list[tuple[int, torch.Tensor | None]]  # per graph input: the call's input index, or -1 and a constant
    outputs: list[_Output]
    spec: Any  # pytree spec of the graph module's result
    mutated: list[int] = field(default_factory=list)
    # Graph results in output order, when the outputs are exactly the results (the usual case):
    # then a call needs no per-output Python.
    identity: bool = False
    uses_offsets: bool = False  # the graph has an as_strided: signatures must hold storage offsets
    # Overlap (see defer_refusal): the same graph writing into output buffers, run on the
    # deferred worker, and the recorded outputs the buffers are shaped like (fetch slot order).
    deferred: Any = None  # _C.runtime.DirectGraph(into_buffers=True)
    like: list[torch.Tensor] = field(default_factory=list)
    # optimize="fused": compiles the graph's segments in the background (terra_torch/_fused.py).
    compiler: Any = None

    def __post_init__(self) -> None:
        self._flat_tuple = self.spec.type is tuple and self.spec.num_children == self.spec.num_leaves

    def run(self, flat: Sequence[Any]) -> Any:
        args = [flat[i] if i >= 0 else constant for i, constant in self.inputs]
        if self.deferred is not None:
            results = self.deferred.launch(args, self.like)
        else:
            results = self.graph.run(args)
        if self.mutated:
            # The interpreter runs below ADInplaceOrView: bump what eager's in-place ops would
            # have bumped, so autograd still notices a saved tensor that was overwritten.
            torch.autograd.graph.increment_version([flat[i] for i in self.mutated])
        values = results if self.identity else [o.build(results) for o in self.outputs]
        if self._flat_tuple:
            return tuple(values)  # AOTAutograd's graphs return flat tuples: skip pytree
        return pytree.tree_unflatten(values, self.spec)

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.stop(timeout=2.0)
            self.compiler = None
        if self.deferred is not None:
            _C.runtime.wait_direct()  # a queued run still uses the graph's code
        self.graph = self.deferred = None  # the interpreter's code and the constants go with it
        self.like = []

    @property
    def segments(self) -> list[dict[str, Any]] | None:
        """optimize="fused": each compiled segment's report (FusedExecutor.report), else None."""
        fused = self.graph.fused if self.graph is not None else None
        return list(fused.report()) if fused is not None else None


def defer_refusal(leaves: Sequence[Any], flat: Sequence[Any]) -> str | None:
    """Why this graph's calls cannot return before the graph has run, or None.

    A deferred run writes its results into fresh buffers, so the outputs must be fresh memory:
    not inputs, not views of inputs, not sharing memory with each other (eager's aliases would
    be lost), and dense (the buffer is allocated with the output's exact layout).
    """
    storages = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
    for k, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            continue
        if t.untyped_storage().nbytes() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key in storages:
            return f"output {k} shares memory with an input or another output"
        storages.add(key)
        if not t.is_contiguous() and not _dense(t):
            return f"output {k} is not dense"
    return None


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill exactly `numel` consecutive locations."""
    order = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in order:
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def record_and_build(gm: torch.fx.GraphModule, flat: list[Any], optimize: bool | str,
                     may_defer: bool = False) -> tuple[Any, DirectGraph | None, str | None]:
    """Run `gm` eagerly in a recording region and generate its graph.

    Returns the call's result (always: the call itself ran) and the DirectGraph, or None and
    the reason it could not be built.
    """
    region = _C.Region("record", sys._getframe(0))
    region.open()
    try:
        result = gm(*flat)
        leaves, spec = pytree.tree_flatten(result)
        tensors = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        for tag, k in enumerate(tensors):
            torch.ops.terra.fetch(tag, leaves[k])  # recorded: the graph must deliver this value
    finally:
        region.close()
    try:
        graph = _build(gm, flat, region, leaves, spec, optimize)
        if may_defer and (why_not := defer_refusal(leaves, flat)) is None:
            _make_deferred(graph, region, leaves, optimize)
        elif may_defer:
            logger.debug("terra backend: %s runs synchronously: %s", type(gm).__name__, why_not)
        return result, graph, None
    except DirectUnavailable as e:
        return result, None, str(e)
    except RuntimeError as e:  # the emitter refuses the trace (an attribute it cannot express)
        return result, None, f"its graph cannot be generated: {e}"


def _build(gm: torch.fx.GraphModule, flat: list[Any], region: Any, leaves: list[Any], spec: Any,
           optimize: bool | str) -> DirectGraph:
    tensor_ids = [id(a) for a in flat if isinstance(a, torch.Tensor)]
    if len(set(tensor_ids)) != len(tensor_ids):
        # Feeds name tensors by object: which of the positions a later call's value comes from
        # could not be told apart.
        raise DirectUnavailable("the same tensor is passed as several inputs")
    plan = _C.runtime.Plan([region], optimize is True)
    unserved = sorted(set(re.findall(r"terra::(\w+)", plan.text)) - _SERVED_OPS)
    if unserved:
        raise DirectUnavailable(f"its graph takes input through {', '.join(unserved)}")
    _, feeds, fetches, _scalars = plan.script(0)
    fused = optimize == "fused"
    graph = _C.runtime.DirectGraph(plan, "fused" if fused else "interpreter")
    sources = _feed_sources(gm, flat, dict(feeds))
    result_of_tag = {tag: graph.fetch_slots.index(slot) for slot, tag in fetches}
    outputs: list[_Output] = []
    tag = 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            outputs.append(_Output(result_of_tag[tag]))
            tag += 1
        else:
            outputs.append(_Output(value=leaf))
    identity = [o.index for o in outputs] == list(range(len(outputs)))
    direct = DirectGraph(graph, [sources[slot] for slot in graph.feed_slots], outputs, spec, mutated_inputs(gm),
                         identity, "as_strided" in plan.text)
    if fused:
        # The executor, not the graph, is what the thread holds: close() stops the thread.
        executor = graph.fused
        direct.compiler = _fused.SegmentCompiler(lambda: executor)
    return direct


def _make_deferred(graph: DirectGraph, region: Any, leaves: list[Any], optimize: bool | str) -> None:
    plan = _C.runtime.Plan([region], optimize is True)
    # (Overlap runs stay interpreted: a deferred graph writes into buffers Python already holds,
    # and its compiled segments would need a compiler of their own.)
    deferred = _C.runtime.DirectGraph(plan, "interpreter", True)
    if list(deferred.feed_slots) != list(graph.graph.feed_slots):
        raise DirectUnavailable("the deferred graph's feeds differ")  # the same plan: never expected
    by_result = {o.index: leaves[k] for k, o in enumerate(graph.outputs) if o.index >= 0}
    graph.like = [by_result[r] for r in range(len(by_result))]
    graph.deferred = deferred


def _feed_sources(gm: torch.fx.GraphModule, flat: list[Any],
                  feeds: dict[int, torch.Tensor | None]) -> dict[int, tuple[int, torch.Tensor | None]]:
    """Per feed slot, where later calls take its tensor from: an input position or a constant."""
    by_id = {id(a): i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)}
    constants = _constant_ids(gm)
    sources: dict[int, tuple[int, torch.Tensor | None]] = {}
    for slot, tensor in feeds.items():
        if tensor is None:
            sources[slot] = (-1, None)
        elif id(tensor) in by_id:
            sources[slot] = (by_id[id(tensor)], None)
        elif id(tensor) in constants or tensor.dim() == 0:
            # A 0-dim tensor that is no input is a Python number the binding wrapped for a
            # Tensor argument (`mul(x, 0.01)`): fixed by the FX graph or by the signature.
            sources[slot] = (-1, tensor)
        else:
            raise DirectUnavailable(f"it reads a tensor that is neither an input nor its own constant "
                                    f"(feed slot {slot}, sizes {tuple(tensor.shape)})")
    return sources
