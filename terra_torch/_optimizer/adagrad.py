"""The key of Adagrad's step: its step sizes follow from the step counters, which Python knows
(docs/RUNTIME.md, "optimizer.step() in co-execution")."""

from __future__ import annotations

from typing import Any

import torch

from terra_torch._optimizer.keys import Key, counted_parameters, counts_after, hyperparameters, key_state, keyed_step


def adagrad_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Key | None]:
    """What Adagrad's step (torch/optim/adagrad.py) reads: the hyperparameters by value, and per
    parameter the parameter, its gradient, its sum of squares and its step counter. Its numbers
    are each parameter's `-clr`, `clr = lr / (1 + (step - 1) * lr_decay)` from the counter after
    `step_t += 1`, which Python knows (as Adam's bias corrections: runtime/known_values.h): the
    single-tensor path (the CPU default) gives it to `param.addcdiv_` per parameter, the foreach
    path (one device and dtype per group) to `_foreach_mul_` as a list. The fused op computes
    them itself from the counters: it receives `lr`, once per dtype."""
    opt = keyed_step(args, kwargs)
    if opt is None:
        return args, kwargs, None
    if any(group["differentiable"] or type(group["lr"]) is not float for group in opt.param_groups):
        return args, kwargs, None
    try:
        values = hyperparameters(opt, ("lr",))
    except TypeError:
        return args, kwargs, None
    tensors: list[torch.Tensor | None] = []
    extend, states = tensors.extend, opt.state
    # Per group: (fused, lr, lr_decay, step counters with a gradient, dtypes of those parameters,
    # of the counters)
    groups: list[tuple[bool, float, float, list[torch.Tensor], set[torch.dtype], set[torch.dtype]]] = []
    for group in opt.param_groups:
        counted = counted_parameters(group, states, ("sum",), extend)  # (Adagrad makes its state in __init__)
        if counted is None:
            return args, kwargs, None
        counters, dtypes, counter_dtypes = counted
        if group.get("foreach") and not group.get("fused") and len(dtypes) > 1:
            return args, kwargs, None  # (one list per dtype: the order of the lists is torch's)
        groups.append((bool(group.get("fused")), group["lr"], group["lr_decay"], counters, dtypes, counter_dtypes))

    def numbers(session: Any) -> tuple[list[float], list[tuple[torch.Tensor, float]]] | None:
        out: list[float] = []
        after: list[tuple[torch.Tensor, float]] = []
        for fused, lr, lr_decay, counters, dtypes, counter_dtypes in groups:
            if fused:
                out += [lr] * len(dtypes)
                continue
            counts = counts_after(session, counters, counter_dtypes, after)
            if counts is None:
                return None
            for step in counts:
                out.append(-lr / (1 + (step - 1) * lr_decay))  # (-(lr / x) in the single-tensor body: the same bits)
        return out, after

    return args, kwargs, Key(key_state(opt), tuple(values), tensors, numbers)
