"""The key of torch.nn.utils.clip_grad_norm_ (docs/RUNTIME.md, "optimizer.step() in co-execution")."""

from __future__ import annotations

import types
from typing import Any

import torch

from terra_torch._optimizer.keys import Key, KeyState, plain


_CLIP_ARGUMENTS = ("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach")
_clip_keys = KeyState()


def clip_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Key | None]:
    """What clip_grad_norm_ reads: max_norm, norm_type and the flags by value, and each parameter's
    gradient. An iterable of parameters becomes a list (passed on to the body: it is read twice)."""
    if len(args) > len(_CLIP_ARGUMENTS) or any(k not in _CLIP_ARGUMENTS for k in kwargs):
        return args, kwargs, None
    bound = dict(zip(_CLIP_ARGUMENTS, args))
    bound.update(kwargs)
    if "parameters" not in bound or "max_norm" not in bound or bound.get("error_if_nonfinite"):
        return args, kwargs, None  # (error_if_nonfinite reads the norm: never replayable)
    parameters = bound["parameters"]
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    elif isinstance(parameters, (list, tuple, types.GeneratorType)):
        parameters = list(parameters)
    else:
        return args, kwargs, None
    if not parameters:  # (the body as called: it warns about an empty generator, now exhausted too)
        return args, kwargs, None
    if args:
        args = (parameters,) + args[1:]
    else:
        kwargs = {**kwargs, "parameters": parameters}
    try:
        values = tuple(plain(bound.get(name, default))
                       for name, default in zip(_CLIP_ARGUMENTS[1:], (None, 2.0, False, None)))
    except TypeError:
        return args, kwargs, None
    grads: list[torch.Tensor | None] = []
    append, strided, tensor = grads.append, torch.strided, torch.Tensor
    for p in parameters:  # (one pass: a transformer passes a few hundred parameters every step)
        if not isinstance(p, tensor):
            return args, kwargs, None
        g = p.grad
        if g is not None and g.layout is not strided:
            return args, kwargs, None
        append(g)
    return args, kwargs, Key(_clip_keys, values, grads)
