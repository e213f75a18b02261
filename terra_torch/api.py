"""The user-facing entry points of co-execution: wrap, function, unwrap, synchronize, stats.

    model = terra_torch.wrap(model)          # iteration boundary: each forward call
    for x, y in data:
        loss = loss_fn(model(x), y)          # placeholders; the graph computes them
        opt.zero_grad(); loss.backward(); opt.step()
        if step % 10 == 0:
            print(loss.item())               # waits for the value, nothing else does
    terra_torch.synchronize()                # parameters are final (state_dict() does this too)
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import warnings
from types import FrameType
from typing import Any, Callable, TypeVar

import torch

from terra_torch import _C, _data_parallel, _warm_start, runtime
from terra_torch.runtime import Program, Stats

F = TypeVar("F", bound=Callable[..., Any])

_MODES = ("coexec", "lazy", "trace")


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"terra_torch: mode must be one of {', '.join(_MODES)}; got {mode!r}")


def wrap(model: torch.nn.Module, *, mode: str = "coexec", optimize: bool | str = False,
         speed_check: bool = True, warm_start: bool | str | os.PathLike[str] | None = None) -> torch.nn.Module:
    """Co-execute everything between two forward calls of `model` (returns the same module).

    mode: "coexec" (graph on a worker thread, overlapping Python), "lazy" (the graph runs only
    when Python needs a value: serialized, the LazyTensor-like baseline), "trace" (record only).
    optimize: False (default), True (TorchScript's passes on the generated graph) or "fused":
    straight-line stretches of the graph are compiled by AOTInductor in a background thread and
    run compiled once their first compiled run matched the interpreter (relative tolerance 1e-3,
    absolute 1e-5, as torch.compile's accuracy checks): results within that tolerance of eager,
    not bitwise; `explain()` lists what stays interpreted and why (docs/RUNTIME.md, "Compiled
    segments").
    speed_check: after 40 co-executed iterations (12 where Python mostly waits for the graph),
    and again now and then, time co-executed iterations against eager ones and run eagerly while
    eager is faster (the numbers are the same either way; terra_torch/_speed.py). False: always
    co-execute.
    warm_start: keep the program's traces in a cache folder and, in a later run of the same code
    with the same module structure, co-execute from the first iteration instead of tracing again
    (docs/RUNTIME.md, "Warm start"). True: $TERRA_CACHE_DIR/programs (default
    ~/.cache/terra_torch/programs); a path: that folder; None (default): the TERRA_WARM_START
    environment variable ("1" or a folder; unset: off).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"terra_torch.wrap expects a torch.nn.Module, got {type(model).__name__}")
    _check_mode(mode)
    if getattr(model, "_terra_program", None) is not None:
        raise ValueError("terra_torch.wrap: this module is already wrapped (terra_torch.unwrap it first)")
    folder = _warm_start.directory_from(warm_start)
    structure = functools.partial(_warm_start.module_structure, model)
    program = Program(type(model).__name__, mode, optimize, speed_check, folder, structure)
    own_forward = model.__dict__.get("forward")  # an instance attribute the user had set, if any
    lowering = None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        # DDP's reducer is replaced by traceable ops (terra_torch/_data_parallel.py).
        reason = _data_parallel.unsupported(model)
        if reason is None:
            lowering = _data_parallel.Lowering(model)
            model.forward = lowering.forward  # type: ignore[method-assign]
        else:
            reason = f"DistributedDataParallel with {reason}; this model runs eagerly (DDP as usual)"
            warnings.warn(f"terra_torch.wrap: {reason}", stacklevel=2)
            program.run_eagerly(reason)
    elif (sparse := _sparse_gradient_module(model)) is not None:
        # Their backward makes sparse COO gradients; placeholders are strided tensors, so the
        # first co-executed backward would fail in the dispatcher (no kernel for a sparse tensor
        # of the placeholder backend).
        reason = (f"{sparse} makes sparse gradients (sparse=True), which co-execution does not support; "
                  "this model runs eagerly")
        warnings.warn(f"terra_torch.wrap: {reason}", stacklevel=2)
        program.run_eagerly(reason)
    elif (distributed := _distributed_wrapper(model)) is not None:
        # A data-parallel wrapper inside the model (or FSDP): its reducer runs in backward, reads
        # gradients' memory and launches collectives on them; correct results come first.
        reason = (f"{distributed} inside the wrapped module is not supported by co-execution (wrap the "
                  "DistributedDataParallel module itself: terra_torch.wrap(DDP(model))); this model runs eagerly")
        warnings.warn(f"terra_torch.wrap: {reason}", stacklevel=2)
        program.run_eagerly(reason)
    # Calls in eval mode or under no_grad (a validation pass, a generate() loop) are a program of
    # their own: their ops would otherwise be merged into the training step's TraceGraph, and
    # every switch between the two would be a divergence of it.
    evaluation: list[Program] = []

    def evaluation_program() -> Program:
        if not evaluation:
            evaluation.append(Program(f"{type(model).__name__} (eval)", mode, optimize, speed_check, folder,
                                      structure))
            program.evaluation = evaluation[0]
        return evaluation[0]

    inner_forward = model.forward  # the module's own (or the DDP lowering's, set above)

    # The iteration boundary is a forward wrapper, not a forward pre-hook: a module with a hook
    # takes torch's slow call path (Module._call_impl walks its hook dicts, ~3 us), while one
    # without calls forward at once. User pre-hooks run before the wrapper, so their ops belong
    # to the iteration the call ends; they do so in every iteration, which is what matters.
    @functools.wraps(inner_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)  # Module._call_impl, or whoever called forward directly
        if program.phase != "eager" and (outer := _calling_data_parallel(model, caller)) is not None:
            # DDP(terra_torch.wrap(model)): the reducer's hooks launch collectives on gradient
            # buckets inside backward, which interception cannot run (c10d ops have no kernel
            # for its key): the same eager fallback as terra_torch.wrap(DDP(model)).
            reason = (f"the wrapped model is called by {outer}, whose reducer runs collectives inside backward; "
                      "wrap the DistributedDataParallel module instead (terra_torch.wrap(DDP(model)) co-executes); "
                      "this model runs eagerly")
            warnings.warn(f"terra_torch.wrap: {reason}", stacklevel=2)
            program.synchronize()
            program.run_eagerly(reason)
        if runtime.stepped_aside_for_transform(program.name):
            return inner_forward(*args, **kwargs)
        target = program if model.training and torch.is_grad_enabled() else evaluation_program()
        target.begin(runtime._stop_frame(caller))
        return inner_forward(*args, **kwargs)

    def sync_all(*args: Any, **kwargs: Any) -> None:
        program.synchronize()
        if evaluation:
            evaluation[0].synchronize()

    model._terra_program = program  # type: ignore[attr-defined]
    model._terra_lowering = lowering  # type: ignore[attr-defined]
    model._terra_forward = own_forward  # type: ignore[attr-defined]
    model.forward = forward  # type: ignore[method-assign]
    model._terra_handles = [  # type: ignore[attr-defined]
        model.register_state_dict_pre_hook(sync_all),
        model._register_load_state_dict_pre_hook(sync_all),
    ]
    # (instance attributes: copy.deepcopy and pickle look __deepcopy__ and __reduce_ex__ up with
    # getattr on the object)
    model.__deepcopy__ = functools.partial(_copy_unwrapped, model)  # type: ignore[attr-defined]
    model.__reduce_ex__ = functools.partial(_reduce_unwrapped, model)  # type: ignore[method-assign]
    return model


# What wrap() adds to a module's __dict__ (unwrap() takes them back).
_WRAPPER_ATTRIBUTES = ("forward", "_terra_program", "_terra_lowering", "_terra_forward", "_terra_handles",
                       "__deepcopy__", "__reduce_ex__")


def _synchronize_programs(model: torch.nn.Module) -> None:
    program: Program = model._terra_program  # type: ignore[assignment]
    program.synchronize()
    if program.evaluation is not None:
        program.evaluation.synchronize()


def _reduce_unwrapped(model: torch.nn.Module, protocol: int) -> Any:
    """pickle of a wrapped module (`torch.save(model, path)`): what eager would write, an ordinary
    module. The wrapper's attributes (a local forward, the program with its worker thread) and its
    state_dict hooks cannot be pickled ("Can't pickle local object 'wrap.<locals>.sync_all'") and
    mean nothing in another process; the graph is waited for first, as for a copy."""
    _synchronize_programs(model)
    reduced = type(model).__reduce_ex__(model, protocol)
    if len(reduced) < 3 or not isinstance(reduced[2], dict):
        return reduced
    state = {k: v for k, v in reduced[2].items() if k not in _WRAPPER_ATTRIBUTES}
    own_forward = model.__dict__.get("_terra_forward")
    if own_forward is not None:  # the user's own forward attribute, as eager pickles it
        state["forward"] = own_forward
    ours = {h.id for h in model.__dict__.get("_terra_handles", ())}
    for name in ("_state_dict_pre_hooks", "_load_state_dict_pre_hooks"):
        if name in state:
            state[name] = type(state[name])((k, v) for k, v in state[name].items() if k not in ours)
    return (*reduced[:2], state, *reduced[3:])


def _copy_unwrapped(model: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    """copy.deepcopy of a wrapped module (torch.optim.swa_utils.AveragedModel, an EMA or a
    "best model" copy): an ordinary module holding what eager's copy would hold, not wrapped. The
    graph is waited for first, since it may still owe the parameters this iteration's updates;
    the copy shares nothing with the program (its worker thread, the graph's values)."""
    _synchronize_programs(model)
    saved = {k: model.__dict__.pop(k) for k in _WRAPPER_ATTRIBUTES if k in model.__dict__}
    try:
        twin = copy.deepcopy(model, memo)
    finally:
        model.__dict__.update(saved)
    if saved.get("_terra_forward") is not None:  # the user's own forward attribute, as eager copies it
        twin.__dict__["forward"] = saved["_terra_forward"]
    for handle in saved.get("_terra_handles", ()):
        twin._state_dict_pre_hooks.pop(handle.id, None)
        twin._load_state_dict_pre_hooks.pop(handle.id, None)
    return twin


_DATA_PARALLEL = ("DistributedDataParallel", "FullyShardedDataParallel")
_DISTRIBUTED = torch.distributed.is_available()  # (fixed for the process: asked once)


def _is_data_parallel(obj: Any) -> bool:
    name = type(obj).__name__
    return name in _DATA_PARALLEL or name.startswith("FSDP")


def _calling_data_parallel(module: torch.nn.Module, caller: FrameType) -> str | None:
    """The data-parallel wrapper whose forward is calling the wrapped model, if any: among the
    torch frames from `caller` (the frame that called the forward wrapper) up (DDP.forward ->
    _run_ddp_forward -> Module.__call__). Looked for only once torch.distributed is initialized,
    and only up to the first frame outside torch (the user's), so a program without one pays
    for two or three frames."""
    if not (_DISTRIBUTED and torch.distributed.is_initialized()):
        return None
    f: FrameType | None = caller
    for _ in range(8):
        if f is None or not f.f_code.co_filename.startswith(runtime._TORCH_DIR):
            break
        owner = f.f_locals.get("self")
        if owner is not None and owner is not module and _is_data_parallel(owner):
            return type(owner).__name__
        f = f.f_back
    return None


def _distributed_wrapper(model: torch.nn.Module) -> str | None:
    """The name of a data-parallel wrapper at or inside `model`, if any."""
    for m in model.modules():
        if _is_data_parallel(m):
            return type(m).__name__
    return None


def _sparse_gradient_module(model: torch.nn.Module) -> str | None:
    """The qualified name of a submodule whose backward makes sparse gradients, if any
    (nn.Embedding / nn.EmbeddingBag with sparse=True)."""
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            return f"{name or 'the model'} ({type(m).__name__})"
    return None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Finish the graph's work, give every placeholder its value, and run eagerly from now on."""
    program = _program_of(model)
    program.close()
    if program.evaluation is not None:
        program.evaluation.close()
    for h in model._terra_handles:  # type: ignore[attr-defined]
        h.remove()
    del model._terra_handles  # type: ignore[attr-defined]
    model.__dict__.pop("__deepcopy__", None)
    model.__dict__.pop("__reduce_ex__", None)
    # The forward the module had before wrap: its class's, or an instance attribute the user set
    # (DDP's own forward, and its reducer, again when it was lowered).
    own_forward = model.__dict__.pop("_terra_forward", None)
    if own_forward is not None:
        model.forward = own_forward  # type: ignore[method-assign]
    else:
        model.__dict__.pop("forward", None)
    lowering = getattr(model, "_terra_lowering", None)
    if lowering is not None:
        lowering.close()
        model._terra_lowering = None  # type: ignore[attr-defined]
    model._terra_program = None  # type: ignore[attr-defined]
    return model


def function(fn: F | None = None, *, mode: str = "coexec", optimize: bool | str = False,
             speed_check: bool = True, warm_start: bool | str | os.PathLike[str] | None = None) -> Any:
    """Decorator: each call of a training-step function starts an iteration (which runs until the
    next call, so reading its results between calls is part of the iteration). `mode`,
    `optimize`, `speed_check` and `warm_start` as for `wrap`."""
    _check_mode(mode)
    folder = _warm_start.directory_from(warm_start)

    def decorate(f: F) -> F:
        # Warm start: the entry is named at the first call, by the arguments it got then.
        first_call: list[Any] = []
        program = Program(getattr(f, "__qualname__", "function"), mode, optimize, speed_check, folder,
                          lambda: first_call[0])

        @functools.wraps(f)
        def step(*args: Any, **kwargs: Any) -> Any:
            if runtime.stepped_aside_for_transform(program.name):
                return f(*args, **kwargs)
            if folder is not None and not first_call:
                first_call.append(_warm_start.argument_structure(args, kwargs))
            program.begin(runtime._stop_frame())
            return f(*args, **kwargs)

        step._terra_program = program  # type: ignore[attr-defined]
        return step  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


def synchronize(obj: Any = None) -> None:
    """Wait for the graph: parameters and every live placeholder get their final values. With no
    argument, every program; ends the open iteration (the next call starts a new one)."""
    if obj is None:
        runtime.synchronize_all()
        _C.runtime.wait_direct()  # graphs of torch.compile(backend="terra") still running
    else:
        program = _program_of(obj)
        program.synchronize()
        if program.evaluation is not None:
            program.evaluation.synchronize()


def stats(obj: Any) -> Stats:
    """Iterations per phase, transitions, fallbacks, PythonRunner and GraphRunner exec/stall time
    of the training program; `.evaluation` holds the same for the calls a wrapped model got in
    eval mode or under no_grad (None if there were none)."""
    program = _program_of(obj)
    s = program.stats()
    s.evaluation = program.evaluation.stats() if program.evaluation is not None else None
    return s


def explain(obj: Any) -> Any:
    """What terra_torch did with a wrapped model or function: TraceGraph counts, the generated
    TorchScript graph, phase statistics and every fallback with its reason and source line.
    `.to_dot()` / `.save_png(path)` draw the TraceGraph."""
    return _program_of(obj).explain()


def timeline(obj: Any) -> Any:
    """Both runners' activity as a Chrome trace (`.save("t.json")`, open in ui.perfetto.dev)."""
    return _program_of(obj).timeline()


def _program_of(obj: Any) -> Program:
    program = getattr(obj, "_terra_program", None)
    if program is None:
        raise ValueError(f"terra_torch: {type(obj).__name__} is not wrapped by terra_torch.wrap / terra_torch.function")
    return program
