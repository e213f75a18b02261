"""Look at what the capture layer sees.

    result, trace = terra_torch.debug.record(train_step, model, batch)
    for op in trace.ops:
        print(op.name, op.location)

`record` runs `fn` eagerly with every aten op intercepted at the dispatcher (forward, backward
and optimizer ops alike) and returns its result with the trace. With mode="placeholder" nothing
is computed: every op returns a placeholder tensor with the right metadata and no data.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch

from terra_torch import _C

_TORCH_DIR = os.path.dirname(torch.__file__)
# terra_torch's own Python (the stand-ins of _optimizer/, the engine of _backward.py) is not the
# user's line either.
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class Location:
    """Where an op was issued: the Python stack (and, for backward ops, the forward op).
    Equal and hashed by id; the frames are described only when asked for."""

    def __init__(self, loc_id: int, region: _C.Region) -> None:
        self.id = loc_id
        self._region = region

    @cached_property
    def frames(self) -> tuple[str, ...]:
        """'file:line in function' per frame, outermost first."""
        return tuple(self._region.describe_location(self.id))

    @property
    def user_frame(self) -> str:
        """The innermost frame outside torch's and terra_torch's own Python: the user's line."""
        for frame in reversed(self.frames):
            if not frame.startswith((_TORCH_DIR, _OWN_DIR, "backward:")):
                return frame
        return self.frames[-1] if self.frames else str(self)

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and other.id == self.id

    def __repr__(self) -> str:
        return f"Location({self.id:#x})"

    def __str__(self) -> str:
        if self.frames:
            return " -> ".join(self.frames)
        # (An op issued with no frame of the program on the stack: by torch's C++ on a thread of
        # its own, or by the wrapper itself. The id alone told a reader nothing.)
        return f"<an op with no Python frame of the program (location {self.id:#x})>"


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    device: str
    requires_grad: bool


@dataclass(frozen=True)
class Input:
    """A tensor argument: output `output` of op `op`, or external input `external`."""

    argument: int
    list_index: int
    op: int | None = None
    output: int | None = None
    external: int | None = None


@dataclass(frozen=True)
class Op:
    index: int
    name: str  # "aten::addmm" (overload as ".out" etc. when it is not the default)
    attributes: tuple[Any, ...]
    attributes_hash: int
    inputs: tuple[Input, ...]
    outputs: tuple[TensorMeta, ...]
    location: Location
    loops: tuple[tuple[int, int], ...]  # (loop id, iteration), outermost first
    backward: bool
    needs_materialization: bool


@dataclass
class Trace:
    ops: list[Op]
    externals: list[tuple[TensorMeta, int]]

    @property
    def names(self) -> list[str]:
        return [op.name for op in self.ops]


def _meta(t: tuple) -> TensorMeta:
    dtype, sizes, strides, offset, device, requires_grad = t
    return TensorMeta(dtype, tuple(sizes), tuple(strides), offset, device, requires_grad)


def _trace_of(region: _C.Region) -> Trace:
    described: dict[int, Location] = {}

    def location(loc_id: int) -> Location:
        if loc_id not in described:
            described[loc_id] = Location(loc_id, region)
        return described[loc_id]

    ops = []
    for index, raw in enumerate(region.ops()):
        name, attrs, attrs_hash, inputs, outputs, loc, loops, backward, materialize = raw
        ins = tuple(
            Input(arg, k, external=a) if kind == "external" else Input(arg, k, op=a, output=b)
            for arg, k, kind, a, b in inputs
        )
        ops.append(Op(index, name, attrs, attrs_hash, ins, tuple(_meta(o) for o in outputs),
                      location(loc), tuple(loops), backward, materialize))
    externals = [(_meta(m), identity) for m, identity in region.externals()]
    return Trace(ops, externals)


def record(fn: Callable[..., Any], *args: Any, mode: str = "record", **kwargs: Any) -> tuple[Any, Trace]:
    """Run `fn(*args, **kwargs)` in a capture region; return (its result, the trace)."""
    region = _C.Region(mode, sys._getframe(0))  # locations start at fn's frame
    region.open()
    try:
        result = fn(*args, **kwargs)
    finally:
        region.close()
    return result, _trace_of(region)


@contextlib.contextmanager
def fail_at(op: str) -> Iterator[None]:
    """Make the next intercepted op whose name starts with `op` (for example "aten::mm") raise, as
    an internal error of the interceptor would: for testing that a program's error paths (a
    failure in the middle of backward(), say) end in an exception, not a hang.

        with terra_torch.debug.fail_at("aten::threshold_backward"):
            loss.backward()        # RuntimeError: terra_torch: injected failure at ...
    """
    _C.inject_failure(op)
    try:
        yield
    finally:
        _C.inject_failure("")
