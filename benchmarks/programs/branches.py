"""Data-dependent branches: `if` on tensor values, in forward and in the training loop.

forward picks one of two sub-networks by the sign of the batch mean (the data alternates), and
the loop compares the loss with its running average (`if loss > loss_avg`) and clips gradients
harder on worse-than-usual batches. Each `if` needs a value before Python can go on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "two-path MLP (if x.mean() > 0) and `if loss > running avg: clip hard` in the loop"
FEATURES = ("tensor-if-in-forward", "tensor-if-in-loop")
STEPS_PER_REP = 400
QUICK_STEPS_PER_REP = 100


class TwoPathNet(nn.Module):
    def __init__(self, n_in: int = 16, width: int = 32, n_out: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(n_in, width)
        self.wide = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(),
                                  nn.Linear(2 * width, width))
        self.narrow = nn.Linear(width, width)
        self.out = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if x.mean() > 0:
            h = torch.relu(self.wide(h))
        else:
            h = torch.relu(self.narrow(h))
        return self.out(h)


@dataclass
class State:
    net: TwoPathNet
    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss_avg: torch.Tensor
    hard_clips: int = 0


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    teacher = torch.randn(16, 4, generator=gen)
    batches = []
    for k in range(6):
        shift = 0.5 if k % 2 == 0 else -0.5  # alternate the branch forward takes
        x = torch.randn(16, 16, generator=gen) + shift
        y = (x @ teacher).argmax(dim=1)  # learnable labels
        batches.append((x.to(rt.device), y.to(rt.device)))
    net = TwoPathNet().to(rt.device)
    model = rt.wrap(net, (batches[0][0],))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    return State(net, model, opt, batches, torch.tensor(1.38, device=rt.device))


def step(s: State, i: int) -> torch.Tensor:
    x, y = s.batches[i % len(s.batches)]
    loss = F.cross_entropy(s.model(x), y)
    s.opt.zero_grad()
    loss.backward()
    if loss > s.loss_avg:  # a worse-than-usual batch: clip hard
        torch.nn.utils.clip_grad_norm_(s.net.parameters(), max_norm=0.5)
        s.hard_clips += 1
    s.opt.step()
    s.loss_avg = 0.9 * s.loss_avg + 0.1 * loss.detach()
    return loss.detach()


def digest(s: State) -> list[float]:
    return param_digest([s.net]) + [float(s.hard_clips)]
