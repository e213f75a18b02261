"""The main job, as far as terra_torch goes today: train a small classifier on synthetic data,
once in eager mode and once with every step captured at the dispatcher, and show that the
captured run computed exactly what eager did, what was captured, and what it cost."""

from __future__ import annotations

import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

import terra_torch
from terra_torch import debug

STEPS = 60


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


def data(steps: int):
    g = torch.Generator().manual_seed(7)
    centers = torch.randn(4, 32, generator=g) * 2
    for _ in range(steps):
        y = torch.randint(0, 4, (64,), generator=g)
        yield centers[y] + torch.randn(64, 32, generator=g), y


def step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def train(captured: bool, quiet: bool = False):
    model, opt = make()
    torch.manual_seed(1)  # dropout draws
    losses, traces = [], []
    start = time.perf_counter()
    for i, (x, y) in enumerate(data(STEPS)):
        if captured:
            loss, trace = debug.record(step, model, opt, x, y)
            traces.append(trace)
        else:
            loss = step(model, opt, x, y)
        losses.append(loss.item())
        if not quiet and (i % 20 == 0 or i == STEPS - 1):
            print(f"  step {i:3d}  loss {losses[-1]:.4f}")
    return model, losses, traces, time.perf_counter() - start


def main() -> int:
    print(f"terra_torch {terra_torch.__version__} on torch {torch.__version__}")
    train(captured=False, quiet=True)  # warm-up: thread pools, allocator, first-call paths
    print("eager:")
    eager_model, eager_losses, _, eager_s = train(captured=False)
    print("captured (every aten op recorded at the dispatcher, real kernels run):")
    model, losses, traces, captured_s = train(captured=True)

    same_losses = losses == eager_losses
    same_params = all(torch.equal(a, b) for a, b in zip(eager_model.state_dict().values(), model.state_dict().values()))
    last = traces[-1]
    kinds = Counter("backward" if op.backward else "forward/optimizer" for op in last.ops)
    print()
    print(f"losses identical to eager: {same_losses}; parameters identical: {same_params}")
    print(f"final loss {losses[-1]:.4f} (first {losses[0]:.4f})")
    print(f"ops per step: {len(last.ops)} ({dict(kinds)}), distinct locations: {len({op.location for op in last.ops})}")
    print(f"external inputs per step: {len(last.externals)}")
    print(f"time: eager {eager_s / STEPS * 1e3:.2f} ms/step, captured {captured_s / STEPS * 1e3:.2f} ms/step "
          "(capture records and converts every op; speed comes with co-execution, not yet built)")
    print("first ops of the last step:")
    for op in last.ops[:8]:
        print(f"  {op.name:<38} {op.location.user_frame}")
    return 0 if same_losses and same_params else 1


if __name__ == "__main__":
    sys.exit(main())
