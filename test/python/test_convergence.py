"""Never trace forever (issue 16, item 2): a program whose iterations keep differing in a way no
graph generalizes stops tracing after runtime.MAX_UNCONVERGED_ITERATIONS, says once (a warning
of the "terra_torch" logger, explain(), stats) which op at which line keeps differing and how,
runs eagerly without capture cost, and traces again after a back-off."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch
from terra_torch import runtime

STEPS = 96


@pytest.fixture(autouse=True)
def _isolated():
    yield
    runtime.close_all()


class Growing(nn.Module):
    """An RNN run over one more step each iteration (a curriculum that never repeats a length):
    backward reads every step's activations, so the loop is flattened and every new trip count is
    a new path, never covered by the graph."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x, steps):
        h = x
        for _ in range(steps):
            h = torch.tanh(self.cell(h))  # LINE_CELL
        return self.head(h)


def _train(terra: bool):
    torch.manual_seed(0)
    model = Growing()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if terra:
        model = terra_torch.wrap(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    losses = []
    for i in range(STEPS):
        loss = F.mse_loss(model(x, 1 + i), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    info = None
    if terra:
        terra_torch.synchronize()
        info = (terra_torch.stats(model), terra_torch.explain(model))
        terra_torch.unwrap(model)
    return [float(v) for v in losses], [p.detach().clone() for p in model.parameters()], info


def test_a_program_that_never_converges_runs_eagerly_and_says_why(caplog):
    with caplog.at_level(logging.WARNING, logger="terra_torch"):
        la, pa, _ = _train(False)
        lb, pb, (st, ex) = _train(True)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))

    bound = runtime.MAX_UNCONVERGED_ITERATIONS
    lines = [r.getMessage() for r in caplog.records if "did not converge" in r.getMessage()]
    # Given up once after the bound, traced again after the back-off, given up again.
    assert len(lines) == 2, lines
    assert "test_convergence.py" in lines[0] and "keeps differing" in lines[0], lines[0]
    assert f"running eagerly for {runtime.EAGER_BACKOFF} iterations" in lines[0]
    assert f"running eagerly for {2 * runtime.EAGER_BACKOFF} iterations" in lines[1]

    nc = ex.not_converged
    assert nc is not None and nc["iterations"] == bound
    assert "test_convergence.py" in nc["line"] and nc["op"].startswith("aten::"), nc
    assert nc["how"], nc
    assert "not converged" in str(ex)
    # Eager iterations cost no capture: every iteration is accounted for, at most 2 * bound
    # of them traced or co-executed, the rest eager.
    it = st.iterations
    assert sum(it.values()) == STEPS, it
    assert it["eager"] >= STEPS - 2 * bound - 1, it
    assert it["eager"] <= STEPS - bound, it
    assert st.not_converged == nc and "did not converge" in st.eager_reason
    phases = [(a, b) for _i, a, b in st.transitions]
    assert ("eager", "tracing") in phases  # the retry after the back-off


def test_a_difference_at_a_profiler_op_is_described_without_comparing_its_handle():
    # Describing how a traced iteration left the program looked the previous iteration's op up
    # with list.index, which compares op tuples; a profiler::_record_function_exit op holds a
    # _RecordFunction script object, whose __eq__ raises NotImplementedError (a DataLoader with
    # workers wraps each batch in record_function: such loops crashed in their third iteration).
    from bitwise_runs import check_bitwise

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    def fetch(t, i):
        with torch.autograd.profiler.record_function("fetch"):
            if i == 1:  # one iteration does more inside the block
                t = t + 1
        return t

    def make():
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    def step(model, opt, i):
        xx = x
        for _ in range(2):  # two blocks at one line: the exit ops share a location
            xx = fetch(xx, i)
        loss = F.cross_entropy(model(xx), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    st, _ = check_bitwise(make, step, 12)
    assert st.iterations["coexec"] > 0, st.iterations


def test_profiler_blocks_leave_no_record():
    # Ops that neither take nor give tensors (the profiler's record_function pair: torch.optim
    # puts one around every step() and zero_grad(), a DataLoader around every batch) run where
    # Python calls them and leave no record (capture/region.cpp, Region::handle): recorded, each
    # cost an op's full per-op work, four per training step. A program with such blocks, some
    # entered only on some iterations, is bitwise eager's, and co-executes as many ops per
    # iteration as the same program without them.
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    steps = 30

    def run(terra: bool, blocks: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        net = terra_torch.wrap(model, speed_check=False) if terra else model
        losses = []
        for i in range(steps):
            for k in range(i % 3 if blocks else 0):
                with torch.autograd.profiler.record_function(f"log {k}"):
                    pass
            if blocks and i % 4 == 0:
                with torch.autograd.profiler.record_function("every fourth"):
                    pass
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        stats = None
        if terra:
            terra_torch.synchronize()
            stats = terra_torch.stats(net)
        return losses, [p.detach().clone() for p in model.parameters()], stats

    eager_losses, eager_params, _ = run(False, True)
    losses, params, with_blocks = run(True, True)
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params))
    _, _, without = run(True, False)
    assert with_blocks.iterations["coexec"] >= steps - 6, with_blocks.iterations
    per_iteration = with_blocks.runner["python_ops"] / with_blocks.iterations["coexec"]
    assert per_iteration == without.runner["python_ops"] / without.iterations["coexec"], (with_blocks.runner,
                                                                                      without.runner)


def test_a_program_that_synchronizes_every_step_co_executes():
    # terra_torch.synchronize() after every step (timing each step, logging exact values) cuts
    # every iteration at the same point. Each cut trace was left out, so such a program traced
    # forever; from the second cut in a row they are merged.
    from bitwise_runs import check_bitwise

    def make():
        m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    def step(model, opt, i):
        g = torch.Generator().manual_seed(i)
        loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 6, generator=g)),
                                                 torch.randint(0, 3, (8,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        terra_torch.synchronize()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(make, step, 30)
    assert stats.iterations["coexec"] >= 20 and not fallbacks, (stats.iterations, fallbacks)
