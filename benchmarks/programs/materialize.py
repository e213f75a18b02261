"""Materialization: values fetched to Python (.item(), numpy, print) that feed back.

Three kinds of fetch a real loop does:
  - in forward, `.item()` of an input statistic used as a Python float to normalize (trace bakes
    the first value in as a constant; Dynamo breaks the graph there);
  - per-sample losses fetched as numpy, ranked with numpy, and the hardest samples' indices fed
    back as a tensor into the same step's loss (hard-example mining);
  - the gradient norm fetched every step, kept in a Python list, and numpy's std of the recent
    history sets the learning rate: a Python scalar that changes every step;
plus a print of the loss every few steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "MLP regressor; .item() in forward, numpy hard-example mining, numpy-set lr, print"
FEATURES = ("item-in-forward", "numpy-feedback", "changing-python-scalar-lr", "print")
STEPS_PER_REP = 240
QUICK_STEPS_PER_REP = 60


class ScaledMLP(nn.Module):
    def __init__(self, n_in: int = 16, width: int = 64, n_out: int = 4) -> None:
        super().__init__()
        self.l1 = nn.Linear(n_in, width)
        self.l2 = nn.Linear(width, width)
        self.l3 = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()  # a Python float from the data
        h = torch.tanh(self.l1(x / scale))
        h = torch.tanh(self.l2(h))
        return self.l3(h)


@dataclass
class State:
    net: ScaledMLP
    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    device: str
    grad_norms: list[float] = field(default_factory=list)
    base_lr: float = 0.05


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    w_true = torch.randn(16, 4, generator=gen)
    batches = []
    for k in range(6):
        x = torch.randn(32, 16, generator=gen) * (1.0 + k)  # batches differ in scale
        y = torch.sin(x / (1.0 + k)) @ w_true
        batches.append((x.to(rt.device), y.to(rt.device)))
    net = ScaledMLP().to(rt.device)
    model = rt.wrap(net, (batches[0][0],))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    return State(net, model, opt, batches, rt.device)


def step(s: State, i: int) -> torch.Tensor:
    x, y = s.batches[i % len(s.batches)]
    per_sample = F.mse_loss(s.model(x), y, reduction="none").mean(dim=1)
    ranked = np.argsort(per_sample.detach().cpu().numpy())
    hardest = torch.from_numpy(ranked[-8:].copy()).to(s.device)
    loss = per_sample.mean() + 0.5 * per_sample[hardest].mean()

    s.opt.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(s.net.parameters(), max_norm=10.0).item()
    s.grad_norms.append(grad_norm)
    lr = s.base_lr / (1.0 + float(np.std(s.grad_norms[-10:])))
    for group in s.opt.param_groups:
        group["lr"] = lr
    s.opt.step()
    if i % 5 == 0:
        print(f"step {i:4d}  loss {loss.item():.4f}  grad norm {grad_norm:.3f}  lr {lr:.4g}")
    return loss.detach()


def digest(s: State) -> list[float]:
    return param_digest([s.net]) + [sum(s.grad_norms)]
