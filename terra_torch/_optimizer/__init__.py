"""optimizer.step() (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, Rprop) and
clip_grad_norm_ in co-execution without their Python (docs/RUNTIME.md, "optimizer.step() in
co-execution"; csrc/runtime/call_replay.h).

`torch.optim.SGD.step` issues the same in-place ops every iteration (`param.add_(grad,
alpha=-lr)`, with momentum `buf.mul_(momentum).add_(grad, alpha=1 - dampening)` first), and
`torch.nn.utils.clip_grad_norm_` the same norms and multiplications. In co-execution each of those
ops went through Python, the dispatcher and the per-op check only to hand the graph work it already
holds: 15-20% of the Python thread of the quick suite's SGD programs. `install()` puts stand-ins in
place of the optimizers' step bodies (under torch's profiling wrapper, so that step hooks and the
profiler's `record_function` run as always) and of `clip_grad_norm_`. While a co-executed iteration
is open a stand-in asks the program's runtime first: a call recorded before with the same key is
replayed (its ops' posts go to the graph, the tensors written get their version bumps, a returned
tensor is a new placeholder) and the body does not run; otherwise the body runs as always and the
runtime records what it did. Outside co-execution the stand-ins only forward.

The key the runtime cannot see for itself is the Python numbers the ops receive: they follow from
the hyperparameters (the param groups; clip's max_norm, norm_type and flags), compared by value
(floats bit for bit). Tensors are the runtime's to compare: each parameter, its gradient and its
optimizer state (or None). A call whose Python state changes (the first step, which makes the
momentum buffers) is not kept. Numbers that change every step (a scheduled learning rate, Adam's
bias corrections of the step count, Adagrad's step sizes) are computed by the stand-in from what
Python knows and passed along.

One file per family of keys: `keys.py` (what they share: the key's state and backoff, the
hyperparameters by value, step counters), `lr_passed.py` (SGD, RMSprop, Adadelta, Rprop: only the
learning rate changes), `adam_family.py` (Adam, AdamW, Adamax, NAdam, RAdam: step sizes from the
counters), `adagrad.py`, `clip.py`; the stand-in and `install()` here.

Not replayed (their step runs per op in co-execution, exact): ASGD (it reads `eta` and `mu`
tensors it refills from `torch.as_tensor` every step), LBFGS (a closure), SparseAdam (sparse
gradients), and every capturable or differentiable step.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch.optim import SGD, Adadelta, Adagrad, Adam, Adamax, NAdam, Optimizer, RAdam, RMSprop, Rprop

from terra_torch import runtime
from terra_torch._optimizer.adagrad import adagrad_key
from terra_torch._optimizer.adam_family import adam_key, adamax_key, nadam_key, radam_key
from terra_torch._optimizer.clip import clip_key
from terra_torch._optimizer.keys import KeyOf
from terra_torch._optimizer.lr_passed import adadelta_key, rmsprop_key, rprop_key, sgd_key

# TERRA_STEP_REPLAY=0 keeps every step() and clip_grad_norm_ on the per-op path (to compare).
enabled = os.environ.get("TERRA_STEP_REPLAY", "1") != "0"

# Each optimizer class whose step() gets a stand-in, with its key.
KEYS: tuple[tuple[type[Optimizer], KeyOf], ...] = (
    (SGD, sgd_key), (Adam, adam_key), (RMSprop, rmsprop_key), (Adagrad, adagrad_key), (Adadelta, adadelta_key),
    (Adamax, adamax_key), (NAdam, nadam_key), (RAdam, radam_key), (Rprop, rprop_key))


def _stand_in(body: Callable[..., Any], key_of: KeyOf) -> Callable[..., Any]:
    """`body` through the co-executing program's runtime: replayed where a recorded call has the
    key `key_of` gives, recorded where it has none yet, run as it is otherwise."""

    @functools.wraps(body)
    def call(*args: Any, **kwargs: Any) -> Any:
        program = runtime.active()
        path = key = None
        if enabled and program is not None and program.phase == "coexec" and program._region is not None and \
                not torch.compiler.is_compiling():
            try:
                args, kwargs, key = key_of(args, kwargs)
            except (AttributeError, KeyError, TypeError, ValueError):  # (an optimizer unlike torch's)
                key = None
            number = key.state.number(key.values) if key is not None else None
            region, session = program._region, program._session
            numbers = key.numbers(session) if number is not None and key.numbers is not None else ([], [])
            if number is not None and numbers is not None:
                path, replayed = session.call_begin(region, number, key.tensors, numbers[0], numbers[1])
                if path == "replayed":
                    return replayed
        completed = replayable = False
        result = None
        try:
            # One call site for every path: this frame is part of the location of each op of the
            # body (docs/LOCATIONS.md), so it must not differ between traced and co-executed
            # iterations.
            result = body(*args, **kwargs)
            completed = True
            if path == "recording":
                try:
                    after = key_of(args, kwargs)[2]
                except (AttributeError, KeyError, TypeError, ValueError):
                    after = None
                replayable = after is not None and after.values == key.values and \
                    len(after.tensors) == len(key.tensors) and \
                    all(a is b for a, b in zip(after.tensors, key.tensors)) and \
                    (result is None or isinstance(result, torch.Tensor))
            return result
        finally:
            if path == "recording":
                kept = session.call_end(region, completed, replayable,
                                        result if isinstance(result, torch.Tensor) else None)
                key.state.recorded(kept)

    call._terra_stand_in = True  # type: ignore[attr-defined]
    return call


def install() -> None:
    """Idempotent. Each optimizer's step body is replaced under torch's profiling wrapper whether or
    not one was made before (torch wraps the class's step at the first); clip_grad_norm_ where
    torch.nn.utils and its clip_grad module name it (a program that imported the name before
    terra_torch keeps torch's own)."""
    for cls, key_of in KEYS:
        current = cls.__dict__["step"]
        if getattr(current, "hooked", False):
            inner = current.__wrapped__
            if not getattr(inner, "_terra_stand_in", False):
                hooked = Optimizer.profile_hook_step(_stand_in(inner, key_of))
                hooked.hooked = True  # type: ignore[attr-defined]
                cls.step = hooked  # type: ignore[method-assign]
        elif not getattr(current, "_terra_stand_in", False):
            cls.step = _stand_in(current, key_of)  # type: ignore[method-assign]
    clip = torch.nn.utils.clip_grad.clip_grad_norm_
    if not getattr(clip, "_terra_stand_in", False):
        stand_in = _stand_in(clip, clip_key)
        torch.nn.utils.clip_grad.clip_grad_norm_ = stand_in
        if torch.nn.utils.clip_grad_norm_ is clip:
            torch.nn.utils.clip_grad_norm_ = stand_in
