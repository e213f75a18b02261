"""An LSTM written with nn.LSTMCell and a Python loop over time steps.

The loop is in forward, so the op sequence is the cell's ops repeated once per time step: the
loop structure that Terra groups under a loop node (and that trace and compile unroll). The
sequence length is fixed here, so unrolling is correct. Adam's CPU single-tensor path reads each
parameter's step counter with .item() every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "LSTMCell(8->32) unrolled in Python over 12 steps, Linear head, Adam"
FEATURES = ("python-loop-over-time", "adam")
STEPS_PER_REP = 80
QUICK_STEPS_PER_REP = 20


class LSTMModel(nn.Module):
    def __init__(self, n_in: int = 8, hidden: int = 32, n_out: int = 8) -> None:
        super().__init__()
        self.hidden = hidden
        self.cell = nn.LSTMCell(n_in, hidden)
        self.head = nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (time, batch, features)
        h = x.new_zeros([x.size(1), self.hidden])
        c = x.new_zeros([x.size(1), self.hidden])
        outputs = []
        for t in range(x.size(0)):
            h, c = self.cell(x[t], (h, c))
            outputs.append(self.head(h))
        return torch.stack(outputs)


@dataclass
class State:
    net: LSTMModel
    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]


def make_batch(gen: torch.Generator, steps: int = 13, batch: int = 16) -> torch.Tensor:
    """Noisy sine waves with random phase and frequency, one feature per harmonic."""
    t = torch.arange(steps, dtype=torch.float32)[:, None, None]
    freq = 0.2 + 0.3 * torch.rand(1, batch, 1, generator=gen)
    phase = 6.28 * torch.rand(1, batch, 1, generator=gen)
    harmonics = torch.arange(1, 9, dtype=torch.float32)[None, None, :]
    waves = torch.sin(freq * harmonics * t + phase)
    return waves + 0.05 * torch.randn(waves.shape, generator=gen)


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    batches = []
    for _ in range(4):
        seq = make_batch(gen)
        batches.append((seq[:-1].to(rt.device), seq[1:].to(rt.device)))
    net = LSTMModel().to(rt.device)
    model = rt.wrap(net, (batches[0][0],))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    return State(net, model, opt, batches)


def step(s: State, i: int) -> torch.Tensor:
    x, y = s.batches[i % len(s.batches)]
    loss = F.mse_loss(s.model(x), y)
    s.opt.zero_grad()
    loss.backward()
    s.opt.step()
    return loss.detach()


def digest(s: State) -> list[float]:
    return param_digest([s.net])
