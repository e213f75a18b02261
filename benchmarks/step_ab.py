"""Step time of quick-suite programs under several variants, in interleaved processes (A/B).

A change that moves one program by 10-20% is invisible in `benchmarks.run --quick` on a shared
machine (its cells spread by more than 25% when another tenant runs). This runs each variant of
each program in its own process, the variants one after another in every round, and reports the
median of the rounds: a burst of load hits all variants of a round alike.

A variant is a runner (`eager` or `terra`) with optional environment settings:

    python -m benchmarks.step_ab --programs branches,materialize,mutation \\
        --variants eager,terra,terra:TERRA_EARLY_BATCHES=0 --reps 5 --steps 800

`terra:TERRA_AB_OPTIMIZE=fused` wraps with optimize="fused" and, after the warm-up, runs on until
every compiled segment is checked (docs/RUNTIME.md, "Compiled segments"; set TERRA_CACHE_DIR to a
directory a previous run filled to time a warm start). Terra variants run with the speed check off (TERRA_SPEED_CHECK=0): they compare co-execution
policies, not the check's choice; `terra:TERRA_AB_SPEED_CHECK=1` keeps it on (with `--warmup 0`: what
a user's run of `--steps` steps costs, tracing and the check's turns included; the child reports
the share of co-executed iterations), and `TERRA_AB_COEXEC_SETTLE=auto` beside it lets co-executed
blocks settle for 50 ms like eager ones (terra_torch/_speed.py). A program marked TERRA_ITERATION = "step" is wrapped with
terra_torch.function, the others with terra_torch.wrap, as the benchmark harness does.
`terra:TERRA_AB_PHASE=eager` times the wrapped program's eager iterations (`run_eagerly` after the
warm-up, as after a speed check that chose eager) against plain eager's. Each child
warms up (`--warmup` steps: tracing, graph generation, the first co-executed iterations), then
times `--steps` steps and prints one JSON line (for terra, also the graph builds during the timed
steps and the seconds they and the traced iterations took on the program's thread: a program
that still learns paths, `trip_count`, pays them inside the timing). `--threads N` sets torch's intra-op threads in
every child (1 by default; torch's own default is one per core). `terra:TERRA_AB_ROOT=/path` runs that
variant from another checkout (its `terra_torch` and built extension, its benchmark programs): a
change against the build before it, in the same interleaved rounds (a `git worktree` of the old
commit with the old build's `terra_torch/_C*.so` copied in).
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
import json, os, sys, time
import torch
torch.set_num_threads(int(os.environ.get("TERRA_AB_THREADS", "1")))
from benchmarks.harness.runtime import Runtime, load_program
name, runner, warmup, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
mod = load_program(name)
per_step = getattr(mod, "TERRA_ITERATION", "model") == "step"
optimize = "fused" if os.environ.get("TERRA_AB_OPTIMIZE") == "fused" else False
check = os.environ.get("TERRA_AB_SPEED_CHECK") == "1"
wrapped = []
if runner == "terra":
    import terra_torch
def wrap(model, example_inputs):
    if runner == "terra" and not per_step:
        wrapped.append(terra_torch.wrap(model, speed_check=check, optimize=optimize))
        return wrapped[-1]
    return model
state = mod.build(0, Runtime("cpu", wrap))
if runner == "terra" and per_step:
    step = terra_torch.function(mod.step, speed_check=check, optimize=optimize)
    wrapped.append(step)
else:
    step = mod.step
if check and os.environ.get("TERRA_AB_COEXEC_SETTLE") == "auto":  # (co-executed blocks settle as eager ones)
    for w in wrapped:
        w._terra_program._speed.coexec_settle_s = None
for i in range(warmup):
    step(state, i)
compile_wait_s = 0.0
if optimize:  # run on until no segment waits for the compiler (as the harness's settle())
    # ("loaded" counts as settled: a segment whose package is loaded is checked on its next run,
    # and one on a path the warm-up steps no longer take would keep this loop going forever.)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < float(os.environ.get("TERRA_AB_COMPILE_S", "1200")):
        segs = [s for w in wrapped for s in (terra_torch.explain(w).segments or [])]
        if segs and not any(s["state"] in ("requested", "compiling") for s in segs):
            break
        for i in range(warmup, warmup + 20):
            step(state, i)
    compile_wait_s = time.perf_counter() - t0
if runner == "terra":
    terra_torch.synchronize()
if os.environ.get("TERRA_AB_PHASE") == "eager":  # (the wrapped program's eager iterations)
    for w in wrapped:
        w._terra_program.run_eagerly("step_ab: TERRA_AB_PHASE=eager")
def learning():  # (graph builds and traced iterations so far; an older checkout has no build_s)
    st = [terra_torch.stats(w) for w in wrapped]
    return [sum(s.graph_builds for s in st), sum(getattr(s, "build_s", 0.0) for s in st),
            sum(s.tracing_s for s in st)]
learned = learning() if runner == "terra" else None
t0, c0 = time.perf_counter(), time.thread_time()
for i in range(warmup, warmup + steps):
    step(state, i)
if runner == "terra":
    terra_torch.synchronize()
out = {"ms": (time.perf_counter() - t0) / steps * 1e3, "cpu_ms": (time.thread_time() - c0) / steps * 1e3}
if runner == "terra":
    phases = [terra_torch.stats(w).iterations for w in wrapped]
    out["coexec_share"] = sum(p["coexec"] for p in phases) / max(1, sum(sum(p.values()) for p in phases))
    builds, build_s, tracing_s = (b - a for a, b in zip(learned, learning()))
    out.update(builds=builds, build_ms=build_s * 1e3, tracing_ms=tracing_s * 1e3)
if optimize:
    segs = [s for w in wrapped for s in (terra_torch.explain(w).segments or [])]
    out.update(compile_wait_s=compile_wait_s, segments=len(segs),
               trusted=sum(s["state"] == "trusted" for s in segs),
               compiled_runs=sum(s["compiled_runs"] for s in segs))
print(json.dumps(out))
"""


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    runner, _, settings = text.partition(":")
    if runner not in ("eager", "terra"):
        raise SystemExit(f"variant {text!r}: the runner must be eager or terra")
    env = dict(s.split("=", 1) for s in settings.split(";") if s)
    return runner, env


def run_child(program: str, variant: str, warmup: int, steps: int, threads: int = 1) -> dict:
    runner, settings = parse_variant(variant)
    root = Path(settings.get("TERRA_AB_ROOT", ROOT))  # another checkout with its own build
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TERRA_SPEED_CHECK="1" if settings.get("TERRA_AB_SPEED_CHECK") == "1" else "0",
               TERRA_AB_THREADS=str(threads), **settings)
    done = subprocess.run([sys.executable, "-c", CHILD, program, runner, str(warmup), str(steps)], cwd=root,
                          env=env, capture_output=True, text=True,
                          timeout=900 + float(env.get("TERRA_AB_COMPILE_S", "1200")))  # (the compile wait, then the steps)
    if done.returncode != 0:
        raise SystemExit(f"{program} / {variant} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", default="branches,materialize,mutation")
    p.add_argument("--variants", default="eager,terra,terra:TERRA_EARLY_BATCHES=0",
                   help="comma-separated runner[:VAR=value;VAR=value]")
    p.add_argument("--reps", type=int, default=5, help="rounds (medians)")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every child")
    args = p.parse_args(argv)
    programs, variants = args.programs.split(","), args.variants.split(",")
    print("uptime before:", os.getloadavg())
    cells: dict[tuple[str, str], list[dict]] = {(pr, v): [] for pr in programs for v in variants}
    for _ in range(args.reps):
        for program in programs:
            for variant in variants:
                cells[(program, variant)].append(run_child(program, variant, args.warmup, args.steps, args.threads))
    print("uptime after: ", os.getloadavg())
    print(f"{'program':12s} {'variant':34s} {'ms/step':>8s} {'x eager':>8s}  (each round)")
    for program in programs:
        eager = [c["ms"] for c in cells.get((program, "eager"), [])]
        for variant in variants:
            ms = [c["ms"] for c in cells[(program, variant)]]
            ratio = f"{statistics.median(eager) / statistics.median(ms):7.2f}x" if eager else "       -"
            extra = ""
            if "segments" in cells[(program, variant)][-1]:
                last = cells[(program, variant)][-1]
                extra = (f"  [{last['trusted']} of {last['segments']} segments compiled, "
                         f"compile wait {statistics.median(c['compile_wait_s'] for c in cells[(program, variant)]):.1f} s]")
            if "coexec_share" in cells[(program, variant)][-1]:
                extra += f"  [co-executed {statistics.median(c['coexec_share'] for c in cells[(program, variant)]):.0%}]"
            if any(c.get("builds") or c.get("tracing_ms") for c in cells[(program, variant)]):
                rows = cells[(program, variant)]
                extra += (f"  [timed steps, median: {statistics.median(c['builds'] for c in rows):g} graph builds "
                          f"taking {statistics.median(c['build_ms'] for c in rows):.1f} ms, "
                          f"traced iterations {statistics.median(c['tracing_ms'] for c in rows):.1f} ms]")
            print(f"{program:12s} {variant:34s} {statistics.median(ms):8.3f} {ratio}  "
                  f"({', '.join('%.3f' % m for m in ms)}){extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
