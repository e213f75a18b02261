"""`p.data = tensor` in co-execution (capture/host_filled_tensors.cpp,
has_compatible_shallow_copy_type): torch's set_data asks whether `p` may take the new tensor's
storage, and a placeholder has none until the graph computed it. Old-style SGD
(`p.data = p.data - lr * p.grad.data`) raised "incompatible tensor type" in every co-executed
iteration. Now the placeholder gets its value first, `p` takes it as in eager, and both read as
inputs from outside from then on (Region::note_data_replaced). Each program trains eagerly and
under terra_torch.wrap and must agree bit for bit."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bitwise_runs import check_bitwise

STEPS = 50
X = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (4, 16), generator=torch.Generator().manual_seed(2))


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), None


def sgd_step(model, opt, i):
    """A training step through the optimizer (check_bitwise's step)."""
    loss = F.cross_entropy(model(X[i % 4]), Y[i % 4])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach(), None


def test_old_style_sgd_through_data():
    def step(model, _, i):
        loss = F.cross_entropy(model(X[i % 4]), Y[i % 4])
        model.zero_grad()
        loss.backward()
        for p in model.parameters():
            p.data = p.data - 0.05 * p.grad.data
        return loss.detach(), None

    stats, fallbacks = check_bitwise(mlp, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 5 and not fallbacks, (stats.iterations, fallbacks)


def test_momentum_buffers_clipping_and_renormalizing_through_data():
    """A momentum buffer replaced through `.data`, WGAN-style clipping and a row renormalization
    that assign `.data` twice per parameter, and a parameter's `.data` read after it was replaced."""
    buffers: dict[int, torch.Tensor] = {}

    def step(model, _, i):
        loss = F.cross_entropy(model(X[i % 4]), Y[i % 4])
        model.zero_grad()
        loss.backward()
        for k, p in enumerate(model.parameters()):
            b = buffers.setdefault(k, torch.zeros_like(p))
            b.data = 0.9 * b.data + p.grad.data
            p.data = p.data - 0.05 * b.data
            p.data = torch.clamp(p.data, -0.4, 0.4)
            if p.dim() == 2:
                p.data = p.data / p.data.norm(dim=1, keepdim=True)
        return loss.detach(), float(model[0].weight.data.abs().sum())

    def make():
        buffers.clear()
        return mlp()

    stats, fallbacks = check_bitwise(make, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 5 and not fallbacks, (stats.iterations, fallbacks)


class ScaledHidden(nn.Module):
    """Replaces an intermediate's data in forward (a placeholder receives another's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        scaled = h.detach() * 0.5
        h.data = scaled
        return self.b(h)


def test_data_assigned_to_an_intermediate_in_forward():
    """The numbers were silently wrong here: set_data is no op, so the graph read the
    intermediate's old value. Now it gets its value first and reads as an input from outside."""

    def make():
        m = ScaledHidden()
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    stats, fallbacks = check_bitwise(make, sgd_step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 5 and not fallbacks, (stats.iterations, fallbacks)


def test_a_parameter_replaced_then_updated_in_place():
    """`weight.data = fresh` every 10 steps, then SGD updates it in place: the graph must write
    the new storage (it wrote its own copy of the fresh value, and Python's weight kept the value
    before the update: the final weights differed from eager's by 0.01)."""

    def make():
        m, _ = mlp()
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def step(model, opt, i):
        if i % 10 == 9:
            fresh = torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) * 0.1
            model[2].weight.data = fresh
        return sgd_step(model, opt, i)

    stats, fallbacks = check_bitwise(make, step, STEPS)
    # (one divergence: the first replacement is a new path)
    assert stats.iterations["coexec"] >= STEPS - 5 and len(fallbacks) <= 1, (stats.iterations, fallbacks)
