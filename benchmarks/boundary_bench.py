"""The cost of terra's iteration boundary: a wrapped model whose iteration is one small op.

Every co-executed iteration pays for its boundary (ending the previous iteration, opening the
next region, telling the graph runner an iteration starts, the Python bookkeeping of the phase
machine) once, whatever its size. Issue 15 asks for at most 20 us. A program whose iteration is
a single `x * w` on 64 floats makes the boundary nearly all of the time, so

    boundary ~= (terra us/iteration) - (eager us/iteration)

with both measured in the same run, in interleaved processes (eager, terra, eager, terra, ...),
as medians of the repetitions. Thread CPU time of the Python thread is reported beside wall time:
this machine is shared, and CPU time moves less with load.

    .venv/bin/python -m benchmarks.boundary_bench [--reps 7] [--iterations 20000]

Each child process prints one JSON line; this process never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import torch
from torch import nn
torch.set_num_threads(1)
mode, iterations = sys.argv[1], int(sys.argv[2])

class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64))
    def forward(self, x):
        return x * self.w

model = Scale()
if mode == "terra":
    import terra_torch
    model = terra_torch.wrap(model, speed_check=False)
x = torch.randn(64)
first = []  # the first calls one by one: tracing, graph generation, the first co-executed one
for _ in range(5):
    s = time.perf_counter()
    y = model(x)
    first.append((time.perf_counter() - s) * 1e3)
for _ in range(295):  # the first co-executed iterations
    y = model(x)
t0, c0 = time.perf_counter(), time.thread_time()
for _ in range(iterations):
    y = model(x)
wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
out = {"mode": mode, "wall_us": wall / iterations * 1e6, "cpu_us": cpu / iterations * 1e6, "first_ms": first}
if mode == "terra":
    terra_torch.synchronize()
    out["iterations"] = terra_torch.stats(model).iterations
print(json.dumps(out))
"""


def run_child(mode: str, iterations: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(iterations)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{mode} child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7, help="processes per mode (medians)")
    p.add_argument("--iterations", type=int, default=20000, help="timed iterations per process")
    args = p.parse_args(argv)
    print("uptime before:", os.getloadavg())
    cells: dict[str, list[dict]] = {"eager": [], "terra": []}
    for _ in range(args.reps):
        for mode in ("eager", "terra"):
            cells[mode].append(run_child(mode, args.iterations))
    print("uptime after: ", os.getloadavg())
    med = {m: {k: statistics.median(c[k] for c in cs) for k in ("wall_us", "cpu_us")} for m, cs in cells.items()}
    for m in ("eager", "terra"):
        print(f"{m:6s} {med[m]['wall_us']:7.1f} us/iteration wall  {med[m]['cpu_us']:7.1f} us Python-thread CPU"
              f"   (wall of each process: {', '.join('%.1f' % c['wall_us'] for c in cells[m])})")
    print(f"boundary (terra - eager): {med['terra']['wall_us'] - med['eager']['wall_us']:.1f} us wall, "
          f"{med['terra']['cpu_us'] - med['eager']['cpu_us']:.1f} us CPU; "
          f"iterations per phase of the last terra process: {cells['terra'][-1].get('iterations')}")
    # A call ends the iteration before it: with terra the third call builds the graph and
    # co-executes for the first time (the first meta kernels of the process run in it).
    for m in ("eager", "terra"):
        firsts = [statistics.median(c["first_ms"][k] for c in cells[m]) for k in range(5)]
        print(f"{m:6s} first five calls, ms (medians): {', '.join('%.2f' % f for f in firsts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
