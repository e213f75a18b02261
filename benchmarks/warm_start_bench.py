"""Warm start: iterations and seconds until co-execution, cold (nothing kept) and warm (the traces
a previous run kept), for the quick-suite programs.

Each run is a fresh process (`--child`): it builds the program, wraps it as the terra runner does
(terra_torch.wrap, or terra_torch.function for programs whose iteration is the step) with
`warm_start=<folder>`, and runs `--steps` steps. Per rep, a cold run with an empty folder and
then a warm run with the folder the cold run left. Reported per program, medians over `--reps`:

* first co-executed iteration (the iteration index where the phase became coexec);
* seconds to co-execution: from the first step's start to the start of that iteration (the
  traced iterations, graph generation; warm: reading and merging the kept traces);
* load_s: warm runs' reading, merging and generating (included in the above);
* whether cold and warm final states are the same (parameter digests: co-execution is exact).

    python -m benchmarks.warm_start_bench --programs mlp,cnn_bn,lstm --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_PROGRAMS = "mlp,cnn_bn,lstm,gpt,dcgan,materialize,generator,try_except,mutation,branches,trip_count"


def child(name: str, folder: str, steps: int) -> dict[str, Any]:
    import torch

    import terra_torch
    from benchmarks.harness.runtime import Runtime, load_program

    mod = load_program(name)
    by_step = getattr(mod, "TERRA_ITERATION", "model") == "step"
    wrapped: list[Any] = []

    def wrap(model: Any, example: Any) -> Any:
        if by_step:
            return model
        wrapped.append(terra_torch.wrap(model, warm_start=folder, speed_check=False))
        return wrapped[-1]

    torch.manual_seed(0)
    state = mod.build(0, Runtime("cpu", wrap))
    step = mod.step
    if by_step:
        step = terra_torch.function(mod.step, warm_start=folder, speed_check=False)
        wrapped.append(step)
    starts = []
    for i in range(steps):
        starts.append(time.perf_counter())
        step(state, i)
    terra_torch.synchronize()
    end = time.perf_counter()
    s = terra_torch.stats(wrapped[0])
    first = next((it for it, _old, new in s.transitions if new == "coexec"), None)
    return {
        "first_coexec": first,
        # (a warm start reads the kept traces inside the first iteration's begin: counted here)
        "seconds_to_coexec": (starts[first] - starts[0] + (s.warm_start or {}).get("load_s", 0.0)
                              if first is not None else None),
        "iterations": s.iterations,
        "load_s": (s.warm_start or {}).get("load_s", 0.0),
        "loaded": (s.warm_start or {}).get("loaded", False),
        "total_s": end - starts[0],
        "digest": mod.digest(state) if hasattr(mod, "digest") else None,
    }


def run_child(name: str, folder: Path, steps: int) -> dict[str, Any]:
    env = dict(os.environ, TERRA_SPEED_CHECK="0")
    out = subprocess.run([sys.executable, "-m", "benchmarks.warm_start_bench", "--child", name, str(folder), str(steps)],
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: the child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def bench(name: str, reps: int, steps: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    for _ in range(reps):
        with tempfile.TemporaryDirectory(prefix="terra_warm_") as folder:
            runs["cold"].append(run_child(name, Path(folder), steps))
            runs["warm"].append(run_child(name, Path(folder), steps))
    out: dict[str, Any] = {"program": name, "steps": steps, "reps": reps}
    for kind, rs in runs.items():
        out[kind] = {"first_coexec": median([r["first_coexec"] for r in rs]),
                     "seconds_to_coexec": median([r["seconds_to_coexec"] for r in rs]),
                     "load_s": median([r["load_s"] for r in rs]),
                     "loaded": all(r["loaded"] for r in rs),
                     "tracing_iterations": median([r["iterations"]["tracing"] for r in rs]),
                     "coexec_iterations": median([r["iterations"]["coexec"] for r in rs]),
                     "total_s": median([r["total_s"] for r in rs])}
    out["same_state"] = all(c["digest"] == w["digest"] for c, w in zip(runs["cold"], runs["warm"]))
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default=DEFAULT_PROGRAMS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="benchmarks/results/warm_start.json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    print(f"load before: {load_before}")
    results = []
    print(f"{'program':<12} {'cold: 1st coexec':>16} {'s':>7} {'warm: 1st coexec':>16} {'s':>7} {'load s':>7}  same state")
    for name in args.programs.split(","):
        r = bench(name, args.reps, args.steps)
        results.append(r)
        c, w = r["cold"], r["warm"]

        def fmt(v: Any, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        print(f"{name:<12} {fmt(c['first_coexec'], '>16')} {fmt(c['seconds_to_coexec'], '>7.3f')} "
              f"{fmt(w['first_coexec'], '>16')} {fmt(w['seconds_to_coexec'], '>7.3f')} {fmt(w['load_s'], '>7.3f')}  "
              f"{r['same_state']}", flush=True)
    load_after = os.getloadavg()
    print(f"load after: {load_after}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M"), "load_before_after": [load_before, load_after],
                                          "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
