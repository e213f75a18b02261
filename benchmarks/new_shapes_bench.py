"""Iterations at shapes co-execution has not seen: the first co-executed iteration of a process,
and a batch of a new size later on, eager against terra with and without the C++ meta functions.

A co-executed op gets a placeholder whose sizes and strides come from shape inference
(csrc/capture/shape_inference.h), cached per input metadata. A miss runs the op's meta kernel:
torch's Python one through the dispatcher (TERRA_CPP_META=0, as before), or torch's C++ meta
function of the structured op called directly (capture/meta_functions.h, the default). Programs
whose batch size or sequence length varies miss for every new shape of every op.

The program: an MLP (Linear-ReLU-Linear-ReLU-Linear, cross entropy, SGD with momentum) wrapped with
terra_torch.wrap, speed check off; 60 iterations at batch 32, then rounds of one iteration at a
batch size never seen (33, 34, ...) followed by 9 at batch 32. Reported per cell (medians over
the processes): the first co-executed iteration (ms), an iteration at a new size (ms), an
iteration at a seen size (ms), and the shape cache's misses by kind. Cells run in interleaved
processes, `--reps` times each:

    .venv/bin/python -m benchmarks.new_shapes_bench [--reps 5] [--rounds 20]
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
import json, statistics, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
mode, rounds = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
if mode != "eager":
    import terra_torch
    from terra_torch import _C
    model = terra_torch.wrap(model, speed_check=False)
g = torch.Generator().manual_seed(1)
def batch(n):
    return torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g)
def step(x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss
seen = batch(32)
times = []
for i in range(60):
    t = time.perf_counter(); step(*seen); times.append(time.perf_counter() - t)
# The third call starts the first co-executed iteration (two are traced): its time shows in the
# call after it, which ends it.
first = max(times[2:6]) * 1e3
new, old = [], []
for r in range(rounds):
    x = batch(33 + r)
    t = time.perf_counter(); step(*x); step(*seen); new.append(time.perf_counter() - t)
    for _ in range(8):
        t = time.perf_counter(); step(*seen); step(*seen); old.append((time.perf_counter() - t) / 2)
out = {"first_ms": first, "new_ms": (statistics.median(new) - 2 * statistics.median(old)) * 1e3,
       "seen_ms": statistics.median(old) * 1e3}
if mode != "eager":
    terra_torch.synchronize()
    out.update({k: v for k, v in _C.shape_cache_counts().items() if k != "cpp_meta_ops"})
    out["coexec"] = terra_torch.stats(model).iterations.get("coexec", 0)
print(json.dumps(out))
"""

CELLS = (("eager", {}), ("terra", {}), ("terra, TERRA_CPP_META=0", {"TERRA_CPP_META": "0"}))


def run(cell: str, env_extra: dict[str, str], rounds: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TERRA_SPEED_CHECK="0", **env_extra)
    mode = "eager" if cell == "eager" else "terra"
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(rounds)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{cell} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    print("uptime before:", os.getloadavg())
    results: dict[str, list[dict]] = {c: [] for c, _ in CELLS}
    for _ in range(args.reps):
        for cell, env in CELLS:
            results[cell].append(run(cell, env, args.rounds))
    print("uptime after: ", os.getloadavg())
    print(f"{'cell':26s} {'first it. ms':>12s} {'new size ms':>12s} {'seen size ms':>12s}   misses: C++ / dispatcher")
    for cell, _ in CELLS:
        rs = results[cell]
        med = {k: statistics.median(r[k] for r in rs) for k in ("first_ms", "new_ms", "seen_ms")}
        misses = (f"{statistics.median(r['cpp_meta'] for r in rs):.0f} / {statistics.median(r['dispatched'] for r in rs):.0f}"
                  if "cpp_meta" in rs[0] else "-")
        print(f"{cell:26s} {med['first_ms']:12.2f} {med['new_ms']:12.2f} {med['seen_ms']:12.3f}   {misses}")
    print("new size ms: the extra time of an iteration at a batch size not seen before, over one at a seen size")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
