"""Co-execution against eager, terra's lazy (serialized) mode and the graph-only bound, on the two
programs where the question "does overlapping Python with the graph pay?" is sharpest: the
overhead-bound MLP (benchmarks/programs/mlp.py) and the small CNN with BatchNorm
(benchmarks/programs/cnn_bn.py).

    .venv/bin/python -m benchmarks.coexec_bench [--reps 7] [--warmup 2] [--steps N] [--rounds 1]

It reuses the benchmark harness's worker (one process per cell, the same timing, the same
correctness check against eager) but runs the full-size repetitions, more of them, and eager
before and after the terra cells, and prints one compact table with ratios, phases, fallbacks
and the per-step time breakdown. Results: benchmarks/results/coexec.json. This process never
imports torch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import run as bench_run
from benchmarks.harness import compare, report

PROGRAMS = ("mlp", "cnn_bn")
TERRA = ("terra", "terra-lazy", "terra-graph-only")
OUT = bench_run.RESULTS / "coexec.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per cell (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="steps per repetition (default: the "
                   "program's full STEPS_PER_REP)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every cell this many times; the table shows the median round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    p.add_argument("--out", default=str(OUT))
    return p.parse_args(argv)


def worker_args(args: argparse.Namespace) -> argparse.Namespace:
    """The namespace benchmarks.run.run_cell expects (full-size repetitions: quick=False)."""
    return argparse.Namespace(seed=args.seed, warmup=args.warmup, reps=args.reps,
                              steps=args.steps, threads=args.threads, quick=False,
                              timeout=args.timeout)


def measure(program: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Eager, the terra cells, eager again; `rounds` times. Cells keep every round's steps/s."""
    wargs = worker_args(args)
    rounds: list[dict[str, Any]] = []
    for k in range(args.rounds):
        cells: dict[str, Any] = {"eager": bench_run.run_cell(program, "eager", wargs, scratch,
                                                             rerun=k == 0)}
        print(bench_run.progress(cells["eager"]), flush=True)
        for runner in TERRA:
            cells[runner] = bench_run.run_cell(program, runner, wargs, scratch)
            print(bench_run.progress(cells[runner]), flush=True)
        again = bench_run.run_cell(program, "eager", wargs, scratch)
        print(bench_run.progress(again, "eager (again)"), flush=True)
        bench_run.record_eager_baseline(
            cells["eager"], [cells["eager"].get("steps_per_s"), again.get("steps_per_s")])
        rounds.append(cells)
    return median_round(rounds)


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per runner the round with the median steps/s (failed rounds sort first: they show)."""
    out: dict[str, Any] = {}
    for runner in rounds[0]:
        cells = [r[runner] for r in rounds]
        cells.sort(key=lambda c: c.get("steps_per_s") or -1.0)
        chosen = dict(cells[(len(cells) - 1) // 2] if all(c.get("status") == "ok" for c in cells)
                      else next(c for c in cells if c.get("status") != "ok"))
        chosen["rounds_steps_per_s"] = [c.get("steps_per_s") for c in cells]
        out[runner] = chosen
    if "rerun" not in out["eager"]:
        out["eager"]["rerun"] = rounds[0]["eager"].get("rerun")
    return out


def table(doc: dict[str, Any]) -> str:
    lines = [f"{'program':8s} {'runner':17s} {'steps/s':>9s} {'x eager':>8s} {'correct':>10s} "
             f"{'phases trace/coexec/eager':>26s} {'fallbacks':>9s}  ms/step: py exec, py stall, "
             "graph exec, graph stall"]
    for program, cells in doc["cells"].items():
        base = cells["eager"].get("steps_per_s")
        for runner in ("eager",) + TERRA:
            cell = cells.get(runner, {})
            sps = cell.get("steps_per_s")
            speed = f"{sps:9.0f}" if isinstance(sps, (int, float)) else f"{'-':>9s}"
            ratio = f"{sps / base:7.2f}x" if isinstance(sps, (int, float)) and base else f"{'-':>8s}"
            if cell.get("status") == "unavailable" and runner == "terra-graph-only":
                derived = report.derived_graph_only(doc, program)
                if derived and base:
                    speed = f"d:{derived['steps_per_s']:7.0f}"
                    ratio = f"{derived['steps_per_s'] / base:7.2f}x"
            verdict = cell.get("correctness", {}).get("verdict", cell.get("status", ""))
            stats = cell.get("stats") or {}
            ph = stats.get("phases") or {}
            phases = (f"{ph.get('tracing', 0)}/{ph.get('coexec', 0)}/{ph.get('eager', 0)}"
                      if ph else "")
            fallbacks = str(stats.get("fallbacks", "")) if ph else ""
            b = report.per_step_ms(cell)
            split = (f"{b['python_exec_s']:.3f}, {b['python_stall_s']:.3f}, "
                     f"{b['graph_exec_s']:.3f}, {b['graph_stall_s']:.3f}" if b else "")
            if cell.get("status") not in ("ok", "unavailable"):
                err = (cell.get("error") or {}).get("message") or cell.get("reason", "")
                split = f"{cell.get('status')}: {err[:90]}"
            lines.append(f"{program:8s} {runner:17s} {speed} {ratio} {verdict:>10s} "
                         f"{phases:>26s} {fallbacks:>9s}  {split}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, "-m",
                                                "benchmarks.coexec_bench", *(argv or sys.argv[1:])])
    doc: dict[str, Any] = {"meta": {
        "command": command, "settings": vars(args),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg_1m_start": round(os.getloadavg()[0], 2),
                    "uptime_start": bench_run.uptime()},
        "started": dt.datetime.now().isoformat(timespec="seconds")}, "cells": {}}
    print(f"[coexec_bench] {command}", flush=True)
    with tempfile.TemporaryDirectory(prefix="terra-coexec-") as scratch:
        for program in PROGRAMS:
            doc["cells"][program] = measure(program, args, Path(scratch))
    for cells in doc["cells"].values():
        ref = cells["eager"]
        ref["correctness"] = {"verdict": compare.determinism(ref)}
        for runner in TERRA:
            check = compare.replay_verdict if runner == "terra-graph-only" else compare.terra_verdict
            cells[runner]["correctness"] = check(ref, cells[runner])
    doc["meta"]["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    doc["meta"]["machine"]["uptime_end"] = bench_run.uptime()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print()
    print(table(doc))
    print(f"\nsteps/s: median of {args.reps} timed repetitions after {args.warmup} warm-up; "
          "eager: the faster of its runs before and after the terra cells; d: = derived from "
          "the terra cell's GraphRunner exec time (no replay possible); ms/step over the timed "
          "repetitions from terra_torch.stats().")
    print(f"command: {command}\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
