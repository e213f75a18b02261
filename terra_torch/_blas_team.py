"""How many MKL threads the graph worker may use: one, where every traced op keeps eager's bits.

Why (csrc/runtime/worker_threads.h has the measurements): under co-execution the Python thread
holds a core while the worker runs the kernels. With torch's default team (every core) each of
the worker's MKL calls opens a parallel region whose other thread has to be scheduled onto the
core Python holds: on 2 cores with 2 threads an MLP + SGD step spent 0.49 ms per iteration in
the graph against 0.16-0.19 ms with the worker's MKL at one thread, and co-execution lost to
eager where it won at one thread. But the team can decide the bits: MKL splits some calls
differently with one thread (GEMMs of 5-7 rows, long dot products, a float64 batched GEMM over
65536-long rows: `torch.dot` differs on this machine from 65536 floats on), and co-execution
promises eager's numbers.

So each op of every merged trace is *calibrated* once per process: run on random inputs of its
recorded sizes, strides, storage offsets and dtypes (floats uniform in [0, 1), integer inputs
zero, so that indices are valid), with the calling thread's MKL team as torch set it and again with one thread
(`_C.runtime.with_blas_team`), both runs from the same random state, and the results compared
bit for bit. A program whose ops all agree gets a worker with one MKL thread
(`Session.limit_blas_team(1)`); any op that differs, raises on random inputs, or comes from a
namespace whose kernels we cannot run here keeps torch's team for the whole program, and the
reason is kept (`terra_torch.stats(model).blas_team`). Random inputs cannot prove that two
summation orders agree on every input, but different orders give different bits on random
data with overwhelming probability, so an agreement means MKL took the same path both times.

The ops' own ATen (OpenMP) team is not touched: only MKL's. Nothing to do with one intra-op
thread (the teams are equal) or without MKL (no per-thread team to set).
Off by default: TERRA_BLAS_CALIBRATION=1 turns it on (see `enabled` for the hole that keeps it off).

Example: an MLP step traced on 2 threads calibrates its `addmm`, `mm`, `relu`, ... (about 40
distinct calls, a few milliseconds); all agree, and its worker runs MKL on one thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from terra_torch import _C, _fused

# Opt in (TERRA_BLAS_CALIBRATION=1) until a co-executed iteration whose shapes no trace had is
# guarded: a batch of a new size (an epoch's last one) reaches the worker's GEMMs before any op
# diverges (the sizes are fed, not part of an op's identity), so they ran with one MKL thread on
# an uncalibrated shape and the iteration was not eager's bits (test_worker_threads.py, the xfail
# test). The guard it needs: at a feed whose layout, or a fed int whose value, no calibrated trace
# had, the worker takes torch's team before it runs anything that reads it.
enabled = os.environ.get("TERRA_BLAS_CALIBRATION", "0") == "1"

# Namespaces whose ops are calibrated by running them; an op of any other namespace keeps
# torch's team (a custom op may call MKL in ways random inputs cannot exercise).
_RUNNABLE = ("aten", "prims")
# Ops that call no MKL and whose results random inputs do not determine (uninitialized memory,
# a profiler handle): never compared.
_NO_MKL = frozenset({
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
    "aten::empty.memory_format", "aten::resize_", "aten::set_", "aten::lift_fresh", "aten::_local_scalar_dense",
    "aten::item", "aten::detach", "aten::alias",
})
_NO_MKL_NAMESPACES = ("profiler", "terra", "_c10d_functional", "c10d")


@dataclass
class Verdict:
    """One op's calibration: did one MKL thread give the same bits? `why` when not."""

    same: bool
    why: str = ""


# (op name, attributes, input positions and layouts) -> Verdict, for the whole process: programs of one
# process share their calls' verdicts (each call is calibrated once). Emptied when it holds
# _MAX_VERDICTS (a program whose shapes never repeat).
_verdicts: dict[Any, Verdict] = {}
_MAX_VERDICTS = 100_000
# An op whose inputs hold more is not run twice on random copies (time and memory at a graph
# build): the program keeps torch's team.
_MAX_INPUT_BYTES = 256 << 20


def worth_calibrating() -> bool:
    """A worker with one MKL thread differs from torch's setting only with a team of several."""
    return enabled and torch.get_num_threads() > 1 and bool(_C.runtime.can_limit_blas_team())


def calibrate(ops: Sequence[tuple], externals: Sequence[tuple]) -> Verdict:
    """Every op of one trace (`Region.ops()`, `Region.externals()`): same bits with one MKL
    thread? The first op that differs (or cannot be run) ends the calibration with its reason."""
    metas = [meta for meta, _identity in externals]
    for index, raw in enumerate(ops):
        name, attributes, _attributes_hash, inputs = raw[:4]
        attribute_arguments = raw[9]
        layouts = tuple(_input_meta(inp, ops, metas) for inp in inputs)
        # (The attributes themselves, not Region's hash of them, which leaves out some floats.)
        key = (name, repr(attributes), tuple((i[0], i[1]) for i in inputs), layouts)
        verdict = _verdicts.get(key)
        if verdict is None:
            if len(_verdicts) >= _MAX_VERDICTS:
                _verdicts.clear()
            verdict = _verdicts[key] = _calibrate_one(name, attributes, attribute_arguments, inputs, layouts)
        if not verdict.same:
            return Verdict(False, f"{name} (op {index} of the trace) {verdict.why}")
    return Verdict(True)


def _input_meta(inp: tuple, ops: Sequence[tuple], externals: Sequence[tuple]) -> tuple:
    """(dtype, sizes, strides, storage offset, device, requires_grad) of a recorded input."""
    _argument, _list_index, kind, a, b = inp
    dtype, sizes, strides, offset, device, requires_grad = externals[a] if kind == "external" else ops[a][4][b]
    return dtype, tuple(sizes), tuple(strides), offset, device, requires_grad


def _calibrate_one(name: str, attributes: Sequence[Any], attribute_arguments: Sequence[int],
                   inputs: Sequence[tuple], layouts: Sequence[tuple]) -> Verdict:
    namespace = name.split("::", 1)[0]
    if name in _NO_MKL or namespace in _NO_MKL_NAMESPACES:
        return Verdict(True)
    if any(str(meta[4]) != "cpu" for meta in layouts):
        return Verdict(True)  # MKL's team is a CPU setting
    if namespace not in _RUNNABLE:
        return Verdict(False, "is not an aten op: its kernel may use MKL in ways random inputs cannot show")
    size = sum(_extent(meta) * meta[0].itemsize for meta in layouts)
    if size > _MAX_INPUT_BYTES:
        return Verdict(False, f"has {size >> 20} MB of inputs, too many to run twice on random copies")
    try:
        qualified, _, overload = name.partition(".")  # ("aten::add.Tensor": Region.ops()'s name)
        op = _fused._overload(qualified, overload)
        call = _call_of(op, attributes, attribute_arguments, inputs, layouts)
    except Exception as e:  # (an op this torch cannot name, arguments we cannot rebuild)
        return Verdict(False, f"could not be run on random inputs ({type(e).__name__}: {e})")
    try:
        full = _run(call)
        one = _C.runtime.with_blas_team(1, lambda: _run(call))
        same = _same_bits(full, one)
    except Exception as e:
        return Verdict(False, f"raised on random inputs ({type(e).__name__}: {str(e)[:200]})")
    if not same:
        return Verdict(False, "gives other bits with one MKL thread than with torch's team")
    return Verdict(True)


def _holds_tensor(t: Any) -> bool:
    if t.kind() == "TensorType":
        return True
    return any(_holds_tensor(inner) for inner in t.containedTypes())


def _is_list(t: Any) -> bool:
    if t.kind() == "OptionalType":
        return _is_list(t.getElementType())
    return t.kind() == "ListType"


def _call_of(op: Any, attributes: Sequence[Any], attribute_arguments: Sequence[int], inputs: Sequence[tuple],
             layouts: Sequence[tuple]) -> Callable[[], Any]:
    """A function that builds fresh random inputs and runs the op (the same inputs every call:
    they come from a generator seeded in it)."""
    schema = op._schema
    by_argument: dict[int, list[tuple[int, tuple]]] = {}
    for inp, meta in zip(inputs, layouts):
        by_argument.setdefault(inp[0], []).append((inp[1], meta))
    given = dict(zip(attribute_arguments, attributes))

    def call() -> Any:
        gen = torch.Generator().manual_seed(1234)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for i, argument in enumerate(schema.arguments):
            if i in given:
                value = given[i]
                if isinstance(value, torch.Generator):  # (the program's own: never advanced here)
                    value = torch.Generator(device=value.device).set_state(value.get_state())
            elif i in by_argument:
                tensors = by_argument[i]
                if _is_list(argument.type):
                    value = [None] * (max(k for k, _ in tensors) + 1)
                    for k, meta in tensors:
                        value[k] = _random_like(meta, gen)
                else:
                    value = _random_like(tensors[0][1], gen)
            elif _holds_tensor(argument.type):
                value = [] if _is_list(argument.type) else None  # (no defined tensor was passed)
            else:
                raise ValueError(f"argument {argument.name} was not recorded")
            if argument.kwarg_only:
                kwargs[argument.name] = value
            else:
                args.append(value)
        return op(*args, **kwargs)

    return call


def _extent(meta: tuple) -> int:
    """Elements of the storage a tensor of this layout reaches."""
    _dtype, sizes, strides, offset, _device, _requires_grad = meta
    return offset + 1 + sum((s - 1) * st for s, st in zip(sizes, strides)) if all(s > 0 for s in sizes) else offset


def _random_like(meta: tuple, gen: torch.Generator) -> torch.Tensor:
    dtype, sizes, strides, offset, _device, _requires_grad = meta
    extent = _extent(meta)
    if dtype.is_floating_point or dtype.is_complex:
        # Uniform in [0, 1): valid for ops that check their range (binary_cross_entropy,
        # bernoulli's p), and random enough that two summation orders round differently.
        base = torch.rand(max(extent, 1), generator=gen, dtype=dtype)
    else:
        base = torch.zeros(max(extent, 1), dtype=dtype)  # (valid indices, masks, counts)
    return base.as_strided(tuple(sizes), tuple(strides), offset)


def _run(call: Callable[[], Any]) -> Any:
    state = torch.get_rng_state()  # random ops draw the same numbers in both runs
    try:
        with torch.no_grad():
            return call()
    finally:
        torch.set_rng_state(state)


def _same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.numel() == 0:
            return True
        return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # (NaN)
    return type(a) is type(b) and a == b
