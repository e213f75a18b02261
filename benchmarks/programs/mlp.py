"""A Python-overhead-bound MLP: small layers, small batches, many steps.

Each step launches ~50 tiny aten ops (forward, backward, SGD), each far cheaper than the Python
and dispatcher work around it. This is where eager mode loses most to graph execution and where
overlapping Python with graph execution should pay off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "8 x Linear(32) + ReLU, batch 16, SGD; overhead-bound"
FEATURES = ("python-overhead",)
STEPS_PER_REP = 400
QUICK_STEPS_PER_REP = 100


class MLP(nn.Module):
    def __init__(self, n_in: int = 16, width: int = 32, depth: int = 8, n_out: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(n_in, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))
        self.out = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.out(h)


@dataclass
class State:
    net: MLP
    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    teacher = torch.randn(16, 4, generator=gen)
    batches = []
    for _ in range(8):
        x = torch.randn(16, 16, generator=gen)
        y = (x @ teacher).argmax(dim=1)  # learnable labels
        batches.append((x.to(rt.device), y.to(rt.device)))
    net = MLP().to(rt.device)
    model = rt.wrap(net, (batches[0][0],))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    return State(net, model, opt, batches)


def step(s: State, i: int) -> torch.Tensor:
    x, y = s.batches[i % len(s.batches)]
    loss = F.cross_entropy(s.model(x), y)
    s.opt.zero_grad()
    loss.backward()
    s.opt.step()
    return loss.detach()


def digest(s: State) -> list[float]:
    return param_digest([s.net])
