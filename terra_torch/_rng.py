"""Random generator state changes that no aten op sees.

In a co-executed iteration the graph's worker draws the random numbers (dropout masks,
`torch.randn`, sampling) from the user's generator, in program order but later than Python
issues them. `torch.manual_seed`, `torch.get_rng_state` and `torch.set_rng_state` act on the
generator directly, not through the dispatcher: run as they are, they would read or reseed it
while draws Python issued before them are still pending in the graph, and every later draw
would differ from eager. That is what `torch.utils.checkpoint` (it restores the forward's RNG
state to recompute dropout), `torch.random.fork_rng`, R-Drop style training and a
`torch.manual_seed` in the loop do.

These wrappers wait until the graph has run everything Python validated (`Session.catch_up`)
before the generator is touched, while a co-executed iteration is open; afterwards the graph's
random ops, which wait for Python's validation (they are gated), draw from the state as the
program left it. Otherwise a wrapper costs one attribute check. The CUDA module's functions
(`torch.cuda.manual_seed`, `get_rng_state`, ...) are wrapped the same way where CUDA is built.

Not covered: methods of a generator object (`g.manual_seed(s)`, `g.set_state(...)`,
`torch.default_generator.manual_seed(s)`): the Generator type cannot be patched. A program that
reseeds a generator its model draws from that way must call `terra_torch.synchronize()` first
(docs/RUNTIME.md, "Random generator state").
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.cuda
import torch.random

from terra_torch import _C, runtime

# (module, functions): each touches a generator's state without an aten op.
_STATE_FUNCTIONS = (
    (torch, ("manual_seed", "seed", "get_rng_state", "set_rng_state")),
    (torch.random, ("manual_seed", "seed", "get_rng_state", "set_rng_state")),
    (torch.cuda, ("manual_seed", "manual_seed_all", "seed", "seed_all", "get_rng_state", "get_rng_state_all",
                  "set_rng_state", "set_rng_state_all")),
)


def catch_up() -> None:
    """Wait until every graph that may draw random numbers has run what Python issued."""
    if _C.runtime.direct_pending():  # a deferred Dynamo-backend graph (docs/DYNAMO_BACKEND.md)
        _C.runtime.wait_direct()
    program = runtime.active()
    if program is not None and program._region_phase == "coexec":
        program.catch_up()


def _ordered(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def touch_generator(*args: Any, **kwargs: Any) -> Any:
        catch_up()
        return original(*args, **kwargs)

    touch_generator._terra_original = original  # type: ignore[attr-defined]
    return touch_generator


def install() -> None:
    """Wrap every function of _STATE_FUNCTIONS (once: a wrapped one is left as it is)."""
    wrapped: dict[int, Callable[..., Any]] = {}  # one wrapper per function (torch.seed is torch.random.seed)
    for module, names in _STATE_FUNCTIONS:
        for name in names:
            original = getattr(module, name, None)
            if original is None or hasattr(original, "_terra_original"):
                continue
            if id(original) not in wrapped:
                wrapped[id(original)] = _ordered(original)
            setattr(module, name, wrapped[id(original)])
