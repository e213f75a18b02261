"""A program trained eagerly and under terra_torch.wrap from the same seed, compared bit for bit.

`make()` returns (module, optimizer or None); `step(model, opt, i)` runs iteration i and returns
(loss as a float or tensor, anything else to compare, such as output shapes). Used by
test_rnn_layers.py, test_restride_in_place.py, test_outputs_across_calls.py and
test_rng_state.py."""

from __future__ import annotations

import torch

import terra_torch


def train(terra: bool, make, step, steps: int):
    """(per-step results, final parameters, (stats, fallbacks) under terra else None)."""
    torch.manual_seed(0)
    model, opt = make()
    if terra:
        model = terra_torch.wrap(model)
    log = [step(model, opt, i) for i in range(steps)]
    info = None
    if terra:
        terra_torch.synchronize()
        info = (terra_torch.stats(model), list(model._terra_program.fallbacks))
        terra_torch.unwrap(model)
    return log, [p.detach().clone() for p in model.parameters()], info


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def check_bitwise(make, step, steps: int):
    """Asserts equal per-step results (the extras first: a shape error reads better; a loss may
    be a float or, where the program must not read values inside the loop, a tensor compared
    with torch.equal) and parameters; returns terra's (stats, fallbacks)."""
    la, pa, _ = train(False, make, step, steps)
    lb, pb, info = train(True, make, step, steps)
    assert [extra for _, extra in la] == [extra for _, extra in lb]
    assert all(_same(a, b) for (a, _), (b, _) in zip(la, lb)), [(a, b) for (a, _), (b, _) in zip(la, lb)]
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    return info
