"""Compiles the segments of a FusedExecutor (csrc/runtime/fused_executor.h) with AOTInductor.

A segment is a straight-line stretch of aten ops cut out of a generated graph
(csrc/emit/segments.h). Its body arrives here as plain data; it becomes an FX graph of the same
`torch.ops.aten` overloads, is exported with inputs of the layouts the segment first ran with
(torch.export functionalizes it: writes into inputs come back as copies into them, as
torch.compile does with input mutation), and is compiled by AOTInductor into a package whose
code the executor then runs from C++ without the GIL. The executor checks the first compiled run
against the interpreter before it trusts it.

Packages are kept in a cache directory (`TERRA_CACHE_DIR`, default `~/.cache/terra_torch`) under
a key of the body, the layouts, the torch version and the compiler's own version, so a
restarted job loads them instead of compiling again; each is written under a temporary name and
renamed into place, so concurrent writers never leave a half-written package.

    terra_torch.wrap(model, optimize="fused")     # co-execution: a SegmentCompiler thread
    g = terra_torch.graph.build([rec])            # or by hand, on a generated graph:
    g.run(rec, mode="fused")                      # segments run interpreted, request compiling
    g.compile_segments()                          # compile what was requested (compile_one)
    g.run(rec, mode="fused")                      # first compiled run, checked; then compiled
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import operator
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger("terra_torch.fused")

# Bumped when the way a body becomes a package changes: older packages are not reused.
_COMPILER_VERSION = 5


def cache_root() -> Path:
    """terra_torch's cache folder: TERRA_CACHE_DIR, default ~/.cache/terra_torch (compiled
    segments here, kept programs in _warm_start)."""
    return Path(os.environ.get("TERRA_CACHE_DIR") or Path.home() / ".cache" / "terra_torch")


def cache_dir() -> Path:
    return cache_root() / "segments"


def _overload(name: str, overload: str) -> torch._ops.OpOverload:
    namespace, op = name.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


def build_module(body: dict[str, Any], plan: dict[str, list[Any]]) -> torch.fx.GraphModule:
    """The segment body as an FX GraphModule of the same aten overloads. Its arguments follow
    the call plan (csrc/runtime/fused_executor.h, CallPlan): the direct inputs, then one flat
    tensor per base, over which the other inputs are rebuilt with as_strided.

    A direct input the plan marks `wrapped` is a Python number of the program, fed as a 0-dim
    tensor that eager's type promotion ranks below every tensor (`0.01 * a.sum()` stays
    float32). Compiled code sees a plain 0-dim float64 tensor, which would make that product
    float64, so each use is cast first to the dtype eager computes the op in (_WrappedCasts)."""
    graph = torch.fx.Graph()
    values: dict[int, torch.fx.Node] = {}
    for input_index, *_ in plan["direct"]:
        values[input_index] = graph.placeholder(f"in{input_index}")
    bases = [graph.placeholder(f"base{b}") for b in range(len(plan["bases"]))]
    for input_index, base, sizes, strides, offset in plan["views"]:
        values[input_index] = graph.call_function(torch.ops.aten.as_strided.default,
                                                  (bases[base], sizes, strides, offset))
    casts = _WrappedCasts.of(plan)
    for name, overload, args, outs in body["nodes"]:
        if (name, overload) == ("aten::Float", "Tensor"):  # a scalar operand's number (segments.h)
            values[outs[0]] = _ScalarOperand(values[args[0][1]])
            if casts:
                casts.note_number(outs[0])
            continue
        if name == "aten::lift_fresh":
            # Eager's lift_fresh returns its argument itself, and Adam writes its fresh `step`
            # counter through it: the write must reach the input (the tensor Python keeps).
            # Functionalization would make it lift_fresh_copy and drop the write (the
            # executor's check caught it: the counter stayed 0), so it is the identity here.
            values[outs[0]] = values[args[0][1]]
            continue
        op = _overload(name, overload)
        resolved = [(spec, kind, v) for spec, (kind, v) in zip(op._schema.arguments, args)]
        if any(kind == "v" and isinstance(values[v], _ScalarOperand) for _, kind, v in resolved):
            node = _rewrite_scalar_operands(graph, op, {spec.name: values[v] if kind == "v" else v
                                                        for spec, kind, v in resolved})
            if casts:
                casts.follow(op, resolved, outs)
            values[outs[0]] = node
            continue
        cast_to = casts.dtype_for(resolved) if casts else None

        def node_of(v: int, cast_to: torch.dtype | None = cast_to) -> torch.fx.Node:
            if cast_to is not None and v in casts.wrapped:
                return graph.call_function(torch.ops.aten._to_copy.default, (values[v],), {"dtype": cast_to})
            return values[v]

        positional, keywords = _call_arguments(resolved, node_of)
        node = graph.call_function(op, tuple(positional), keywords)
        if casts:
            casts.follow(op, resolved, outs)
        if len(outs) == 1:
            values[outs[0]] = node
        else:
            for k, out in enumerate(outs):
                values[out] = graph.call_function(operator.getitem, (node, k))
    graph.output(tuple(values[o] for o in body["outputs"]))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


class _ScalarOperand:
    """A number a segment takes at run time (csrc/emit/segments.h, scalar_operands): a 0-dim
    float64 input that the body turns back into a Python float with `aten::Float`."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.fx.Node) -> None:
        self.tensor = tensor


_A = torch.ops.aten


def _scaled(call: Callable[..., torch.fx.Node], x: torch.fx.Node, s: Any) -> torch.fx.Node:
    """x * s for a scalar operand or a constant number s. The operand stays a 0-dim float64
    tensor: it ranks below x in type promotion, so the product keeps x's dtype and is computed in
    it, as eager's kernel uses the Python number (an integer x is the exception: there eager's
    result is float32 and this one float64, which the executor's check refuses)."""
    if isinstance(s, _ScalarOperand):
        return call(_A.mul.Tensor, x, s.tensor)
    return x if s == 1 else call(_A.mul.Scalar, x, s)


def _number(s: Any) -> Any:
    return s.tensor if isinstance(s, _ScalarOperand) else s


# The ops of segments.h's scalar_operands(), as tensor ops that take the number as a 0-dim
# tensor (the decompositions torch's own refs use for these ops; not bitwise, within the
# executor's check). Keyed by (schema name, overload) of the out-of-place op; each rewrite gets
# `c` (adds a node) and `a` (argument names to FX nodes, constants or _ScalarOperand). An
# in-place op (`addcdiv_`, named in scalar_operands() with its own overload) is its
# out-of-place form copied into `self` (_rewrite_scalar_operands).
_SCALAR_OPERAND_REWRITES: dict[tuple[str, str], Callable[[Callable[..., torch.fx.Node], dict[str, Any]], torch.fx.Node]] = {
    ("aten::addcdiv", ""): lambda c, a: c(_A.add.Tensor, a["self"], _scaled(c, c(_A.div.Tensor, a["tensor1"], a["tensor2"]), a["value"])),
    ("aten::addcmul", ""): lambda c, a: c(_A.add.Tensor, a["self"], _scaled(c, c(_A.mul.Tensor, a["tensor1"], a["tensor2"]), a["value"])),
    ("aten::add", "Tensor"): lambda c, a: c(_A.add.Tensor, a["self"], _scaled(c, a["other"], a["alpha"])),
    ("aten::sub", "Tensor"): lambda c, a: c(_A.sub.Tensor, a["self"], _scaled(c, a["other"], a["alpha"])),
    ("aten::add", "Scalar"): lambda c, a: c(_A.add.Tensor, a["self"], _number(a["other"]), alpha=a["alpha"]),
    ("aten::sub", "Scalar"): lambda c, a: c(_A.sub.Tensor, a["self"], _number(a["other"]), alpha=a["alpha"]),
    ("aten::mul", "Scalar"): lambda c, a: c(_A.mul.Tensor, a["self"], _number(a["other"])),
    ("aten::div", "Scalar"): lambda c, a: c(_A.div.Tensor, a["self"], _number(a["other"])),
    ("aten::lerp", "Scalar"): lambda c, a: c(_A.lerp.Tensor, a["self"], a["end"], _number(a["weight"])),
    ("aten::pow", "Tensor_Scalar"): lambda c, a: c(_A.pow.Tensor_Tensor, a["self"], _number(a["exponent"])),
}
# The in-place ops' overloads where they differ from the out-of-place op's (pow_.Scalar).
_IN_PLACE_OF = {("aten::pow_", "Scalar"): ("aten::pow", "Tensor_Scalar")}


def _rewrite_scalar_operands(graph: torch.fx.Graph, op: torch._ops.OpOverload, arguments: dict[str, Any]) -> torch.fx.Node:
    name, overload = op._schema.name, op._schema.overload_name
    in_place = name.endswith("_")
    key = _IN_PLACE_OF.get((name, overload), (name[:-1], overload)) if in_place else (name, overload)
    rewrite = _SCALAR_OPERAND_REWRITES.get(key)
    if rewrite is None:  # (segments.cpp cuts no other op with a number computed at run time)
        raise ValueError(f"terra_torch: no tensor form of {name}.{overload or 'default'} with a number computed at run time")

    def call(target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        return graph.call_function(target, args, kwargs)

    result = rewrite(call, arguments)
    # An in-place op writes its result into self and returns self (functionalization makes the
    # write a copy into the input, as for any in-place op of a segment).
    return call(_A.copy_.default, arguments["self"], result) if in_place else result


def _call_arguments(resolved: list[tuple[Any, str, Any]], value_of: Callable[[int], Any]) -> tuple[list[Any], dict[str, Any]]:
    """An op's positional and keyword arguments from its body arguments (schema argument, "v"
    for a value id or "c" for a constant, the id or constant), values looked up by value_of."""
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    for spec, kind, v in resolved:
        value = value_of(v) if kind == "v" else v
        if spec.kwarg_only:
            keywords[spec.name] = value
        else:
            positional.append(value)
    return positional, keywords


class _WrappedCasts:
    """The dtypes a segment's ops compute in where a wrapped number is among their inputs.

    Follows the body on fake tensors of the plan's layouts (values by id, as in build_module)
    and asks torch's own promotion rule (torch._prims_common.elementwise_dtypes, which ranks a
    Python number below 0-dim tensors and those below the others, as TensorIterator does) with
    each wrapped input given as a Python number of its kind:

        a: float32 [7];  s: wrapped float64
        mul(sum(a), s)   ->  elementwise_dtypes(<float32 0-dim>, 1.0) -> float32: s cast to it

    The cast value is the one eager's kernel uses (the double rounded to float32); for float16
    and bfloat16 eager keeps the scalar in float32, so there the compiled result may differ in
    the last bits, within the executor's check. Where following the body fails (an op fake
    tensors cannot run), nothing is cast: the check then refuses a result of another dtype, as
    before."""

    def __init__(self, plan: dict[str, list[Any]]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.wrapped = {d[0] for d in plan["direct"] if len(d) > 5 and d[5]}
        self._mode = FakeTensorMode()
        self._fakes: dict[int, Any] | None = {}
        with self._mode:
            for input_index, sizes, strides, dtype, device, *_ in plan["direct"]:
                self._fakes[input_index] = torch.empty_strided(sizes, strides, dtype=dtype, device=device)
            bases = [torch.empty(numel, dtype=dtype, device=device) for numel, dtype, device in plan["bases"]]
            for input_index, base, sizes, strides, offset in plan["views"]:
                self._fakes[input_index] = bases[base].as_strided(sizes, strides, offset)

    @classmethod
    def of(cls, plan: dict[str, list[Any]]) -> "_WrappedCasts | None":
        if not any(len(d) > 5 and d[5] for d in plan["direct"]):
            return None
        return cls(plan)

    def dtype_for(self, resolved: list[tuple[Any, str, Any]]) -> torch.dtype | None:
        if self._fakes is None or not any(kind == "v" and v in self.wrapped for _, kind, v in resolved):
            return None
        from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

        operands: list[Any] = []
        for _, kind, v in resolved:
            if kind != "v":
                continue
            fake = self._fakes.get(v)
            if not isinstance(fake, torch.Tensor):
                return None
            if v in self.wrapped:
                operands.append(True if fake.dtype == torch.bool else 1j if fake.dtype.is_complex
                                else 1.0 if fake.dtype.is_floating_point else 1)
            else:
                operands.append(fake)
        if all(not isinstance(o, torch.Tensor) for o in operands):
            return None  # (wrapped numbers only: eager keeps their dtype, and so does the graph)
        try:
            _, common = elementwise_dtypes(*operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
        except Exception:  # (not an elementwise op: leave it as it is)
            return None
        return common

    def note_number(self, out: int) -> None:
        """Value `out` is a number (a scalar operand): later ops are followed with a float."""
        if self._fakes is not None:
            self._fakes[out] = 1.0

    def follow(self, op: Any, resolved: list[tuple[Any, str, Any]], outs: list[int]) -> None:
        """Runs the op on the fakes, so that later ops see its outputs' dtypes and dims."""
        if self._fakes is None:
            return
        fakes = self._fakes
        try:
            args, kwargs = _call_arguments(resolved, fakes.__getitem__)
            with self._mode:
                result = op(*args, **kwargs)
        except Exception as e:  # (an op fake tensors cannot run: stop following)
            log.debug("wrapped-number casts stop at %s: %s", op, e)
            self._fakes = None
            return
        results = result if isinstance(result, (tuple, list)) else (result,)
        for out, r in zip(outs, results):
            fakes[out] = r


def example_arguments(plan: dict[str, list[Any]]) -> tuple[torch.Tensor, ...]:
    """Arguments of the plan's layouts (values do not matter: every segment op has tensor
    results of static shapes)."""
    direct = [torch.empty_strided(sizes, strides, dtype=dtype, device=device).zero_()
              for _, sizes, strides, dtype, device, *_ in plan["direct"]]
    bases = [torch.zeros(numel, dtype=dtype, device=device) for numel, dtype, device in plan["bases"]]
    return tuple(direct + bases)


def package_key(body: dict[str, Any], plan: dict[str, list[Any]]) -> str:
    h = hashlib.sha256()
    # The body by its canonical form (values numbered in order, constants by value), not its
    # text: the text names values after the whole graph's numbering, so the same segment cut
    # from a graph generated again (another trace merged, a warm start) would miss the cache.
    h.update(repr((body["inputs"], body["nodes"], body["outputs"])).encode())
    h.update(repr(plan).encode())
    h.update(f"{torch.__version__}|{_COMPILER_VERSION}".encode())
    return h.hexdigest()[:32]


def package_path(body: dict[str, Any], plan: dict[str, list[Any]]) -> Path:
    """Where the segment's package is (or will be) in the cache; the directory exists."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{package_key(body, plan)}.pt2"


def compile_segment(body: dict[str, Any], plan: dict[str, list[Any]], path: Path | None = None) -> tuple[str, bool]:
    """Path of the segment's AOTInductor package, and whether it came from the cache. `path`:
    where to put it (default: its place in the cache, package_path)."""
    path = path if path is not None else package_path(body, plan)
    if path.exists():
        return str(path), True
    directory = path.parent
    module = build_module(body, plan)
    with torch.no_grad():
        exported = torch.export.export(module, example_arguments(plan), strict=False)
    fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=directory)
    os.close(fd)
    try:
        # Inductor's pattern matcher drops `alpha` from `w.add_(mm(t(a), b).t().t(), alpha=-0.1)`
        # (torch 2.13: an SGD step through linear's backward came out 10x too large and of the
        # wrong sign; the executor's check caught it). Without it the step is right.
        with torch._inductor.config.patch(pattern_matcher=False):
            torch._inductor.aoti_compile_and_package(exported, package_path=tmp)
        os.replace(tmp, path)  # atomic: a reader sees the whole package or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(path), False


def compile_in_subprocess(body: dict[str, Any], plan: dict[str, list[Any]],
                          stop: threading.Event | None = None) -> tuple[str, bool]:
    """compile_segment() in a child Python process. The compiler thread of a co-executed program
    uses this: torch.export traces with FX, which replaces torch.nn.Module.__call__ process-wide
    while it traces, so a model called meanwhile on the training thread failed ("module is not
    installed as a submodule"); and export and code generation would hold the training process's
    GIL for seconds. `stop` set: the child is killed and RuntimeError raised."""
    path = package_path(body, plan)
    if path.exists():
        return str(path), True
    directory = path.parent
    fd, request = tempfile.mkstemp(suffix=".request", dir=directory)
    with os.fdopen(fd, "wb") as f:
        # The path travels with the request: a child that computed the key itself could name
        # another file than the one this process then loads (a terra_torch edited meanwhile).
        pickle.dump((body, plan, str(path)), f)
    # (stderr to a file, not a pipe: a child writing more warnings than a pipe holds would block)
    with tempfile.TemporaryFile("w+", dir=directory) as errors:
        try:
            child = subprocess.Popen([sys.executable, "-m", "terra_torch._fused", request],
                                     stdout=subprocess.DEVNULL, stderr=errors)
            stopping = stop if stop is not None else threading.Event()  # (never set: a plain wait)
            while child.poll() is None:
                if stopping.wait(0.2):
                    child.kill()
                    child.wait()
                    raise RuntimeError("stopped")
        finally:
            os.unlink(request)
        errors.seek(0)
        err = errors.read()
        if child.returncode != 0:
            lines = [ln for ln in err.strip().splitlines() if ln.strip()]
            raise RuntimeError(lines[-1] if lines else f"the compiler process exited with {child.returncode}")
    return str(path), False


def compile_one(executor: Any, wait_s: float, stop: threading.Event | None = None,
                isolated: bool = False) -> bool:
    """Compiles one requested segment (waiting up to wait_s for a request); False if none came.
    `isolated`: in a child process (compile_in_subprocess). Once `stop` is set nothing more is
    handed to the executor."""
    request = executor.next_request(wait_s)
    if request is None:
        return False
    return compile_request(executor, request, stop, isolated)


def compile_request(executor: Any, request: tuple[int, dict[str, Any], dict[str, list[Any]]],
                    stop: threading.Event | None = None, isolated: bool = False) -> bool:
    """compile_one() for a request already taken: hands the executor the package or the
    failure; False if `stop` was set meanwhile (nothing handed over)."""
    segment, body, plan = request
    t0 = time.perf_counter()
    try:
        path, cached = compile_in_subprocess(body, plan, stop) if isolated else compile_segment(body, plan)
    except Exception as e:  # noqa: BLE001 - any compiler failure leaves the segment interpreted
        reason = f"compiling failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.info("terra_torch: segment %d (%d ops) stays interpreted: %s", segment, len(body["nodes"]), reason)
        if stop is None or not stop.is_set():
            executor.failed(segment, reason)
        return True
    if stop is not None and stop.is_set():
        return False
    executor.compiled(segment, path)
    log.info("terra_torch: segment %d (%d ops) %s in %.1f s", segment, len(body["nodes"]),
             "loaded from the cache" if cached else "compiled", time.perf_counter() - t0)
    return True


_LIVE: "weakref.WeakSet[SegmentCompiler]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # Before the interpreter finalizes: a daemon thread that takes the GIL back then is ended
    # with a forced unwind, which C++ frames that released the GIL (next_request's wait) turn into
    # std::terminate. A compile in flight is abandoned (its result is not handed over).
    for compiler in list(_LIVE):
        compiler.stop(timeout=2.0)


class SegmentCompiler:
    """A daemon thread that has the segments an executor's runs request compiled, one at a time,
    each in a child process (compile_in_subprocess).

    `source()` returns the executor to serve now (a co-executed program gets a new one with each
    graph it builds), None when there is none yet, or raises LookupError when its program is
    gone (the thread then ends). The training loop goes on meanwhile, on interpreted segments.

    `changes` counts the segments handed over (compiled or failed): they change how fast the
    program co-executes, which the program's speed check measures again once the compiler is
    `idle` (no request waited during its last poll): once per burst of compiles, not per
    segment, as each measurement runs the slower mode for a while."""

    def __init__(self, source: Callable[[], Any], poll_s: float = 0.2) -> None:
        self._source = source
        self._poll_s = poll_s
        # (Written by the thread only; a stale read delays a recheck by an iteration.)
        self.changes = 0
        self.idle = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="terra-segment-compiler", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                executor = self._source()
            except LookupError:
                return
            if executor is None:
                self._stop.wait(self._poll_s)
                continue
            request = executor.next_request(self._poll_s)
            self.idle = request is None
            if request is not None and compile_request(executor, request, self._stop, isolated=True):
                self.changes += 1

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._thread.join(timeout)


def _background_priority() -> None:
    """Lowers this (compiler) process's CPU priority by TERRA_COMPILE_NICE (default 10; 0 keeps
    it). Compiling is background work: on a small machine the training process's Python thread
    and graph worker already use the cores, and a compiler at their priority (with the C++
    compiler it starts, which inherits this) slows every step until it is done."""
    niceness = int(os.environ.get("TERRA_COMPILE_NICE", "10"))
    if niceness > 0 and hasattr(os, "nice"):
        try:
            os.nice(niceness)
        except OSError:  # (not allowed here: compile at the same priority)
            log.debug("terra_torch: could not lower the compiler's priority")


def _main(argv: list[str]) -> int:
    """The child of compile_in_subprocess: python -m terra_torch._fused REQUEST (a pickle of
    (body, plan, package path)); writes the package there, exits non-zero with the error on
    stderr."""
    with open(argv[0], "rb") as f:
        body, plan, path = pickle.load(f)
    torch.set_num_threads(1)
    _background_priority()
    compile_segment(body, plan, Path(path))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
