"""Reads in co-execution: training loops that read a value every step, eager against terra.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.reads_bench [--reps 5] [--steps 1000]

Each program reads in a way people write (docs/RUNTIME.md, "Reads wait only for what they read"):

- item_after_step: `total += loss.item()` after `opt.step()`
- branch_on_loss:  `if loss > avg: clip_grad_norm_(...)` after `loss.backward()`
- branch_on_batch: `if x.mean() > 0` on the batch, in forward
- checked_embedding: try/except around an embedding (the check of its indices)

Three cells per program, in turns (eager, terra, terra with TERRA_KNOWN_VALUES=0, which turns the
read rules off and waits for everything Python validated, as before them), each in its own
process, `--reps` times; medians of steady-state us/step (after 300 steps), the ratio of eager's
median to each terra median, and terra's read counters per iteration: reads that waited
(`python_reads`), of those the shortened ones (`early_reads`), reads answered on the Python side
(`known_reads`), and Python's stall. The speed check is off: this measures co-execution itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from benchmarks.harness.interleaved import run_rounds

PROGRAMS = ("item_after_step", "branch_on_loss", "branch_on_batch", "checked_embedding")
CELLS = (("eager", {}), ("terra", {}), ("terra, read rules off", {"TERRA_KNOWN_VALUES": "0"}))
WARM = 300


def _worker(program: str, terra: bool, steps: int) -> dict[str, Any]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    data = torch.randn(8, 16, 32, generator=g)
    labels = torch.randint(0, 4, (8, 16), generator=g)
    ids = torch.randint(0, 50, (8, 16, 6), generator=g)
    ids[5, 0, 0] = 60  # one batch in eight is out of range

    class TwoPath(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(32, 64)
            self.out = nn.Sequential(nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

        def forward(self, x):
            return self.out(self.a(x) if x.mean() > 0 else self.b(x))

    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
            self.bad = 0

        def forward(self, ids):
            try:
                e = self.emb(ids)
            except (IndexError, RuntimeError):
                self.bad += 1
                e = self.emb(ids.clamp(0, 49))
            return self.head(e.mean(dim=1))

    torch.manual_seed(0)
    if program == "branch_on_batch":
        model: nn.Module = TwoPath()
    elif program == "checked_embedding":
        model = Bag()
    else:
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = {"avg": torch.tensor(1.4), "total": 0.0}

    def step(i: int) -> None:
        x = ids[i % 8] if program == "checked_embedding" else data[i % 8] + (0.3 if i % 2 else -0.3)
        loss = F.cross_entropy(model(x), labels[i % 8])
        opt.zero_grad()
        loss.backward()
        if program == "branch_on_loss":
            if loss > state["avg"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            state["avg"] = 0.9 * state["avg"] + 0.1 * loss.detach()
        opt.step()
        if program == "item_after_step":
            state["total"] += loss.item()

    import terra_torch

    fn = terra_torch.function(step, speed_check=False) if terra else step
    before: dict[str, Any] = {}
    start = 0.0
    for i in range(WARM + steps):  # (one call site: a second one would be a new program location)
        if i == WARM:
            if terra:
                before = dict(terra_torch.stats(fn).runner)
            start = time.perf_counter()
        fn(i)
    if terra:
        terra_torch.synchronize()
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"us_per_step": seconds / steps * 1e6}
    if terra:
        after = terra_torch.stats(fn).runner
        for k in ("python_reads", "early_reads", "known_reads", "python_stall_ns"):
            out[k] = (after[k] - before[k]) / steps
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--only", nargs="*", default=list(PROGRAMS))
    p.add_argument("--worker", nargs=3, metavar=("PROGRAM", "MODE", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        program, mode, steps = args.worker
        print(json.dumps(_worker(program, mode == "terra", int(steps))))
        return 0
    print(f"uptime before: {os.getloadavg()}")
    for program in args.only:
        results = run_rounds("benchmarks.reads_bench", program,
                             [(name, "eager" if name == "eager" else "terra", env) for name, env in CELLS],
                             args.reps, args.steps)
        eager = statistics.median(r["us_per_step"] for r in results["eager"])
        print(f"\n{program}")
        for name, _ in CELLS:
            rs = results[name]
            us = statistics.median(r["us_per_step"] for r in rs)
            line = f"  {name:24s} {us:7.1f} us/step  {eager / us:5.2f}x eager"
            if name != "eager":
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "us_per_step"}
                line += (f"   per iteration: waited {med['python_reads']:.2f} (shortened {med['early_reads']:.2f}), "
                         f"answered {med['known_reads']:.2f}, stall {med['python_stall_ns'] / 1e3:.1f} us")
            print(line)
    print(f"\nuptime after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
