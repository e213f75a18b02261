"""Data-dependent trip counts: loops whose number of iterations depends on tensor values.

forward refines a hidden state with a fixed-point iteration until the update is small (at most
8 rounds; batches of different scale converge at different speeds), and the loop repeats the
optimizer step on a batch while its loss stays above the running average (at most 3 times).
Loops like these cannot be unrolled once: trace and compile see one trip count, Terra several.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = ("fixed-point refinement until converged (<=8) in forward; "
               "repeat the step while loss > running avg (<=3)")
FEATURES = ("while-tensor-cond-in-forward", "value-dependent-inner-steps")
STEPS_PER_REP = 160
QUICK_STEPS_PER_REP = 40
# The model runs 1 to 3 times per step: with terra_torch.wrap each call would start an
# iteration, so terra's runners make the whole step the iteration (terra_torch.function).
TERRA_ITERATION = "step"


class RefineNet(nn.Module):
    def __init__(self, n_in: int = 16, width: int = 32, n_out: int = 4,
                 max_rounds: int = 8, tol: float = 0.05) -> None:
        super().__init__()
        self.inp = nn.Linear(n_in, width)
        self.f = nn.Linear(width, width)
        self.out = nn.Linear(width, n_out)
        self.max_rounds = max_rounds
        self.tol = tol

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(self.max_rounds):
            update = torch.tanh(self.f(h) + x[:, :1]) - h
            h = h + 0.5 * update
            if update.abs().mean() < self.tol:
                break
        return self.out(h)


@dataclass
class State:
    net: RefineNet
    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss_avg: torch.Tensor
    inner_steps: list[int] = field(default_factory=list)


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    teacher = torch.randn(16, 4, generator=gen)
    batches = []
    for k in range(6):
        x = torch.randn(16, 16, generator=gen) * (0.3 + 0.5 * k)
        y = (x @ teacher).argmax(dim=1)  # learnable labels
        batches.append((x.to(rt.device), y.to(rt.device)))
    net = RefineNet().to(rt.device)
    model = rt.wrap(net, (batches[0][0],))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    return State(net, model, opt, batches, torch.tensor(1.38, device=rt.device))


def step(s: State, i: int) -> torch.Tensor:
    x, y = s.batches[i % len(s.batches)]
    first_loss = None
    for inner in range(3):  # extra steps on a batch that is harder than usual
        loss = F.cross_entropy(s.model(x), y)
        s.opt.zero_grad()
        loss.backward()
        s.opt.step()
        if first_loss is None:
            first_loss = loss.detach()
        if loss < s.loss_avg:
            break
    s.loss_avg = 0.8 * s.loss_avg + 0.2 * first_loss
    s.inner_steps.append(inner + 1)
    return first_loss


def digest(s: State) -> list[float]:
    return param_digest([s.net]) + [float(sum(s.inner_steps))]
