"""Python object mutation: counters, list appends, attributes changed in forward, kept references.

forward increments a call counter, anneals a temperature attribute (a Python float that changes
every call and scales the output), and appends a detached activation statistic to a list it
keeps (a bounded history). The loop keeps an exponential moving average of the weights in
tensors that outlive every step, appends each loss to a list, and the reported value adds the
mean of the model's history, so wrong mutations show up in the loss trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "MLP whose forward mutates a counter, a float attribute and a list; EMA weights"
FEATURES = ("attribute-mutation", "list-append", "changing-python-scalar", "ema-references")
STEPS_PER_REP = 400
QUICK_STEPS_PER_REP = 100


class TrackedMLP(nn.Module):
    def __init__(self, n_in: int = 16, width: int = 32, n_out: int = 4) -> None:
        super().__init__()
        self.l1 = nn.Linear(n_in, width)
        self.l2 = nn.Linear(width, n_out)
        self.calls = 0
        self.temperature = 2.0
        self.history = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.temperature = max(0.5, self.temperature * 0.97)
        h = torch.relu(self.l1(x))
        self.history.append(h.detach().mean())
        if len(self.history) > 8:
            self.history.pop(0)
        return self.l2(h) / self.temperature


@dataclass
class State:
    net: TrackedMLP
    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    ema: list[torch.Tensor]
    losses: list[torch.Tensor] = field(default_factory=list)


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    teacher = torch.randn(16, 4, generator=gen)
    batches = []
    for _ in range(5):
        x = torch.randn(16, 16, generator=gen)
        y = (x @ teacher).argmax(dim=1)  # learnable labels
        batches.append((x.to(rt.device), y.to(rt.device)))
    net = TrackedMLP().to(rt.device)
    model = rt.wrap(net, (batches[0][0],))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ema = [p.detach().clone() for p in net.parameters()]
    return State(net, model, opt, batches, ema)


def step(s: State, i: int) -> torch.Tensor:
    x, y = s.batches[i % len(s.batches)]
    loss = F.cross_entropy(s.model(x), y)
    s.opt.zero_grad()
    loss.backward()
    s.opt.step()
    with torch.no_grad():
        for avg, p in zip(s.ema, s.net.parameters()):
            avg.mul_(0.9).add_(p, alpha=0.1)
    s.losses.append(loss.detach())
    history = s.net.history
    return loss.detach() + 0.01 * torch.stack(history).mean() if history else loss.detach()


def digest(s: State) -> list[float]:
    ema_sum = float(sum(t.double().sum() for t in (e.cpu() for e in s.ema)))
    return param_digest([s.net]) + [float(s.net.calls), s.net.temperature, ema_sum,
                                    float(len(s.losses))]
