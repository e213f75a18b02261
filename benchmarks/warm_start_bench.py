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

With `--optimize fused`, also the seconds until every segment that ran runs compiled code (cold:
compiling them; warm: loading the packages the cold run kept under the same folder).

    python -m benchmarks.warm_start_bench --programs mlp,cnn_bn,lstm --reps 5
    python -m benchmarks.warm_start_bench --programs mlp --reps 1 --optimize fused
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


def _settled(program: Any) -> tuple[bool, int]:
    """optimize="fused": whether no segment that ran waits for its compiler, and how many are
    trusted (run compiled)."""
    fused = program._session.fused
    if fused is None:
        return False, 0
    report = list(fused.report())
    waiting = any(r["state"] in ("requested", "compiling", "loaded") for r in report)
    done = sum(r["state"] in ("trusted", "interpreted") for r in report)  # ("new": has not run yet)
    return done > 0 and not waiting, sum(r["state"] == "trusted" for r in report)


def child(name: str, folder: str, steps: int, optimize: str) -> dict[str, Any]:
    import torch

    import terra_torch
    from benchmarks.harness.runtime import Runtime, load_program

    fused = optimize == "fused"
    opts: dict[str, Any] = {"warm_start": folder, "speed_check": False, "optimize": "fused" if fused else False}
    mod = load_program(name)
    by_step = getattr(mod, "TERRA_ITERATION", "model") == "step"
    wrapped: list[Any] = []

    def wrap(model: Any, example: Any) -> Any:
        if by_step:
            return model
        wrapped.append(terra_torch.wrap(model, **opts))
        return wrapped[-1]

    torch.manual_seed(0)
    state = mod.build(0, Runtime("cpu", wrap))
    step = mod.step
    if by_step:
        step = terra_torch.function(mod.step, **opts)
        wrapped.append(step)
    program = wrapped[0]._terra_program
    starts = []
    compiled_at: float | None = None
    trusted = 0
    deadline = time.perf_counter() + 900
    i = 0
    # (fused: steps go on past `steps` until every segment that ran is compiled and checked)
    while i < steps or (fused and compiled_at is None and time.perf_counter() < deadline):
        starts.append(time.perf_counter())
        step(state, i)
        i += 1
        if fused and compiled_at is None:
            settled, trusted = _settled(program)
            if settled:
                compiled_at = time.perf_counter() - starts[0]
    terra_torch.synchronize()
    end = time.perf_counter()
    s = terra_torch.stats(wrapped[0])
    first = next((it for it, _old, new in s.transitions if new == "coexec"), None)
    return {
        "steps_run": i,
        "seconds_to_compiled": compiled_at,
        "segments_trusted": trusted,
        "first_coexec": first,
        # (a warm start reads the kept traces inside the first iteration's begin: counted here)
        "seconds_to_coexec": (starts[first] - starts[0] + (s.warm_start or {}).get("load_s", 0.0)
                              if first is not None else None),
        "iterations": s.iterations,
        "load_s": (s.warm_start or {}).get("load_s", 0.0),
        "import_s": (s.warm_start or {}).get("import_s", 0.0),
        "build_s": (s.warm_start or {}).get("build_s", 0.0),
        "loaded": (s.warm_start or {}).get("loaded", False),
        "total_s": end - starts[0],
        # (fused runs go on for more steps: their digests are not compared)
        "digest": mod.digest(state) if hasattr(mod, "digest") and not fused else None,
    }


def run_child(name: str, folder: Path, steps: int, optimize: str) -> dict[str, Any]:
    # Compiled segments are kept beside the program (a cold run compiles them all).
    env = dict(os.environ, TERRA_SPEED_CHECK="0", TERRA_CACHE_DIR=str(folder / "cache"))
    out = subprocess.run([sys.executable, "-m", "benchmarks.warm_start_bench", "--child", name, str(folder), str(steps),
                          optimize], capture_output=True, text=True, env=env, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: the child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def bench(name: str, reps: int, steps: int, optimize: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    for _ in range(reps):
        with tempfile.TemporaryDirectory(prefix="terra_warm_") as folder:
            runs["cold"].append(run_child(name, Path(folder), steps, optimize))
            runs["warm"].append(run_child(name, Path(folder), steps, optimize))
    out: dict[str, Any] = {"program": name, "steps": steps, "reps": reps, "optimize": optimize}
    for kind, rs in runs.items():
        out[kind] = {"first_coexec": median([r["first_coexec"] for r in rs]),
                     "seconds_to_coexec": median([r["seconds_to_coexec"] for r in rs]),
                     "load_s": median([r["load_s"] for r in rs]),
                     "import_s": median([r["import_s"] for r in rs]),
                     "build_s": median([r["build_s"] for r in rs]),
                     "loaded": all(r["loaded"] for r in rs),
                     "tracing_iterations": median([r["iterations"]["tracing"] for r in rs]),
                     "coexec_iterations": median([r["iterations"]["coexec"] for r in rs]),
                     "total_s": median([r["total_s"] for r in rs]),
                     "seconds_to_compiled": median([r["seconds_to_compiled"] for r in rs]),
                     "segments_trusted": median([r["segments_trusted"] for r in rs])}
    out["same_state"] = all(c["digest"] == w["digest"] for c, w in zip(runs["cold"], runs["warm"]))
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default=DEFAULT_PROGRAMS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--optimize", choices=("none", "fused"), default="none",
                    help="fused: also the seconds until every segment that ran is compiled and trusted")
    ap.add_argument("--out", default="benchmarks/results/warm_start.json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    print(f"load before: {load_before}")
    results = []
    print(f"{'program':<12} {'cold: 1st coexec':>16} {'s':>7} {'warm: 1st coexec':>16} {'s':>7} {'load s':>7}  same state")
    for name in args.programs.split(","):
        r = bench(name, args.reps, args.steps, args.optimize)
        results.append(r)
        c, w = r["cold"], r["warm"]

        def fmt(v: Any, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        compiled = (f"  compiled code after {fmt(c['seconds_to_compiled'], '.1f')} s cold, "
                    f"{fmt(w['seconds_to_compiled'], '.1f')} s warm ({fmt(w['segments_trusted'], '.0f')} segments)"
                    if args.optimize == "fused" else "")
        print(f"{name:<12} {fmt(c['first_coexec'], '>16')} {fmt(c['seconds_to_coexec'], '>7.3f')} "
              f"{fmt(w['first_coexec'], '>16')} {fmt(w['seconds_to_coexec'], '>7.3f')} {fmt(w['load_s'], '>7.3f')}  "
              f"{r['same_state']}  (load: merge {fmt(w['import_s'], '.3f')} s, generate {fmt(w['build_s'], '.3f')} s)"
              f"{compiled}", flush=True)
    load_after = os.getloadavg()
    print(f"load after: {load_after}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M"), "load_before_after": [load_before, load_after],
                                          "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
