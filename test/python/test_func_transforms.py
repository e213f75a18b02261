"""A wrapped model called under torch.func transforms (runtime.stepped_aside_for_transform):
those calls run eagerly, outside every capture region, after the open iterations end, and the
program's other calls keep co-executing. Bitwise against eager."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, jacrev, vmap

import terra_torch


def _dp_sgd(terra: bool, steps: int = 12):
    """Per-sample gradients (DP-SGD), clipped and averaged by hand, then an eval call and a
    plain training step of the same wrapped model."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = terra_torch.wrap(net) if terra else net
    opt = torch.optim.SGD(net.parameters(), lr=0.05)

    def loss_of(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x[None],)), y[None])

    log = []
    for step in range(steps):
        x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
        params = {k: v.detach() for k, v in net.named_parameters()}
        per_sample = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, y)
        with torch.no_grad():
            for k, p in net.named_parameters():
                g = per_sample[k]
                norms = g.flatten(1).norm(dim=1).clamp(min=1.0)
                p.add_((g / norms.view(-1, *[1] * (g.dim() - 1))).mean(0), alpha=-0.1)
            log.append(F.cross_entropy(model(x), y).item())  # an eval call
        loss = F.cross_entropy(model(x), y)  # a plain training step
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.append(loss.item())
    jac = jacrev(lambda inp: model(inp))(torch.ones(6))
    if terra:
        terra_torch.synchronize()
    return log, [p.detach().clone() for p in net.parameters()], jac, (terra_torch.stats(model) if terra else None)


def test_per_sample_gradients_through_a_wrapped_model(caplog):
    with caplog.at_level(logging.INFO, logger="terra_torch"):
        (la, pa, ja, _), (lb, pb, jb, st) = _dp_sgd(False), _dp_sgd(True)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert torch.equal(ja, jb)
    assert any("torch.func transform" in r.getMessage() for r in caplog.records)
    # The transformed calls cut no iteration short: the training steps and the eval calls
    # between them co-execute.
    assert st.iterations["eager"] == 0 and st.iterations["coexec"] >= 8, st.iterations
    assert st.evaluation.iterations["coexec"] >= 8, st.evaluation.iterations
