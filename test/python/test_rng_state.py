"""Programs that read, save, restore or reseed the random generator while co-executing.

`torch.manual_seed`, `torch.get_rng_state` and `torch.set_rng_state` touch the generator
directly, not through an aten op; the graph's worker draws the program's random numbers later
than Python issues them. Before terra_torch/_rng.py these programs differed from eager from
their first co-executed iterations (R-Drop's two passes got different dropout masks, a
checkpointed block with dropout recomputed another mask in backward).

No program here reads a value inside the loop: a read makes Python wait for the graph, which
would hide a generator touched too early. Each trains 50 iterations eagerly and under
terra_torch.wrap from the same seed; every loss and parameter must match bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from bitwise_runs import check_bitwise

STEPS = 50


def _data(n: int = 4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _check(make, step):
    stats, _ = check_bitwise(make, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS // 2, stats.iterations  # the case under test ran
    return stats


def _sgd_step(model, opt, loss):
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach(), None  # (a tensor: no read inside the loop)


def _mlp(p: float = 0.5):
    def make():
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 4))
        return m, torch.optim.SGD(m.parameters(), lr=0.05)
    return make


def test_rdrop_restores_the_rng_state_between_two_passes():
    data = _data()

    def step(model, opt, i):
        x, y = data[i % len(data)]
        state = torch.get_rng_state()
        a = model(x)
        torch.set_rng_state(state)  # the second pass draws the same dropout mask as the first
        b = model(x)
        loss = F.cross_entropy(a, y) + F.cross_entropy(b, y) + (a - b).pow(2).mean()
        return _sgd_step(model, opt, loss)

    _check(_mlp(), step)


def test_manual_seed_in_the_loop():
    data = _data()

    def step(model, opt, i):
        torch.manual_seed(i % 3)  # while the graph may still be drawing the last mask
        x, y = data[i % len(data)]
        loss = F.cross_entropy(model(x) + 0.1 * torch.randn(8, 4), y)
        return _sgd_step(model, opt, loss)

    _check(_mlp(), step)


def test_fork_rng_around_noise():
    data = _data()

    def step(model, opt, i):
        x, y = data[i % len(data)]
        with torch.random.fork_rng():  # saves the state, restores it on exit
            noise = torch.rand(8, 16)
        loss = F.cross_entropy(model(x + noise), y)  # dropout draws what it would have without the fork
        return _sgd_step(model, opt, loss)

    _check(_mlp(), step)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_block_with_dropout_co_executes_bitwise(reentrant):
    # The recomputation in backward restores the forward's RNG state to draw the same mask.
    # use_reentrant=True also detaches the block's saved inputs in backward (a Python
    # autograd.Function) and runs a nested backward that accumulates into them: those leaves are
    # new tensors every iteration; named by their address, the accumulation was another op in
    # every trace and the program never converged (0 of 40 iterations co-executed). They are
    # named by the op that made them now (Region::locate).
    data = _data()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(16, 32)
            self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.3))
            self.out = nn.Linear(32, 4)

        def forward(self, x):
            h = torch.utils.checkpoint.checkpoint(self.block, self.inp(x), use_reentrant=reentrant)
            return self.out(h)

    def make():
        m = Net()
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    def step(model, opt, i):
        x, y = data[i % len(data)]
        return _sgd_step(model, opt, F.cross_entropy(model(x), y))

    stats = _check(make, step)
    assert stats.iterations["coexec"] >= STEPS - 6, stats.iterations


def test_distribution_samples_draw_once():
    # Beta (Dirichlet underneath), Dirichlet and Binomial sample through ops torch gives no meta
    # kernel (_sample_dirichlet, binomial; the reparameterized backward: _dirichlet_grad): they ran
    # for real on the Python side and again in the graph, two draws per sample, and every
    # co-executed step drew other numbers than eager's. A mixup-style loss on rsample.
    from torch.distributions import Beta, Binomial, Dirichlet

    def make():
        m = nn.Linear(6, 3)
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    def step(model, opt, i):
        x = torch.randn(8, 6)
        lam = Beta(torch.tensor([0.4]), torch.tensor([0.4])).sample()
        weights = Dirichlet(torch.ones(3) * 2).rsample()
        counts = Binomial(10, torch.full((3,), 0.3)).sample()
        out = model(lam * x + (1 - lam) * x.flip(0))
        loss = (out.softmax(-1) * weights).sum() + counts.sum() * 1e-3
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(make, step, 30)
    assert stats.iterations["coexec"] >= 20 and not fallbacks, (stats.iterations, fallbacks)
