"""`p.data = tensor` in co-execution (capture/host_filled_tensors.cpp,
has_compatible_shallow_copy_type): torch's set_data asks whether `p` may take the new tensor's
storage, and a placeholder has none until the graph computed it. Old-style SGD
(`p.data = p.data - lr * p.grad.data`) raised "incompatible tensor type" in every co-executed
iteration. Now the placeholder gets its value first and `p` takes it, as in eager. Each program
trains eagerly and under terra_torch.wrap and must agree bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bitwise_runs import check_bitwise

STEPS = 50
X = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (4, 16), generator=torch.Generator().manual_seed(2))


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), None


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
    """Not co-executed: a placeholder cannot take another tensor's storage. The program runs
    eagerly from there, with the reason, and its numbers are eager's (they were silently wrong:
    the graph read the intermediate's old value)."""

    def make():
        m = ScaledHidden()
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    def step(model, opt, i):
        loss = F.cross_entropy(model(X[i % 4]), Y[i % 4])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    with pytest.warns(UserWarning, match=r"`\.data` of a tensor this iteration computed was replaced"):
        stats, fallbacks = check_bitwise(make, step, STEPS)
    assert stats.iterations["eager"] >= STEPS - 10, (stats.iterations, fallbacks)
