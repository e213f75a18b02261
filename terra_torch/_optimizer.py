"""optimizer.step() (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax) and clip_grad_norm_ in
co-execution without their Python (docs/RUNTIME.md, "optimizer.step() in co-execution";
csrc/runtime/call_replay.h).

`torch.optim.SGD.step` issues the same in-place ops every iteration (`param.add_(grad,
alpha=-lr)`, with momentum `buf.mul_(momentum).add_(grad, alpha=1 - dampening)` first), and
`torch.nn.utils.clip_grad_norm_` the same norms and multiplications. In co-execution each of those
ops went through Python, the dispatcher and the per-op check only to hand the graph work it already
holds: 15-20% of the Python thread of the quick suite's SGD programs. `install()` puts stand-ins in
place of SGD's step body (under torch's profiling wrapper, so that step hooks and the profiler's
`record_function` run as always) and of `clip_grad_norm_`. While a co-executed iteration is open a
stand-in asks the program's runtime first: a call recorded before with the same key is replayed
(its ops' posts go to the graph, the tensors written get their version bumps, a returned tensor is
a new placeholder) and the body does not run; otherwise the body runs as always and the runtime
records what it did. Outside co-execution the stand-ins only forward.

The key the runtime cannot see for itself is the Python numbers the ops receive: they follow from
the hyperparameters (the param groups; clip's max_norm, norm_type and flags), compared here by
value (floats bit for bit). Tensors are the runtime's to compare: each parameter, its gradient and
its optimizer state (or None). A call whose Python state changes (the first step, which makes the
momentum buffers) is not kept. Adam's numbers also change every step (bias corrections of the step
count), and so do Adagrad's step sizes: the stand-in computes them from the step counters Python
knows and passes them along.
"""

from __future__ import annotations

import functools
import itertools
import os
import struct
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch.optim import SGD, Adadelta, Adagrad, Adam, Adamax, Optimizer, RMSprop

from terra_torch import runtime

# TERRA_STEP_REPLAY=0 keeps every step() and clip_grad_norm_ on the per-op path (to compare).
enabled = os.environ.get("TERRA_STEP_REPLAY", "1") != "0"

# Hyperparameters a key may hold: numbers, flags and names, compared by value. Anything else (a
# tensor learning rate, which a scheduler may change in place) keeps the call on the per-op path.
_PLAIN = (bool, int, float, str, type(None))

# New hyperparameters in this many calls in a row (a learning rate scheduled every step), or this
# many recordings in a row the runtime did not keep: the stand-in stays on the per-op path for
# BACKOFF calls instead of recording a memo per call.
CHANGES_BEFORE_BACKOFF = 3
BACKOFF = 200
# Hyperparameter sets remembered per owner (a learning rate that cycles finds its memo again).
MAX_KEYS = 64

_numbers = itertools.count(1)


class _KeyState:
    """Per owner (an optimizer, or clip_grad_norm_): the key number of each hyperparameter set seen,
    and the backoff."""

    __slots__ = ("numbers", "new_in_a_row", "refused_in_a_row", "skip", "__weakref__")

    def __init__(self) -> None:
        self.numbers: dict[tuple[Any, ...], int] = {}
        self.new_in_a_row = 0
        self.refused_in_a_row = 0
        self.skip = 0

    def number(self, values: tuple[Any, ...]) -> int | None:
        """The key number of `values` (None: backing off)."""
        n = self.numbers.get(values)
        if n is None:
            if len(self.numbers) >= MAX_KEYS:
                self.numbers.clear()
            n = self.numbers[values] = next(_numbers)
            self.new_in_a_row += 1
            if self.new_in_a_row >= CHANGES_BEFORE_BACKOFF:
                self.new_in_a_row, self.skip = 0, BACKOFF
        else:
            self.new_in_a_row = 0
        if self.skip > 0:
            self.skip -= 1
            return None
        return n

    def recorded(self, kept: bool) -> None:
        self.refused_in_a_row = 0 if kept else self.refused_in_a_row + 1
        if self.refused_in_a_row >= CHANGES_BEFORE_BACKOFF:
            self.refused_in_a_row, self.skip = 0, BACKOFF


@dataclass
class _Key:
    state: _KeyState
    values: tuple[Any, ...]
    tensors: list[torch.Tensor | None]
    # For a body whose ops receive numbers that change every call: given the session, those
    # numbers in the order the ops use them, and the values of the small tensors it writes
    # (csrc/runtime/call_replay.h, CallMemo::numbers); None where they cannot be told.
    numbers: Callable[[Any], tuple[list[float], list[tuple[torch.Tensor, float]]] | None] | None = None


def _plain(v: Any) -> Any:
    """`v` as a key holds it (floats by their bits: -0.0 is not 0.0 here; a tuple of such, Adam's
    betas), or raises TypeError."""
    if type(v) is tuple:
        return tuple(_plain(e) for e in v)
    if type(v) not in _PLAIN:
        raise TypeError
    return v.hex() if type(v) is float else v


def _hyperparameters(opt: Optimizer, passed: tuple[str, ...] = ()) -> list[Any]:
    """Every param group's hyperparameters by value, but those in `passed`, which the key's numbers
    carry (raises TypeError where one is not plain)."""
    values: list[Any] = []
    append = values.append
    for group in opt.param_groups:  # (every step: a plain loop, _plain only for tuples)
        for name, v in group.items():
            if name == "params" or name in passed:
                continue
            kind = type(v)
            if kind is float:
                v = v.hex()
            elif kind is tuple:
                v = _plain(v)
            elif kind not in _PLAIN:
                raise TypeError
            append((name, v))
    return values


def _keyed_step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optimizer | None:
    """The optimizer of a step() call a key can stand for: no closure, nothing that makes the
    step differentiable or scaled."""
    opt = args[0]
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is not None or len(args) > 2 or any(k != "closure" for k in kwargs) or \
            opt.defaults.get("differentiable") or getattr(opt, "grad_scale", None) is not None or \
            getattr(opt, "found_inf", None) is not None:
        return None
    return opt


def _key_state(opt: Optimizer) -> _KeyState:
    state = _optimizer_keys.get(opt)
    if state is None:
        state = _optimizer_keys[opt] = _KeyState()
    return state


# ---- SGD, RMSprop and Adadelta -------------------------------------------------------------------

_optimizer_keys: "weakref.WeakKeyDictionary[Optimizer, _KeyState]" = weakref.WeakKeyDictionary()


def _step_path(group: dict[str, Any]) -> str | None:
    """Which body steps a param group of SGD, RMSprop or Adadelta (torch/optim/sgd.py and the
    like): "fused" (`_fused_sgd_`), "foreach" (`_multi_tensor_*`) or "single" (`_single_tensor_*`);
    None where torch's default would pick by device (foreach and fused unset, a parameter off the
    CPU: foreach on CUDA)."""
    if group.get("fused"):
        return "fused"
    if group.get("foreach"):
        return "foreach"
    if group.get("foreach") is False or all(p.is_cpu for p in group["params"]):  # (is_cpu: 4x device.type)
        return "single"
    return None


KeyOf = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any], "_Key | None"]]


def _lr_passed_key(state_names: tuple[str, ...]) -> KeyOf:
    """The key of an optimizer whose ops receive no Python number that changes but the learning
    rate: the hyperparameters by value, and per parameter the parameter, its gradient and its
    state `state_names` (None before the first step makes it: that call is not kept). The
    learning rate is the key's number, not part of it (a scheduler that sets a new one every step
    does not make every call new), in the order the ops receive it: the single-tensor path's
    `-lr` per parameter with a gradient (SGD's `param.add_(grad, alpha=-lr)`, RMSprop's
    `param.addcdiv_(grad, avg, value=-lr)`, Adadelta's `param.add_(delta, alpha=-lr)`); the
    foreach path's `-lr` (`_foreach_add_(params, ..., alpha=-lr)`) and fused SGD's `lr`
    (`_fused_sgd_(..., lr=lr)`) once per device and dtype of the group's parameters with a
    gradient (torch groups them so)."""

    def key_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], _Key | None]:
        opt = _keyed_step(args, kwargs)
        if opt is None or any(group.get("capturable") or group.get("differentiable")
                              for group in opt.param_groups):
            return args, kwargs, None
        paths = [_step_path(group) for group in opt.param_groups]
        # (an int learning rate stays in the key; a tensor one is no plain value: no key at all)
        passed = ("lr",) if None not in paths and all(type(g["lr"]) is float for g in opt.param_groups) else ()
        try:
            values = _hyperparameters(opt, passed)
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
                # (RMSprop and Adadelta step a complex parameter through real views of it, which
                # the replay could not name: such calls stay per op, SGD's too)
                if g.layout is not torch.strided or p.is_complex():
                    return args, kwargs, None
                state = states.get(p)
                extend(map(state.get, state_names) if state else none_state)
                with_grad += 1
                if buckets is not None:
                    buckets.add((p.device, p.dtype))
            if passed:
                lr = group["lr"]
                lrs += [-lr] * with_grad if buckets is None else [lr if path == "fused" else -lr] * len(buckets)
        if not lrs:
            return args, kwargs, _Key(_key_state(opt), tuple(values), tensors)
        return args, kwargs, _Key(_key_state(opt), tuple(values), tensors, lambda session: (lrs, []))

    return key_of


_sgd_key = _lr_passed_key(("momentum_buffer",))  # torch/optim/sgd.py
_rmsprop_key = _lr_passed_key(("square_avg", "grad_avg", "momentum_buffer", "step"))  # rmsprop.py
_adadelta_key = _lr_passed_key(("square_avg", "acc_delta", "step"))  # adadelta.py (counters: never read)


# ---- Adam.step (AdamW's too: it inherits it) -----------------------------------------------------


def _float32(x: float) -> float:
    """`x` rounded to float32, as `step_t += 1` on a float32 step counter rounds it."""
    return struct.unpack("f", struct.pack("f", x))[0]


_COUNTER_DTYPES = (torch.float32, torch.float64)


def _counts_after(session: Any, counters: list[torch.Tensor], counter_dtypes: set[torch.dtype],
                  after: list[tuple[torch.Tensor, float]]) -> list[float] | None:
    """The counts `counters` hold after the step's `step_t += 1`, from the values Python knows
    (runtime/known_values.h; None where it knows one not), as torch computes them (a float32
    counter rounds; float64 under torch.set_default_dtype(torch.float64)); each (counter, count)
    also goes to `after`, what the replay teaches. One computation where the group's counters hold
    one count (every parameter stepped every time)."""
    known = session.known_numbers(counters)
    if None in known:
        return None
    if len(counter_dtypes) == 1 and known.count(known[0]) == len(known):
        count = known[0] + 1.0
        counts = [_float32(count) if torch.float32 in counter_dtypes else count] * len(known)
    else:
        counts = [_float32(before + 1.0) if counter.dtype == torch.float32 else before + 1.0
                  for counter, before in zip(counters, known)]
    after += zip(counters, counts)
    return counts


def _keyed_with_betas(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Optimizer, list[Any]] | None:
    """For Adam and Adamax: the optimizer of a step() call a key can stand for, and its
    hyperparameters by value but the learning rate and beta1, which reach the ops only through the
    key's numbers (OneCycleLR cycles beta1); beta2 is keyed by value. None where there is no key."""
    opt = _keyed_step(args, kwargs)
    if opt is None:
        return None
    try:
        values = _hyperparameters(opt, ("lr", "betas"))
        values += (("beta2", _plain(group["betas"][1])) for group in opt.param_groups)
    except TypeError:
        return None
    return opt, values


def _counted_parameters(group: dict[str, Any], states: Any, state_names: tuple[str, ...],
                        extend: Callable[[Any], None]) -> tuple[list[torch.Tensor], set[torch.dtype], set[torch.dtype]] | None:
    """The key's tensors of a param group of an optimizer with step counters (Adam, Adagrad,
    Adamax), onto `extend`: per parameter the parameter, its gradient, its state `state_names`
    (None where absent) and its step counter. Returns the counters of the parameters with a
    gradient, their parameters' dtypes and the counters' dtypes; None where the replay cannot
    name the step: no state yet (the first step makes it), a gradient not strided, a complex
    parameter (stepped through real views), a parameter off the CPU (foreach may be the default
    there), a counter neither float32 nor float64. Once per parameter every step: no generator, no
    tuple built per parameter, `is_cpu` (as in _lr_passed_key)."""
    counters: list[torch.Tensor] = []
    dtypes: set[torch.dtype] = set()
    counter_dtypes: set[torch.dtype] = set()
    none = (None,) * (len(state_names) + 1)
    for p in group["params"]:
        g = p.grad
        if g is None:
            extend((p, None))
            extend(none)
            continue
        state = states.get(p)
        if not state or g.layout is not torch.strided or p.is_complex() or not p.is_cpu:
            return None
        step = state["step"]
        if step.dtype not in _COUNTER_DTYPES:
            return None
        dtypes.add(p.dtype)
        counter_dtypes.add(step.dtype)
        extend((p, g))
        extend(map(state.get, state_names))
        extend((step,))
        counters.append(step)
    return counters, dtypes, counter_dtypes


def _adam_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], _Key | None]:
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
    keyed = _keyed_with_betas(args, kwargs)
    if keyed is None:
        return args, kwargs, None
    opt, values = keyed
    tensors: list[torch.Tensor | None] = []
    extend, states = tensors.extend, opt.state
    # Per group: (path, lr, beta1, beta2, decoupled weight decay or 0.0, step counters with a
    # gradient, their dtypes)
    groups: list[tuple[str, float, float, float, float, list[torch.Tensor], set[torch.dtype]]] = []
    for group in opt.param_groups:
        # Capturable and differentiable steps compute their numbers as tensors.
        if group["capturable"] or group["differentiable"]:
            return args, kwargs, None
        path = "fused" if group["fused"] else "foreach" if group["foreach"] else "single"
        beta1, beta2 = group["betas"]
        if type(group["lr"]) not in (float, int) or type(beta1) not in (float, int):
            return args, kwargs, None  # (a tensor learning rate or beta1: numbers it cannot pass)
        decay = group["weight_decay"] if group.get("decoupled_weight_decay") else 0.0
        counted = _counted_parameters(group, states, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), extend)
        if counted is None:
            return args, kwargs, None
        counters, dtypes, counter_dtypes = counted
        if path == "foreach" and len(dtypes) > 1:
            return args, kwargs, None  # (the foreach path groups parameters by dtype, one list each)
        groups.append((path, group["lr"], beta1, beta2, decay, counters, counter_dtypes))

    def numbers(session: Any) -> tuple[list[float], list[tuple[torch.Tensor, float]]] | None:
        out: list[float] = []
        after: list[tuple[torch.Tensor, float]] = []
        for path, lr, beta1, beta2, decay, counters, counter_dtypes in groups:
            if not counters:
                continue
            if path == "fused":
                out += (lr, beta1)
                continue
            counts = _counts_after(session, counters, counter_dtypes, after)
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

    return args, kwargs, _Key(_key_state(opt), tuple(values), tensors, numbers)


# ---- Adagrad.step --------------------------------------------------------------------------------


def _adagrad_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], _Key | None]:
    """What Adagrad's step (torch/optim/adagrad.py) reads: the hyperparameters by value, and per
    parameter the parameter, its gradient, its sum of squares and its step counter. Its numbers
    are each parameter's `-clr`, `clr = lr / (1 + (step - 1) * lr_decay)` from the counter after
    `step_t += 1`, which Python knows (as Adam's bias corrections: runtime/known_values.h): the
    single-tensor path (the CPU default) gives it to `param.addcdiv_` per parameter, the foreach
    path (one device and dtype per group) to `_foreach_mul_` as a list. The fused op computes
    them itself from the counters: it receives `lr`, once per dtype."""
    opt = _keyed_step(args, kwargs)
    if opt is None:
        return args, kwargs, None
    if any(group["differentiable"] or type(group["lr"]) is not float for group in opt.param_groups):
        return args, kwargs, None
    try:
        values = _hyperparameters(opt, ("lr",))
    except TypeError:
        return args, kwargs, None
    tensors: list[torch.Tensor | None] = []
    extend, states = tensors.extend, opt.state
    # Per group: (fused, lr, lr_decay, step counters with a gradient, dtypes of those parameters,
    # of the counters)
    groups: list[tuple[bool, float, float, list[torch.Tensor], set[torch.dtype], set[torch.dtype]]] = []
    for group in opt.param_groups:
        counted = _counted_parameters(group, states, ("sum",), extend)  # (Adagrad makes its state in __init__)
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
            counts = _counts_after(session, counters, counter_dtypes, after)
            if counts is None:
                return None
            for step in counts:
                out.append(-lr / (1 + (step - 1) * lr_decay))  # (-(lr / x) in the single-tensor body: the same bits)
        return out, after

    return args, kwargs, _Key(_key_state(opt), tuple(values), tensors, numbers)


# ---- Adamax.step ---------------------------------------------------------------------------------


def _adamax_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], _Key | None]:
    """What Adamax's step (torch/optim/adamax.py) reads: the hyperparameters by value (beta2
    among them), and per parameter the parameter, its gradient, its two averages and its step
    counter. Its numbers, per group in the order the ops receive them: `1 - beta1`
    (`exp_avg.lerp_`; OneCycleLR cycles beta1) and `-clr`, `clr = lr / (1 - beta1 ** step)` from
    the counter after `step_t += 1`, which Python knows (as Adam's bias corrections): per parameter
    on the single-tensor path (the CPU default; `param.addcdiv_(..., value=-clr)`), on the
    foreach path (one device and dtype per group) `1 - beta1` once and `-clr` as the list
    `_foreach_addcdiv_` receives."""
    keyed = _keyed_with_betas(args, kwargs)
    if keyed is None:
        return args, kwargs, None
    opt, values = keyed
    tensors: list[torch.Tensor | None] = []
    extend, states = tensors.extend, opt.state
    # Per group: (foreach, lr, beta1, step counters with a gradient, their dtypes)
    groups: list[tuple[bool, float, float, list[torch.Tensor], set[torch.dtype]]] = []
    for group in opt.param_groups:
        beta1 = group["betas"][0]
        if group["capturable"] or group["differentiable"] or type(group["lr"]) not in (float, int) or \
                type(beta1) not in (float, int):
            return args, kwargs, None  # (numbers as tensors, or a tensor lr or beta1: numbers it cannot pass)
        counted = _counted_parameters(group, states, ("exp_avg", "exp_inf"), extend)
        if counted is None:
            return args, kwargs, None
        counters, dtypes, counter_dtypes = counted
        foreach = bool(group["foreach"])
        if foreach and len(dtypes) > 1:
            return args, kwargs, None  # (one list per dtype: the order of the lists is torch's)
        groups.append((foreach, group["lr"], beta1, counters, counter_dtypes))

    def numbers(session: Any) -> tuple[list[float], list[tuple[torch.Tensor, float]]] | None:
        out: list[float] = []
        after: list[tuple[torch.Tensor, float]] = []
        for foreach, lr, beta1, counters, counter_dtypes in groups:
            if not counters:
                continue
            counts = _counts_after(session, counters, counter_dtypes, after)
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

    return args, kwargs, _Key(_key_state(opt), tuple(values), tensors, numbers)


# ---- clip_grad_norm_ -----------------------------------------------------------------------------

_CLIP_ARGUMENTS = ("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach")
_clip_keys = _KeyState()


def _clip_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], _Key | None]:
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
        values = tuple(_plain(bound.get(name, default))
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
    return args, kwargs, _Key(_clip_keys, values, grads)


# ---- the stand-ins -------------------------------------------------------------------------------


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
    for cls, key_of in ((SGD, _sgd_key), (Adam, _adam_key), (RMSprop, _rmsprop_key), (Adagrad, _adagrad_key),
                        (Adadelta, _adadelta_key), (Adamax, _adamax_key)):
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
        stand_in = _stand_in(clip, _clip_key)
        torch.nn.utils.clip_grad.clip_grad_norm_ = stand_in
        if torch.nn.utils.clip_grad_norm_ is clip:
            torch.nn.utils.clip_grad_norm_ = stand_in
