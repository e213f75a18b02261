"""What the stand-ins of optimizer steps share (terra_torch/_optimizer/__init__.py): a key's state
per owner and its backoff, the hyperparameters by value, and for the optimizers with step counters
(Adam, Adagrad, Adamax, NAdam, RAdam) the counters' next values as torch computes them."""

from __future__ import annotations

import itertools
import struct
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.optim import Optimizer

# Hyperparameters a key may hold: numbers, flags and names, compared by value. Anything else (a
# tensor learning rate, which a scheduler may change in place) keeps the call on the per-op path.
PLAIN = (bool, int, float, str, type(None))

# New hyperparameters in this many calls in a row (a learning rate scheduled every step), or this
# many recordings in a row the runtime did not keep: the stand-in stays on the per-op path for
# BACKOFF calls instead of recording a memo per call.
CHANGES_BEFORE_BACKOFF = 3
BACKOFF = 200
# Hyperparameter sets remembered per owner (a learning rate that cycles finds its memo again).
MAX_KEYS = 64

_numbers = itertools.count(1)


class KeyState:
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
class Key:
    state: KeyState
    values: tuple[Any, ...]
    tensors: list[torch.Tensor | None]
    # For a body whose ops receive numbers that change every call: given the session, those
    # numbers in the order the ops use them, and the values of the small tensors it writes
    # (csrc/runtime/call_replay.h, CallMemo::numbers); None where they cannot be told.
    numbers: Callable[[Any], tuple[list[float], list[tuple[torch.Tensor, float]]] | None] | None = None


# A stand-in's key function: (args, kwargs) of the call -> (args, kwargs) to call the body with, and
# the call's key (None: the call runs as it is).
KeyOf = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any], "Key | None"]]


def plain(v: Any) -> Any:
    """`v` as a key holds it (floats by their bits: -0.0 is not 0.0 here; a tuple of such, Adam's
    betas), or raises TypeError."""
    if type(v) is tuple:
        return tuple(plain(e) for e in v)
    if type(v) not in PLAIN:
        raise TypeError
    return v.hex() if type(v) is float else v


def hyperparameters(opt: Optimizer, passed: tuple[str, ...] = ()) -> list[Any]:
    """Every param group's hyperparameters by value, but those in `passed`, which the key's numbers
    carry (raises TypeError where one is not plain)."""
    values: list[Any] = []
    append = values.append
    for group in opt.param_groups:  # (every step: a plain loop, plain only for tuples)
        for name, v in group.items():
            if name == "params" or name in passed:
                continue
            kind = type(v)
            if kind is float:
                v = v.hex()
            elif kind is tuple:
                v = plain(v)
            elif kind not in PLAIN:
                raise TypeError
            append((name, v))
    return values


def keyed_step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optimizer | None:
    """The optimizer of a step() call a key can stand for: no closure, nothing that makes the
    step differentiable or scaled."""
    opt = args[0]
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is not None or len(args) > 2 or any(k != "closure" for k in kwargs) or \
            opt.defaults.get("differentiable") or getattr(opt, "grad_scale", None) is not None or \
            getattr(opt, "found_inf", None) is not None:
        return None
    return opt


_optimizer_keys: "weakref.WeakKeyDictionary[Optimizer, KeyState]" = weakref.WeakKeyDictionary()


def key_state(opt: Optimizer) -> KeyState:
    state = _optimizer_keys.get(opt)
    if state is None:
        state = _optimizer_keys[opt] = KeyState()
    return state


# ---- step counters -------------------------------------------------------------------------------


def float32(x: float) -> float:
    """`x` rounded to float32, as `step_t += 1` on a float32 step counter rounds it."""
    return struct.unpack("f", struct.pack("f", x))[0]


COUNTER_DTYPES = (torch.float32, torch.float64)


def counts_after(session: Any, counters: list[torch.Tensor], counter_dtypes: set[torch.dtype],
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
        counts = [float32(count) if torch.float32 in counter_dtypes else count] * len(known)
    else:
        counts = [float32(before + 1.0) if counter.dtype == torch.float32 else before + 1.0
                  for counter, before in zip(counters, known)]
    after += zip(counters, counts)
    return counts


def keyed_with_betas(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Optimizer, list[Any]] | None:
    """For Adam and Adamax: the optimizer of a step() call a key can stand for, and its
    hyperparameters by value but the learning rate and beta1, which reach the ops only through the
    key's numbers (OneCycleLR cycles beta1); beta2 is keyed by value. None where there is no key."""
    opt = keyed_step(args, kwargs)
    if opt is None:
        return None
    try:
        values = hyperparameters(opt, ("lr", "betas"))
        values += (("beta2", plain(group["betas"][1])) for group in opt.param_groups)
    except TypeError:
        return None
    return opt, values


def counted_parameters(group: dict[str, Any], states: Any, state_names: tuple[str, ...],
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
        if step.dtype not in COUNTER_DTYPES:
            return None
        dtypes.add(p.dtype)
        counter_dtypes.add(step.dtype)
        extend((p, g))
        extend(map(state.get, state_names))
        extend((step,))
        counters.append(step)
    return counters, dtypes, counter_dtypes


def counted_group(group: dict[str, Any], states: Any, state_names: tuple[str, ...],
                  extend: Callable[[Any], None]) -> tuple[list[torch.Tensor], set[torch.dtype]] | None:
    """For Adam, Adamax, NAdam and RAdam, one param group: its tensors onto `extend`
    (counted_parameters), and the step counters of its parameters with a gradient with their
    dtypes. None where the group's step cannot be keyed: capturable or differentiable (the
    numbers are tensors then), a learning rate or beta1 that is no Python number (a tensor a
    scheduler writes), a parameter counted_parameters refuses, or a foreach group over several
    dtypes (one list per dtype, in torch's order)."""
    if group["capturable"] or group["differentiable"] or type(group["lr"]) not in (float, int) or \
            type(group["betas"][0]) not in (float, int):
        return None
    counted = counted_parameters(group, states, state_names, extend)
    if counted is None:
        return None
    counters, dtypes, counter_dtypes = counted
    if group["foreach"] and len(dtypes) > 1:
        return None
    return counters, counter_dtypes
