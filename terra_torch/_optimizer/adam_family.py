"""The keys of Adam (and AdamW, which inherits its step), Adamax, NAdam and RAdam: optimizers whose
step sizes follow from their step counters, which Python knows (runtime/known_values.h), so the
stand-in computes them as the body would and passes them as the replay's numbers (docs/RUNTIME.md,
"optimizer.step() in co-execution")."""

from __future__ import annotations

from typing import Any

import torch

from terra_torch import runtime
from terra_torch._optimizer.keys import (COUNTER_DTYPES, Key, counted_group, counts_after, float32, key_state,
                                         keyed_with_betas)


# ---- Adam.step (AdamW's too: it inherits it) -----------------------------------------------------


def adam_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Key | None]:
    """What Adam's step (torch/optim/adam.py) reads: the hyperparameters by value, and per
    parameter the parameter, its gradient, its two moving averages, its amsgrad maximum and its
    step counter. The numbers its ops receive that change (the learning rate, beta1, and on the
    single-tensor and foreach paths the bias corrections of the step counters, which Python knows:
    runtime/known_values.h) are the key's numbers, per group in the order the ops receive them:

    - single-tensor (`_single_tensor_adam`, the CPU default), per parameter: AdamW's
      `1 - lr * weight_decay`, `1 - beta1`, `bias_correction2 ** 0.5`, `-lr / bias_correction1`;
    - foreach (`_multi_tensor_adam`, one device and dtype): the same, but the first two once for
      the group and the last two as lists (`_foreach_div_`'s and `_foreach_addcdiv_`'s scalars);
    - fused (`_fused_adam`): `lr` and `beta1`, which `_fused_adam_` receives as they are."""
    keyed = keyed_with_betas(args, kwargs)
    if keyed is None:
        return args, kwargs, None
    opt, values = keyed
    tensors: list[torch.Tensor | None] = []
    extend, states = tensors.extend, opt.state
    # Per group: (path, lr, beta1, beta2, decoupled weight decay or 0.0, step counters with a
    # gradient, their dtypes)
    groups: list[tuple[str, float, float, float, float, list[torch.Tensor], set[torch.dtype]]] = []
    for group in opt.param_groups:
        counted = counted_group(group, states, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), extend)
        if counted is None:
            return args, kwargs, None
        path = "fused" if group["fused"] else "foreach" if group["foreach"] else "single"
        beta1, beta2 = group["betas"]
        decay = group["weight_decay"] if group.get("decoupled_weight_decay") else 0.0
        groups.append((path, group["lr"], beta1, beta2, decay, *counted))

    def numbers(session: Any) -> tuple[list[float], list[tuple[torch.Tensor, float]]] | None:
        out: list[float] = []
        after: list[tuple[torch.Tensor, float]] = []
        for path, lr, beta1, beta2, decay, counters, counter_dtypes in groups:
            if not counters:
                continue
            if path == "fused":
                out += (lr, beta1)
                continue
            counts = counts_after(session, counters, counter_dtypes, after)
            if counts is None:
                return None
            # Per count: (bias_correction2 ** 0.5, -lr / bias_correction1); one where all are one.
            uniform = counts.count(counts[0]) == len(counts)
            corrections = [((1 - beta2 ** step) ** 0.5, -(lr / (1 - beta1 ** step)))
                           for step in (counts[:1] if uniform else counts)]
            if uniform:
                corrections *= len(counts)
            if path == "single":
                first = ((1 - lr * decay, 1 - beta1) if decay != 0  # AdamW: param.mul_(1 - lr * weight_decay)
                         else (1 - beta1,))  # exp_avg.lerp_(grad, 1 - beta1)
                if uniform:
                    out += (first + corrections[0]) * len(counts)
                else:
                    for correction in corrections:
                        out += first
                        out += correction
            else:
                if decay != 0:
                    out.append(1 - lr * decay)
                out.append(1 - beta1)
                out += (c[0] for c in corrections)
                out += (c[1] for c in corrections)
        return out, after

    return args, kwargs, Key(key_state(opt), tuple(values), tensors, numbers)


# ---- Adamax.step ---------------------------------------------------------------------------------


def adamax_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Key | None]:
    """What Adamax's step (torch/optim/adamax.py) reads: the hyperparameters by value (beta2
    among them), and per parameter the parameter, its gradient, its two averages and its step
    counter. Its numbers, per group in the order the ops receive them: `1 - beta1`
    (`exp_avg.lerp_`; OneCycleLR cycles beta1) and `-clr`, `clr = lr / (1 - beta1 ** step)` from
    the counter after `step_t += 1`, which Python knows (as Adam's bias corrections): per parameter
    on the single-tensor path (the CPU default; `param.addcdiv_(..., value=-clr)`), on the
    foreach path (one device and dtype per group) `1 - beta1` once and `-clr` as the list
    `_foreach_addcdiv_` receives."""
    keyed = keyed_with_betas(args, kwargs)
    if keyed is None:
        return args, kwargs, None
    opt, values = keyed
    tensors: list[torch.Tensor | None] = []
    extend, states = tensors.extend, opt.state
    # Per group: (foreach, lr, beta1, step counters with a gradient, their dtypes)
    groups: list[tuple[bool, float, float, list[torch.Tensor], set[torch.dtype]]] = []
    for group in opt.param_groups:
        counted = counted_group(group, states, ("exp_avg", "exp_inf"), extend)
        if counted is None:
            return args, kwargs, None
        groups.append((bool(group["foreach"]), group["lr"], group["betas"][0], *counted))

    def numbers(session: Any) -> tuple[list[float], list[tuple[torch.Tensor, float]]] | None:
        out: list[float] = []
        after: list[tuple[torch.Tensor, float]] = []
        for foreach, lr, beta1, counters, counter_dtypes in groups:
            if not counters:
                continue
            counts = counts_after(session, counters, counter_dtypes, after)
            if counts is None:
                return None
            clrs = [-(lr / (1 - beta1 ** step)) for step in counts]  # (-1 * (lr / x) on foreach: the same bits)
            if foreach:
                out.append(1 - beta1)
                out += clrs
            else:
                for clr in clrs:
                    out += (1 - beta1, clr)
        return out, after

    return args, kwargs, Key(key_state(opt), tuple(values), tensors, numbers)


# ---- NAdam.step ----------------------------------------------------------------------------------


def nadam_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Key | None]:
    """What NAdam's step (torch/optim/nadam.py) reads: the hyperparameters by value (beta2, eps,
    momentum_decay, the weight decay and its kind among them), and per parameter the parameter, its
    gradient, its two averages, its momentum product `mu_product` and its step counter.

    Besides the step counter, NAdam keeps a second small tensor Python knows: `mu_product *= mu`
    every step, where `mu = beta1 * (1 - 0.5 * 0.96 ** (step * momentum_decay))`, and the body
    reads it back (`_get_value(mu_product)`) for its step sizes. The stand-in computes the product
    as the kernel does (a float32 product rounds `mu` to float32 first, then the result) and
    teaches it with the counter (the replay's `after`). Its numbers, per group in the order the
    ops receive them:

    - single-tensor (the CPU default), per parameter: `1 - lr * weight_decay` (decoupled decay
      only), `mu` (`mu_product.mul_`), `1 - beta1` (`exp_avg.lerp_`), `bias_correction2`
      (`exp_avg_sq.div`), then `param.addcdiv_`'s two values `-lr * (1 - mu) / (1 - mu_product)`
      and `-lr * mu_next / (1 - mu_product * mu_next)`;
    - foreach (one device and dtype): `1 - lr * weight_decay` and `1 - beta1` once, then the
      lists `_foreach_mul_` (the mus), `_foreach_div_` (`bias_correction2 ** 0.5`) and the two
      `_foreach_addcdiv_` receive."""
    keyed = keyed_with_betas(args, kwargs)
    if keyed is None:
        return args, kwargs, None
    opt, values = keyed
    tensors: list[torch.Tensor | None] = []
    extend, states = tensors.extend, opt.state
    # Per group: (foreach, lr, beta1, beta2, momentum_decay, decoupled weight decay or 0.0, step
    # counters with a gradient, their dtypes, the momentum products of the same parameters)
    groups: list[tuple[bool, float, float, float, float, float, list[torch.Tensor], set[torch.dtype],
                       list[torch.Tensor]]] = []
    for group in opt.param_groups:
        start = len(tensors)
        counted = counted_group(group, states, ("exp_avg", "exp_avg_sq", "mu_product"), extend)
        if counted is None:
            return args, kwargs, None
        counters, counter_dtypes = counted
        beta1, beta2 = group["betas"]
        foreach = bool(group["foreach"])
        # (per parameter: parameter, gradient, exp_avg, exp_avg_sq, mu_product, step)
        products = [t for t in tensors[start + 4::6] if t is not None]
        if len(products) != len(counters) or any(t.dtype not in COUNTER_DTYPES for t in products):
            return args, kwargs, None
        decay = group["weight_decay"] if group["decoupled_weight_decay"] else 0.0
        groups.append((foreach, group["lr"], beta1, beta2, group["momentum_decay"], decay, counters,
                       counter_dtypes, products))

    def numbers(session: Any) -> tuple[list[float], list[tuple[torch.Tensor, float]]] | None:
        out: list[float] = []
        after: list[tuple[torch.Tensor, float]] = []
        for foreach, lr, beta1, beta2, momentum_decay, decay, counters, counter_dtypes, products in groups:
            if not counters:
                continue
            counts = counts_after(session, counters, counter_dtypes, after)
            known = session.known_numbers(products)
            if counts is None or None in known:
                return None
            mus, corrections, grad_sizes, avg_sizes = [], [], [], []
            for step, product, before in zip(counts, products, known):
                mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))
                mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * momentum_decay)))
                now = float32(before * float32(mu)) if product.dtype == torch.float32 else before * mu
                after.append((product, now))
                mus.append(mu)
                bias_correction2 = 1 - beta2 ** step
                if foreach:  # (torch/optim/nadam.py's _multi_tensor_nadam, as written there)
                    corrections.append(bias_correction2 ** 0.5)
                    grad_sizes.append((lr * (1.0 - mu) / (1.0 - now)) * -1)
                    avg_sizes.append((lr * mu_next / (1.0 - now * mu_next)) * -1)
                else:  # (_single_tensor_nadam)
                    corrections.append(bias_correction2)
                    grad_sizes.append(-lr * (1.0 - mu) / (1.0 - now))
                    avg_sizes.append((-lr * mu_next) / (1.0 - now * mu_next))
            if foreach:
                if decay != 0:
                    out.append(1 - lr * decay)
                out.append(1 - beta1)
                out += mus
                out += corrections
                out += grad_sizes
                out += avg_sizes
            else:
                first = (1 - lr * decay,) if decay != 0 else ()
                for k in range(len(mus)):
                    out += first
                    out += (mus[k], 1 - beta1, corrections[k], grad_sizes[k], avg_sizes[k])
        return out, after

    return args, kwargs, Key(key_state(opt), tuple(values), tensors, numbers)


# ---- RAdam.step ----------------------------------------------------------------------------------


def radam_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Key | None]:
    """What RAdam's step (torch/optim/radam.py) reads: the hyperparameters by value (beta2, eps,
    the weight decay and its kind among them), and per parameter the parameter, its gradient, its
    two averages and its step counter. Its numbers follow from the counters after `step_t += 1`
    (Python knows them) and the learning rate:

    - single-tensor (the CPU default): which ops run depends on the count, `rho_t > 5` (the
      variance is tractable: the rectified update, a few more ops) or not, so the key holds that
      flag per parameter by value (the first five or so steps take the plain update, every later
      one the rectified). Per parameter: `1 - lr * weight_decay` (decoupled decay only), `1 -
      beta1` (`exp_avg.lerp_`), `bias_correction1` (`exp_avg / bias_correction1`), `lr`, and where
      rectified `bias_correction2 ** 0.5` (`float / tensor` is `reciprocal() * float`) and the
      rectification term;
    - foreach (one device and dtype): the same ops every step (a rectification of 0 where
      `rho_t <= 5`): `1 - lr * weight_decay` and `1 - beta1` once, then the lists `_foreach_div_`
      and `_foreach_add_` receive."""
    keyed = keyed_with_betas(args, kwargs)
    if keyed is None:
        return args, kwargs, None
    opt, values = keyed
    program = runtime.active()
    session = program._session if program is not None else None
    if session is None:
        return args, kwargs, None
    tensors: list[torch.Tensor | None] = []
    extend, states = tensors.extend, opt.state
    out: list[float] = []
    after: list[tuple[torch.Tensor, float]] = []
    rectified: list[bool] = []
    for group in opt.param_groups:
        counted = counted_group(group, states, ("exp_avg", "exp_avg_sq"), extend)
        if counted is None:
            return args, kwargs, None
        counters, counter_dtypes = counted
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        foreach = bool(group["foreach"])
        if not counters:
            continue
        # The single-tensor path's ops depend on the counts: they are computed here, for the key,
        # not when the runtime asks for the numbers.
        counts = counts_after(session, counters, counter_dtypes, after)
        if counts is None:
            return args, kwargs, None
        decay = group["weight_decay"] if group["decoupled_weight_decay"] else 0.0
        rho_inf = 2 / (1 - beta2) - 1
        firsts = ((1 - lr * decay,) if decay != 0 else ()) + (1 - beta1,)
        if foreach:
            out += firsts
        divisors, addends = [], []
        for step in counts:  # (radam.py, as written there: the same operations in the same order)
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            rho_t = rho_inf - 2 * step * (beta2 ** step) / bias_correction2
            if foreach:
                rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5 \
                    if rho_t > 5 else 0
                unrectified = 0 if rect > 0 else 1.0
                addends.append((lr * unrectified / bias_correction1) * -1)
                divisors.append((bias_correction2 ** 0.5) * (lr * rect / bias_correction1) * -1)
                continue
            out += firsts
            out += (bias_correction1, lr)
            rectified.append(rho_t > 5.0)
            if rho_t > 5.0:
                rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
                out += (bias_correction2 ** 0.5, rect)
        out += divisors
        out += addends
    values.append(("rectified", tuple(rectified)))
    return args, kwargs, Key(key_state(opt), tuple(values), tensors, lambda session: (out, after))
