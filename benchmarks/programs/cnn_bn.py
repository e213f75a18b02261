"""A small CNN with BatchNorm: convolutions plus buffers that every training step mutates.

BatchNorm in training mode updates running_mean, running_var and num_batches_tracked in place:
side effects on state that outlives the step, which a graph runner must neither skip nor repeat.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "2 x (Conv3x3 + BatchNorm + ReLU), pool, Linear; 8x3x16x16, SGD+momentum"
FEATURES = ("conv", "batchnorm-buffers")
STEPS_PER_REP = 160
QUICK_STEPS_PER_REP = 40


class SmallCNN(nn.Module):
    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


@dataclass
class State:
    net: SmallCNN
    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    batches = []
    for _ in range(4):
        x = torch.randn(8, 3, 16, 16, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        batches.append((x.to(rt.device), y.to(rt.device)))
    net = SmallCNN().to(rt.device)
    model = rt.wrap(net, (batches[0][0],))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
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
