"""The keys of SGD, RMSprop, Adadelta and Rprop: optimizers whose ops receive no Python number that
changes from step to step but the learning rate (docs/RUNTIME.md, "optimizer.step() in
co-execution")."""

from __future__ import annotations

from typing import Any

import torch

from terra_torch._optimizer.keys import Key, KeyOf, hyperparameters, key_state, keyed_step


def _step_path(group: dict[str, Any]) -> str | None:
    """Which body steps a param group of SGD, RMSprop, Adadelta or Rprop (torch/optim/sgd.py and
    the like): "fused" (`_fused_sgd_`), "foreach" (`_multi_tensor_*`) or "single" (`_single_tensor_*`);
    None where torch's default would pick by device (foreach and fused unset, a parameter off the
    CPU: foreach on CUDA)."""
    if group.get("fused"):
        return "fused"
    if group.get("foreach"):
        return "foreach"
    if group.get("foreach") is False or all(p.is_cpu for p in group["params"]):  # (is_cpu: 4x device.type)
        return "single"
    return None


def lr_passed_key(state_names: tuple[str, ...], lr_reaches_ops: bool = True) -> KeyOf:
    """The key of an optimizer whose ops receive no Python number that changes but the learning
    rate: the hyperparameters by value, and per parameter the parameter, its gradient and its
    state `state_names` (None before the first step makes it: that call is not kept). The
    learning rate is the key's number, not part of it (a scheduler that sets a new one every step
    does not make every call new), in the order the ops receive it: the single-tensor path's
    `-lr` per parameter with a gradient (SGD's `param.add_(grad, alpha=-lr)`, RMSprop's
    `param.addcdiv_(grad, avg, value=-lr)`, Adadelta's `param.add_(delta, alpha=-lr)`); the
    foreach path's `-lr` (`_foreach_add_(params, ..., alpha=-lr)`) and fused SGD's `lr`
    (`_fused_sgd_(..., lr=lr)`) once per device and dtype of the group's parameters with a
    gradient (torch groups them so). `lr_reaches_ops=False`: no op of the step receives the
    learning rate (Rprop's, which only sets the first step sizes when the state is made, in a
    call that is never kept): it is neither a number nor part of the key."""

    def key_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Key | None]:
        opt = keyed_step(args, kwargs)
        if opt is None or any(group.get("capturable") or group.get("differentiable")
                              for group in opt.param_groups):
            return args, kwargs, None
        paths = [_step_path(group) for group in opt.param_groups]
        # (an int learning rate stays in the key; a tensor one is no plain value: no key at all)
        if not lr_reaches_ops:
            passed: tuple[str, ...] = ("lr",)
        elif None not in paths and all(type(g["lr"]) is float for g in opt.param_groups):
            passed = ("lr",)
        else:
            passed = ()
        try:
            values = hyperparameters(opt, passed)
        except TypeError:
            return args, kwargs, None
        # Every step runs this loop once per parameter, so it is written for speed (measured with
        # timeit, 6 parameters: 10 us with a generator per parameter, 5.7 us so): no generator, the
        # bound methods looked up once, the (device, dtype) buckets only where they are used.
        tensors: list[torch.Tensor | None] = []
        append, extend, states = tensors.append, tensors.extend, opt.state
        none_state = (None,) * len(state_names)
        lrs: list[float] = []
        for group, path in zip(opt.param_groups, paths):
            buckets = set() if path != "single" else None
            with_grad = 0
            for p in group["params"]:
                g = p.grad
                append(p)
                append(g)
                if g is None:
                    extend(none_state)
                    continue
                # (RMSprop, Adadelta and Rprop step a complex parameter through real views of it,
                # which the replay could not name: such calls stay per op, SGD's too)
                if g.layout is not torch.strided or p.is_complex():
                    return args, kwargs, None
                state = states.get(p)
                extend(map(state.get, state_names) if state else none_state)
                with_grad += 1
                if buckets is not None:
                    buckets.add((p.device, p.dtype))
            if passed and lr_reaches_ops:
                lr = group["lr"]
                lrs += [-lr] * with_grad if buckets is None else [lr if path == "fused" else -lr] * len(buckets)
        if not lrs:
            return args, kwargs, Key(key_state(opt), tuple(values), tensors)
        return args, kwargs, Key(key_state(opt), tuple(values), tensors, lambda session: (lrs, []))

    return key_of


sgd_key = lr_passed_key(("momentum_buffer",))  # torch/optim/sgd.py
rmsprop_key = lr_passed_key(("square_avg", "grad_avg", "momentum_buffer", "step"))  # rmsprop.py
adadelta_key = lr_passed_key(("square_avg", "acc_delta", "step"))  # adadelta.py (counters: never read)
# rprop.py: per parameter the same ops every step (signs of grad * prev, masked writes of the step
# sizes, a clamp); its counters are written, never read, and the learning rate reaches no op.
rprop_key = lr_passed_key(("prev", "step_size", "step"), lr_reaches_ops=False)
