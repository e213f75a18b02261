"""Generators: a Python generator decides which sub-networks run, another streams the data.

The model holds four expert sub-networks; a generator method yields the experts to apply on
this call, rotating with a Python call counter, so consecutive steps take different paths
through the same module. The training data comes from a generator function too (the shape of
most data loaders). TorchScript rejects generators; trace bakes in the path it saw first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "4 experts; a generator yields the 2 to run each call (rotating); data generator"
FEATURES = ("generator-routing", "generator-data", "python-counter")
STEPS_PER_REP = 400
QUICK_STEPS_PER_REP = 100


class RoutedNet(nn.Module):
    def __init__(self, n_in: int = 16, width: int = 32, n_experts: int = 4,
                 n_out: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(n_in, width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(n_experts))
        self.head = nn.Linear(width, n_out)
        self.calls = 0

    def route(self) -> Iterator[nn.Module]:
        """Yield this call's experts: a rotating pair."""
        first = self.calls % len(self.experts)
        yield self.experts[first]
        yield self.experts[(first + 1) % len(self.experts)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.relu(self.stem(x))
        for expert in self.route():
            h = h + torch.relu(expert(h))
        return self.head(h)


Batch = tuple[torch.Tensor, torch.Tensor]


def stream(batches: list[Batch]) -> Iterator[Batch]:
    """An endless data stream, like a DataLoader iterated epoch after epoch."""
    while True:
        for batch in batches:
            yield batch


@dataclass
class State:
    net: RoutedNet
    model: nn.Module
    opt: torch.optim.Optimizer
    data: Iterator[Batch]


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    teacher = torch.randn(16, 4, generator=gen)
    batches = []
    for _ in range(5):
        x = torch.randn(16, 16, generator=gen)
        y = (x @ teacher).argmax(dim=1)  # learnable labels
        batches.append((x.to(rt.device), y.to(rt.device)))
    net = RoutedNet().to(rt.device)
    model = rt.wrap(net, (batches[0][0],))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return State(net, model, opt, stream(batches))


def step(s: State, i: int) -> torch.Tensor:
    x, y = next(s.data)
    loss = F.cross_entropy(s.model(x), y)
    s.opt.zero_grad()
    loss.backward()
    s.opt.step()
    return loss.detach()


def digest(s: State) -> list[float]:
    return param_digest([s.net]) + [float(s.net.calls)]
