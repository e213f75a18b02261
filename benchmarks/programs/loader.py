"""The loop most programs have: batches from a shuffled DataLoader over a map-style dataset.

An MLP classifier trained with AdamW from `DataLoader(TensorDataset(x, y), batch_size=32,
shuffle=True)`, epoch after epoch, in the main process (num_workers=0, the default). Every batch
is assembled in Python: the dataset indexes its two tensors once per sample and the default
collate function stacks them, ~66 small ops per batch around the step's own. Under
terra_torch.wrap those ops run outside the program (csrc/capture/outside_program.h); a new
epoch draws the sampler's seed from the default generator and reshuffles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "MLP + AdamW over DataLoader(TensorDataset, batch 32, shuffle=True), epochs of 8 batches"
FEATURES = ("dataloader", "python-overhead")
STEPS_PER_REP = 240
QUICK_STEPS_PER_REP = 80


@dataclass
class State:
    net: nn.Module
    model: nn.Module
    opt: torch.optim.Optimizer
    loader: DataLoader
    batches: Iterator | None = None


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    x = torch.randn(256, 32, generator=gen)
    y = (x @ torch.randn(32, 4, generator=gen)).argmax(dim=1)
    loader = DataLoader(TensorDataset(x.to(rt.device), y.to(rt.device)), batch_size=32, shuffle=True)
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                        nn.Linear(64, 4)).to(rt.device)
    model = rt.wrap(net, (x[:32].to(rt.device),))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    return State(net, model, opt, loader)


def step(s: State, i: int) -> torch.Tensor:
    if s.batches is None:
        s.batches = iter(s.loader)
    try:
        x, y = next(s.batches)
    except StopIteration:  # a new epoch: a new shuffle
        s.batches = iter(s.loader)
        x, y = next(s.batches)
    loss = F.cross_entropy(s.model(x), y)
    s.opt.zero_grad()
    loss.backward()
    s.opt.step()
    return loss.detach()


def digest(s: State) -> list[float]:
    return param_digest([s.net])
