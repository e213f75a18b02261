"""Every op the dispatcher runs can be emitted (issue 16, item 5): an op TorchScript's schema
matching refuses for its recorded arguments is called boxed in the graph, and an op the graph
cannot express at all costs only the paths through it, never the whole program."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch
from terra_torch import runtime

import pytest

STEPS = 60


@pytest.fixture(autouse=True)
def _isolated():
    yield
    runtime.close_all()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _train(terra: bool, step_body, steps: int = STEPS):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if terra:
        model = terra_torch.wrap(model)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]
    losses = []
    for i in range(steps):
        x, y = data[i % len(data)]
        loss = step_body(model, x, y, i)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    info = None
    if terra:
        terra_torch.synchronize()
        info = (terra_torch.stats(model), list(model._terra_program.fallbacks), model._terra_program.phase,
                model._terra_program.graph_text)
        terra_torch.unwrap(model)
    return [float(v) for v in losses], [p.detach().clone() for p in model.parameters()], info


def test_full_with_a_bool_fill_value_co_executes_bitwise():
    # aten::full(int[], Scalar fill, ...) with fill=True: a TorchScript Scalar is int, float or
    # complex, so schema matching finds no operator for (int[], bool, ...); eager runs it fine.
    def body(model, x, y, i):
        mask = torch.full((4, 1), True)
        out = model(x)
        return F.mse_loss(torch.where(mask, out, torch.zeros_like(out)), y)

    (la, pa, _), (lb, pb, (st, fallbacks, phase, text)) = _train(False, body), _train(True, body)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert phase == "coexec", st.transitions
    assert st.iterations["eager"] == 0
    assert st.iterations["coexec"] >= 0.8 * (STEPS - 5), st.iterations
    assert len(fallbacks) == 0, fallbacks
    assert "terra::boxed_call" in text  # the op the JIT refused, called through its handle


def test_several_boxed_ops_in_one_graph_each_run_their_own_operator():
    # Two ops called boxed in one graph (bool scalars: `t & True`, then torch.full(..., False)),
    # as transformers' beam search and no_repeat_ngram_size do. TorchScript's interpreter keeps
    # one Operation per operator name and input count, so an Operation bound to the first node's
    # operator ran aten::full as aten::bitwise_and ("Expected Tensor but got Device").
    def body(model, x, y, i):
        out = model(x)
        positive = torch.all(out > 0, dim=-1, keepdim=True) & True
        done = torch.full((4,), False, dtype=torch.bool)
        return F.mse_loss(out.masked_fill(positive | done[:, None], 0.0), y)

    (la, pa, _), (lb, pb, (st, fallbacks, phase, text)) = _train(False, body), _train(True, body)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert text.count("terra::boxed_call") >= 2
    assert st.iterations["coexec"] >= 0.8 * (STEPS - 5), st.iterations
    assert len(fallbacks) == 0, fallbacks


def test_an_op_the_graph_cannot_express_costs_only_its_path(caplog):
    # A new torch.Generator object every 3rd step, passed to an op with a tensor argument (so
    # the graph draws for it; capture/draw_side.h), cannot be baked into a graph. Only
    # the iterations that draw from one run eagerly (from that op on), with the reason; the
    # others co-execute, and the program never goes eager for good.
    def body(model, x, y, i):
        if i % 3 == 0:
            x = x * torch.bernoulli(torch.full((4, 8), 0.9), generator=torch.Generator().manual_seed(i))
        return F.mse_loss(model(x), y)

    with caplog.at_level(logging.WARNING, logger="terra_torch"):
        (la, pa, _), (lb, pb, (st, fallbacks, phase, _)) = _train(False, body), _train(True, body)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert phase == "coexec"
    assert st.iterations["eager"] == 0
    # Two of three iterations co-execute without falling back; every fallback names the op.
    assert st.iterations["coexec"] >= 0.8 * (STEPS - 10), st.iterations
    assert 0 < len(fallbacks) <= STEPS // 3 + 2
    assert all("torch.Generator" in f.reason for f in fallbacks[2:]), [f.reason for f in fallbacks]
    assert any("cannot run an op" in r.getMessage() and "torch.Generator" in r.getMessage()
               for r in caplog.records)
    # No rebuild per fallback: the graph is built a bounded number of times.
    assert st.graph_builds <= 4, st.graph_builds
