"""Per-op cost of the capture layer (issue 3): a chain of 1,000 small ops (8x8 add / mul / relu)
in eager mode, recording mode and placeholder mode, and a whole training step (MLP, cross-entropy,
Adam: forward, backward and optimizer ops) in eager and recording mode. Median of several runs;
per-op microseconds and the ratio to eager. Run: .venv/bin/python -m benchmarks.capture_overhead
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import terra_torch
from terra_torch import _C

N_OPS = 1000
# Wall clock by default; --clock cpu (this thread's CPU time) when the machine is shared and
# other processes' load would otherwise move the ratios from run to run.
clock = time.perf_counter


def chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for _ in range(N_OPS // 3):
        x = torch.add(x, y)
        x = torch.mul(x, y)
        x = torch.relu(x)
    return x


def run_eager(x, y) -> None:
    chain(x, y)


def make_region_runner(mode: str):
    def run(x, y) -> None:
        region = _C.Region(mode, sys._getframe(0))
        region.open()
        try:
            chain(x, y)
        finally:
            region.close()

    return run


def training_step_ms(captured: bool, reps: int) -> tuple[float, int]:
    """Median ms per MLP+Adam step (region open around each step when captured), and ops/step."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def run(n: int) -> _C.Region | None:
        region = None
        for _ in range(n):
            if captured:
                region = _C.Region("record", sys._getframe(0))
                region.open()
                try:
                    step()
                finally:
                    region.close()
            else:
                step()
        return region

    last = run(5)  # warm-up; Adam creates its state on the first step
    ops = len(last.ops()) if last is not None else 0
    samples = []
    for _ in range(reps):
        start = clock()
        run(20)
        samples.append((clock() - start) / 20)
    return statistics.median(samples) * 1e3, ops


def time_per_op(fn, x, y, reps: int) -> float:
    fn(x, y)  # warm-up (fills the shape cache in placeholder mode)
    samples = []
    for _ in range(reps):
        start = clock()
        fn(x, y)
        samples.append((clock() - start) / (3 * (N_OPS // 3)))
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (median reported)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the thread's CPU time, steadier on a shared machine")
    args = parser.parse_args()
    global clock
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    rows = [
        ("eager", run_eager),
        ("recording", make_region_runner("record")),
        ("placeholder", make_region_runner("placeholder")),
    ]
    results = {name: time_per_op(fn, x, y, args.reps) for name, fn in rows}
    print(f"torch {torch.__version__}, terra_torch {terra_torch.__version__}, {N_OPS} ops of 8x8, "
          f"median of {args.reps}, {args.clock} clock")
    print(f"{'mode':<12} {'us/op':>8} {'x eager':>8}")
    for name, us in results.items():
        print(f"{name:<12} {us:8.2f} {us / results['eager']:8.2f}")
    eager_ms, _ = training_step_ms(False, args.reps)
    rec_ms, ops = training_step_ms(True, args.reps)
    print(f"\nMLP + cross-entropy + Adam step ({ops} ops), median of {args.reps} x 20 steps")
    print(f"{'mode':<12} {'ms/step':>8} {'x eager':>8}")
    print(f"{'eager':<12} {eager_ms:8.3f} {1.0:8.2f}")
    print(f"{'recording':<12} {rec_ms:8.3f} {rec_ms / eager_ms:8.2f}")


if __name__ == "__main__":
    main()
