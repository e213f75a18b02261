"""A program trained eagerly and under terra_torch.wrap from the same seed, compared bit for bit.

`make()` returns (module, optimizer or None); `step(model, opt, i)` runs iteration i and returns
(loss as a float, anything else to compare, such as output shapes). Used by test_rnn_layers.py
and test_restride_in_place.py."""

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


def check_bitwise(make, step, steps: int):
    """Asserts equal per-step results (the extras first: a shape error reads better) and
    parameters; returns terra's (stats, fallbacks)."""
    la, pa, _ = train(False, make, step, steps)
    lb, pb, info = train(True, make, step, steps)
    assert [extra for _, extra in la] == [extra for _, extra in lb]
    assert [loss for loss, _ in la] == [loss for loss, _ in lb]
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    return info
