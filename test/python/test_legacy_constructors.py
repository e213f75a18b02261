"""`Tensor.new` and `Tensor.new_tensor` on placeholders (terra_torch/_legacy_constructors.py):
torch's legacy constructors read the device from the tensor's dispatch key, which for a
placeholder names no device. Each program trains eagerly and under terra_torch.wrap and must
agree bit for bit."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributions import Cauchy, Exponential, Laplace

from bitwise_runs import check_bitwise


def test_distributions_that_sample_through_new():
    # Exponential, Cauchy and Laplace draw with `rate.new(shape).exponential_()` and friends, on
    # parameters the model computed: placeholders in co-execution.
    def make():
        m = nn.Linear(5, 3)
        return m, torch.optim.SGD(m.parameters(), lr=0.02)

    def step(model, opt, i):
        out = model(torch.randn(4, 5))
        rate = out.detach().abs() + 0.5
        noise = Exponential(rate).sample() + Cauchy(out.detach(), rate).sample().clamp(-3, 3) + Laplace(0.0, rate).sample()
        loss = (out * noise).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(make, step, 30)
    assert stats.iterations["coexec"] >= 20 and not fallbacks, (stats.iterations, fallbacks)


class OldStyleRNN(nn.Module):
    """A hidden state made the way pre-1.0 code makes it: `x.new(B, H).zero_()`, and a constant
    through `new_tensor`."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(6, 8)
        self.inp = nn.Linear(6, 6)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        x = self.inp(xs)
        h = x.new(x.size(1), 8).zero_()
        for t in range(x.size(0)):
            h = self.cell(x[t], h)
        return h * x.new_tensor(0.5)


def test_hidden_state_made_with_new_in_forward():
    def make():
        m = OldStyleRNN()
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    def step(model, opt, i):
        loss = model(torch.randn(3, 4, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(make, step, 30)
    assert stats.iterations["coexec"] >= 20 and not fallbacks, (stats.iterations, fallbacks)
