"""Run the benchmark programs under every runner and write JSON, a Markdown report and plots.

    python -m benchmarks.run [--quick] [--only NAME[,NAME]] [--runners a,b] [--reps N]

Each (program, runner) cell runs in its own worker process (benchmarks/harness/worker.py) with a
time limit; eager always runs (it is the reference for speed and for correctness). Results go to
benchmarks/results/<quick|full>/: results.json, report.md, speedup.png, breakdown.png. A run
restricted with --only or --runners merges its cells into an existing results.json made with
the same settings, so a new runner (terra) can be added without rerunning the peers.

Ratios come from one run: every run has an id (meta.runs, with `uptime` before and after it),
every cell records the run that measured it, and whenever a program's cells are measured its
eager cell is measured again in the same run, before and after each group of runners (peers,
then terra). The eager cell keeps one baseline per run (`baselines`), and a cell's ratio divides
by the baseline of its own run only, never by a faster or slower eager of another run. This
process never imports torch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import compare, report
from benchmarks.programs import PROGRAMS

log = logging.getLogger("benchmarks.run")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PEER_RUNNERS = ("eager", "compile", "compile-step", "jit-trace", "jit-script", "lazy")
TERRA_RUNNERS = ("terra", "terra-lazy", "terra-graph-only")
# Compiled segments (optimize="fused"): asked for by name (their compiles take minutes per
# program on 2 cores), e.g. --runners eager,compile-step,terra-graph-only-fused,terra-fused.
FUSED_RUNNERS = ("terra-fused", "terra-graph-only-fused")
DEFAULT_RUNNERS = PEER_RUNNERS + TERRA_RUNNERS
KNOWN_RUNNERS = DEFAULT_RUNNERS + FUSED_RUNNERS
# Run id of cells measured before runs were recorded (results.json files written before this).
LEGACY_RUN = "before-run-ids"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="terra_torch benchmarks against eager and peers")
    p.add_argument("--quick", action="store_true", help="fewer steps per repetition")
    p.add_argument("--only", default="", help="comma-separated programs (default: all)")
    p.add_argument("--runners", default="",
                   help=f"comma-separated, from {', '.join(KNOWN_RUNNERS)}")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions after step 0")
    p.add_argument("--steps", type=int, default=None, help="steps per repetition (override)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per cell (default 900; 300 with --quick)")
    p.add_argument("--out", default="", help="results folder (default benchmarks/results/<tag>)")
    p.add_argument("--fresh", action="store_true", help="do not merge into existing results")
    return p.parse_args(argv)


def split_names(text: str, known: tuple[str, ...], default: tuple[str, ...]) -> list[str]:
    """Comma list to names, validated; empty means the default."""
    names = [n.strip() for n in text.split(",") if n.strip()] or list(default)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown: {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What must match for two runs' cells to sit in one table."""
    return {"quick": args.quick, "reps": args.reps, "warmup": args.warmup,
            "steps": args.steps, "threads": args.threads, "seed": args.seed}


def worker_command(program: str, runner: str, args: argparse.Namespace, out: Path,
                   rerun: bool) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.harness.worker", "--program", program,
           "--runner", runner, "--out", str(out), "--seed", str(args.seed),
           "--warmup", str(args.warmup), "--reps", str(args.reps),
           "--threads", str(args.threads)]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    if args.quick:
        cmd.append("--quick")
    if rerun:
        cmd.append("--rerun")
    return cmd


def run_cell(program: str, runner: str, args: argparse.Namespace, scratch: Path,
             rerun: bool = False) -> dict[str, Any]:
    """One worker process; a crash or timeout becomes a result, not an exception."""
    out = scratch / f"{program}.{runner}.json"
    log = scratch / f"{program}.{runner}.log"
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    load = round(os.getloadavg()[0], 2)  # other work on the machine when the cell started
    start = time.perf_counter()
    with open(log, "w") as log_file:
        try:
            proc = subprocess.run(worker_command(program, runner, args, out, rerun), cwd=ROOT,
                                  env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                  timeout=args.timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.perf_counter() - start
    if rc == 0 and out.exists():
        result = json.loads(out.read_text())
    elif out.exists():
        # The worker wrote its result and then hung or crashed on the way out (a runtime's exit
        # hooks): keep the result, and say so loudly.
        result = json.loads(out.read_text())
        how = f"did not exit within {args.timeout:.0f} s" if rc is None else f"exited with {rc}"
        result.setdefault("warnings", []).append(
            f"HARNESS: the worker wrote its result but then {how}: {_tail(log)}")
    elif rc is None:
        result = {"status": "timeout", "reason": f"no result within {args.timeout:.0f} s"}
    else:
        result = {"status": "crashed", "reason": f"worker exit code {rc}: {_tail(log)}"}
    result.update(program=program, runner=runner, cell_wall_s=round(wall, 2), load_avg_1m=load,
                  finished_at=dt.datetime.now().isoformat(timespec="seconds"))
    return result


def runner_groups(runners: list[str]) -> list[list[str]]:
    """The non-eager runners in the groups eager brackets: the peers, then the terra runners.

    Eager runs before the first group and after each one, so the terra cells have an eager
    measurement right before and right after them even when slow peers (compile) ran first.
    """
    peers = [r for r in runners if r != "eager" and r not in TERRA_RUNNERS + FUSED_RUNNERS]
    terra = [r for r in runners if r in TERRA_RUNNERS + FUSED_RUNNERS]
    return [g for g in (peers, terra) if g]


def run_program(program: str, runners: list[str], args: argparse.Namespace, scratch: Path,
                cells: dict[str, Any], run_id: str) -> None:
    """Eager (with its determinism rerun), then each runner group followed by eager again.

    Every cell gets `run_id`. The eager cell's `baselines` keeps, per run, the eager timings of
    that run; the baselines of earlier runs stay only while a cell of theirs is still in the
    table, since a cell's ratio uses its own run's baseline and nothing else.
    """
    earlier = cells.get("eager")
    eager = run_cell(program, "eager", args, scratch, rerun=True)
    eager["run_id"] = run_id
    cells["eager"] = eager
    print(progress(eager), flush=True)
    if eager.get("program_unavailable"):
        # The program cannot run here (a missing optional package): every runner alike.
        print(f"[bench] skipping {program}: {eager.get('reason')}", flush=True)
        for runner in runners[1:]:
            cells[runner] = {**eager, "runner": runner}
        return
    measured = [eager.get("steps_per_s")]
    for group in runner_groups(runners):
        for runner in group:
            cells[runner] = run_cell(program, runner, args, scratch)
            cells[runner]["run_id"] = run_id
            print(progress(cells[runner]), flush=True)
        if eager.get("status") == "ok":
            again = run_cell(program, "eager", args, scratch)
            print(progress(again, "eager (again)"), flush=True)
            measured.append(again.get("steps_per_s"))
    baselines = dict((earlier or {}).get("baselines") or {})
    record_eager_baseline(eager, measured, run_id, baselines)
    in_use = {c.get("run_id") for c in cells.values()}
    eager["baselines"] = {rid: b for rid, b in eager["baselines"].items() if rid in in_use}


def record_eager_baseline(eager: dict[str, Any], measured: list[Any], run_id: str | None = None,
                          earlier: dict[str, Any] | None = None) -> None:
    """Eager's timings of one run; its steps/s is the fastest of them (conservative under load).

    With a run id, the run's timings also go into `eager["baselines"][run_id]` next to the
    `earlier` runs' baselines, which is what report.baseline() divides by.
    """
    runs = [r for r in measured if isinstance(r, (int, float))]
    eager["steps_per_s_runs"] = runs
    if runs:
        eager["steps_per_s"] = max(runs)
    if run_id is not None:
        eager["baselines"] = {**(earlier or {}), run_id: {
            "steps_per_s": max(runs) if runs else None, "steps_per_s_runs": runs,
            "finished_at": dt.datetime.now().isoformat(timespec="seconds")}}


def uptime() -> dict[str, Any]:
    """`uptime`'s line and the load averages: how busy the machine was around a run."""
    try:
        line = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("uptime failed (%s); recording os.getloadavg() only", exc)
        line = ""
    return {"uptime": line, "load_avg": [round(v, 2) for v in os.getloadavg()],
            "at": dt.datetime.now().isoformat(timespec="seconds")}


def new_run(doc: dict[str, Any], programs: list[str], runners: list[str],
            argv: list[str]) -> dict[str, Any]:
    """Append this run to meta.runs (id = its start time, unique within the document)."""
    started = dt.datetime.now().isoformat(timespec="seconds")
    taken = {r["id"] for r in doc["meta"]["runs"]}
    run_id, k = started, 1
    while run_id in taken:
        k += 1
        run_id = f"{started}.{k}"
    run = {"id": run_id, "started": started, "programs": programs, "runners": runners,
           "command": " ".join(["python -m benchmarks.run", *argv]), "before": uptime()}
    doc["meta"]["runs"].append(run)
    return run


def prune_runs(doc: dict[str, Any]) -> None:
    """Drop runs none of whose cells are left (a later run re-measured all of them)."""
    in_use = {c.get("run_id") for cells in doc["cells"].values() for c in cells.values()}
    doc["meta"]["runs"] = [r for r in doc["meta"]["runs"] if r["id"] in in_use]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(line.strip() for line in text[-lines:])[:600]


def load_existing(path: Path, want: dict[str, Any], fresh: bool) -> dict[str, Any]:
    """Previous results with the same settings (to merge into), else an empty document."""
    if not fresh and path.exists():
        doc = json.loads(path.read_text())
        if doc.get("meta", {}).get("settings") == want:
            migrate(doc)
            return doc
    return {"meta": {"settings": want, "runs": []}, "cells": {}}


def migrate(doc: dict[str, Any]) -> None:
    """Give cells of a results.json written before run ids the run LEGACY_RUN.

    Their eager steps/s may already be the fastest of several runs; it becomes that legacy
    run's baseline, used only for the legacy cells (and labelled so in the report).
    """
    meta = doc["meta"]
    meta.setdefault("runs", [])
    legacy = False
    for cells in doc["cells"].values():
        for cell in cells.values():
            if "run_id" not in cell:
                cell["run_id"] = LEGACY_RUN
                legacy = True
        eager = cells.get("eager")
        if eager is not None and "baselines" not in eager:
            eager["baselines"] = {LEGACY_RUN: {
                "steps_per_s": eager.get("steps_per_s"),
                "steps_per_s_runs": eager.get("steps_per_s_runs", [])}}
    if legacy and not any(r["id"] == LEGACY_RUN for r in meta["runs"]):
        meta["runs"].insert(0, {"id": LEGACY_RUN, "finished": meta.get("updated"),
                                "note": "measured before runs were recorded: the eager "
                                        "baseline may be the fastest of several runs"})


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}


def attach_correctness(doc: dict[str, Any], run_id: str | None = None) -> None:
    """Verdict of every cell against eager's cell of the same program. With `run_id`, a cell of
    an earlier run that has its verdict keeps it: it was judged against the eager of its own run,
    and the eager cell now holds this run's results. Bits may differ between the two: a GEMM's
    kernel depends on the host's CPU (MKL), and runs merged from two hosts turned every earlier
    bitwise terra cell into a MISMATCH (session 36)."""
    for program, cells in doc["cells"].items():
        ref = cells.get("eager", {})
        for runner, cell in cells.items():
            if run_id is not None and cell.get("run_id") != run_id and "correctness" in cell:
                continue
            if runner == "eager":
                cell["correctness"] = {"verdict": compare.determinism(cell)}
            elif runner.startswith("terra-graph-only"):
                cell["correctness"] = compare.replay_verdict(ref, cell)
            elif runner == "terra-fused":
                # Within a tolerance of eager, like torch.compile's cells (docs/RUNTIME.md).
                cell["correctness"] = compare.verdict(ref, cell)
            elif runner.startswith("terra"):
                cell["correctness"] = compare.terra_verdict(ref, cell)
            else:
                cell["correctness"] = compare.verdict(ref, cell)


def progress(cell: dict[str, Any], label: str = "") -> str:
    sps = cell.get("steps_per_s")
    speed = f"{sps:9.1f} steps/s" if isinstance(sps, (int, float)) else f"{'-':>9} steps/s"
    why = cell.get("reason") or (cell.get("error") or {}).get("message", "")
    return (f"  {cell['program']:12s} {label or cell['runner']:17s} {cell['status']:11s} {speed}"
            f"  [{cell['cell_wall_s']:.0f}s] {why[:90]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.timeout is None:
        args.timeout = 300.0 if args.quick else 900.0
    programs = split_names(args.only, PROGRAMS, PROGRAMS)
    runners = split_names(args.runners, KNOWN_RUNNERS, DEFAULT_RUNNERS)
    runners = ["eager"] + [r for r in runners if r != "eager"]
    if args.reps < 5:
        print(f"[bench] note: --reps {args.reps} < 5; the method asks for a median of >= 5")
    out_dir = Path(args.out) if args.out else RESULTS / ("quick" if args.quick else "full")
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = load_existing(out_dir / "results.json", settings(args), args.fresh)
    run = new_run(doc, programs, runners, sys.argv[1:] if argv is None else argv)
    print(f"[bench] run {run['id']}: {len(programs)} programs x {len(runners)} runners -> "
          f"{out_dir}; before: {run['before']['uptime']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="terra-bench-") as scratch:
        for program in programs:
            run_program(program, runners, args, Path(scratch),
                        doc["cells"].setdefault(program, {}), run["id"])
    run["after"] = uptime()
    run["finished"] = run["after"]["at"]
    print(f"[bench] run {run['id']} done; after: {run['after']['uptime']}", flush=True)
    prune_runs(doc)
    doc["meta"].update(machine=machine(), updated=dt.datetime.now().isoformat(timespec="seconds"),
                       rtol=compare.RTOL)
    attach_correctness(doc, run["id"])
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    written = report.write_all(doc, out_dir)
    print(f"[bench] wrote {', '.join(_rel(p) for p in written)}")
    print(report.summary_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
