"""The main job, end to end: train a small classifier on synthetic data twice from the same seed,
once in eager PyTorch and once under `terra_torch.wrap` (co-execution), and show the speed of
each, whether terra reproduced eager's losses and parameters bit for bit, and what the runtime
did (iterations per phase, fallbacks and their reasons, where the time went).

It exists so that one command (`scripts/demo.sh`) answers "does it work, and is it fast yet?"
honestly: the exit status is 0 only when losses and parameters match exactly.
"""

from __future__ import annotations

import argparse
import io
import statistics
import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import terra_torch

LOG_EVERY = 50  # print(loss.item()) like a user would; each print is a read of a graph value


@dataclass
class Run:
    losses: list[float]
    params: list[torch.Tensor]
    seconds: float
    steady_seconds: float  # time for the steps after the first `warm` ones
    printed: str
    stats: terra_torch.runtime.Stats | None = None
    fallbacks: list[str] | None = None


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


def data(steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Four Gaussian clusters; a private generator so that dropout's draws do not shift it."""
    g = torch.Generator().manual_seed(7)
    centers = torch.randn(4, 32, generator=g) * 0.4  # overlapping: the loss keeps falling slowly
    batches = []
    for _ in range(16):
        y = torch.randint(0, 4, (32,), generator=g)
        batches.append((centers[y] + torch.randn(32, 32, generator=g), y))
    for i in range(steps):
        yield batches[i % len(batches)]


class Job:
    """One training run: a model, its optimizer and its batches, stepped on in blocks."""

    def __init__(self, terra: bool, steps: int) -> None:
        self.model, self.opt = make()
        self.terra = terra
        if terra:
            self.model = terra_torch.wrap(self.model)  # the one added line
        self.batches = data(steps)
        self.step = 0
        self.losses: list[torch.Tensor] = []
        self.out = io.StringIO()

    def run(self, n: int, sync: bool = True) -> float:
        """Trains `n` steps (the user's loop); returns the seconds they took, with `sync` the graph's
        work for them included."""
        start = time.perf_counter()
        model, opt = self.model, self.opt
        with contextlib.redirect_stdout(self.out):
            for _ in range(n):
                i = self.step
                x, y = next(self.batches)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                self.losses.append(loss.detach())
                if i % LOG_EVERY == 0:
                    print(f"  step {i:4d}  loss {loss.item():.4f}")
                self.step += 1
            if self.terra and sync:
                terra_torch.synchronize()  # parameters final, every placeholder has its value
        return time.perf_counter() - start


def train(steps: int, warm: int, terra: bool) -> Run:
    job = Job(terra, steps)
    torch.manual_seed(1)  # dropout's random stream, the same for both runs
    first = job.run(warm, sync=False)
    rest = job.run(steps - warm)
    run = Run([float(v) for v in job.losses], [p.detach().clone() for p in job.model.parameters()],
              first + rest, rest, job.out.getvalue())
    if terra:
        run.stats = terra_torch.stats(job.model)
        run.fallbacks = [f"iteration {f.iteration} at {f.source_line}: {f.reason}"
                         for f in job.model._terra_program.fallbacks]
        terra_torch.unwrap(job.model)
    return run


def interleaved(rounds: int, block: int, warm: int) -> list[tuple[float, float]]:
    """Seconds per block of `block` steps, eager and terra, in alternating order per round.

    One run of each is at the mercy of whatever else this machine runs at that moment (a shared
    machine moves a 0.1 s run by 20% and more); blocks taken in turn see the same load, and the
    median of the rounds' ratios is what the speed line reports (benchmarks.step_ab does the same
    across processes).
    """
    jobs = {name: Job(name == "terra", warm + rounds * block) for name in ("eager", "terra")}
    for job in jobs.values():
        job.run(warm)  # terra: tracing, graph generation, the first co-executed iterations
    times = []
    for r in range(rounds):
        order = ("eager", "terra") if r % 2 == 0 else ("terra", "eager")
        t = {name: jobs[name].run(block) for name in order}
        times.append((t["eager"], t["terra"]))
    terra_torch.unwrap(jobs["terra"].model)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warm", type=int, default=50, help="steps excluded from the steady rate")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--rounds", type=int, default=7,
                   help="interleaved rounds for the speed figure (0: skip them)")
    p.add_argument("--block", type=int, default=200, help="steps per block of a round")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"terra_torch {terra_torch.__version__} on torch {torch.__version__}, "
          f"{args.threads} intra-op thread(s); {args.steps} steps of Adam on a 3-layer MLP with "
          f"dropout, print(loss.item()) every {LOG_EVERY} steps")
    train(args.steps, args.warm, terra=False)  # warm-up: thread pools, allocator, first calls
    eager = train(args.steps, args.warm, terra=False)
    terra = train(args.steps, args.warm, terra=True)
    print(terra.printed, end="")

    same_losses = terra.losses == eager.losses
    same_params = all(torch.equal(a, b) for a, b in zip(eager.params, terra.params))
    same_prints = terra.printed == eager.printed
    first_diff = next((i for i, (a, b) in enumerate(zip(eager.losses, terra.losses)) if a != b),
                      None)
    steady = args.steps - args.warm
    print()
    print(f"first {args.steps} steps (one run each, tracing included): eager {args.steps / eager.seconds:.0f} "
          f"st/s, terra_torch.wrap {args.steps / terra.seconds:.0f} st/s "
          f"({eager.seconds / terra.seconds:.2f}x)")
    if args.rounds > 0:
        times = interleaved(args.rounds, args.block, args.warm)
        ratios = sorted(e / t for e, t in times)
        eager_ms = statistics.median(1e3 * e / args.block for e, _ in times)
        terra_ms = statistics.median(1e3 * t / args.block for _, t in times)
        print(f"steady state, {args.rounds} rounds of {args.block} steps each, eager and terra in turn "
              f"(median): eager {eager_ms:.3f} ms/step, terra_torch.wrap {terra_ms:.3f} ms/step")
        print(f"  terra / eager: {statistics.median(ratios):.2f}x (rounds {ratios[0]:.2f}x .. "
              f"{ratios[-1]:.2f}x; > 1 is faster than eager)")
    print()
    print(f"losses identical to eager (all {args.steps}): {same_losses}"
          + ("" if first_diff is None else f" (first difference at step {first_diff}: "
             f"eager {eager.losses[first_diff]!r} terra {terra.losses[first_diff]!r})"))
    print(f"parameters identical: {same_params}; printed log identical: {same_prints}")
    st = terra.stats
    assert st is not None and terra.fallbacks is not None
    print(f"iterations per phase: {st.iterations}; graph builds: {st.graph_builds}; "
          f"transitions (iteration, from, to): {st.transitions[:6]}"
          + (" ..." if len(st.transitions) > 6 else ""))
    print(f"fallbacks: {st.fallbacks}")
    for line in terra.fallbacks[:5]:
        print(f"  {' '.join(line.split())[:200]}")
    n = max(1, st.iterations.get("coexec", 0))
    print(f"co-executed iterations, ms per iteration: Python exec {1e3 * st.python_exec_s / n:.3f}, "
          f"Python stall {1e3 * st.python_stall_s / n:.3f}, graph exec {1e3 * st.graph_exec_s / n:.3f}, "
          f"graph stall {1e3 * st.graph_stall_s / n:.3f}; eager step {1e3 * eager.steady_seconds / steady:.3f}")
    if not (same_losses and same_params and same_prints):
        print("RESULT: terra_torch did NOT reproduce eager's results")
        return 1
    print("RESULT: terra_torch reproduced eager's results bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
