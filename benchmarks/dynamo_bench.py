"""`torch.compile(model, backend="terra")` against eager and Inductor, on the harness's programs.

Why this exists: the terra Dynamo backend (terra_torch/dynamo_backend.py) is only worth using
if it is at least as fast as the alternatives a `torch.compile` user already has, and its cost
has to be told apart from Dynamo's own. So the same programs (benchmarks/programs/: a static
MLP, data-dependent branches, `.item()`/numpy/print materialization) run under

    eager       the plain module
    inductor    torch.compile(model): the default backend
    aot_eager   torch.compile(model, backend="aot_eager"): Dynamo + AOTAutograd, graphs run as
                plain Python; the same graphs terra gets, without terra (its cost floor)
    terra       torch.compile(model, backend="terra"): mode "graph" (the default), the generated
                graph run directly, no per-op Python
    terra-overlap  options={"overlap": True}: mode "graph" where calls of graphs without side
                effects return at once and the next op waits for the graph
    terra-coexec  options={"mode": "coexec"}: every op validated by Python (co-execution)
    terra-lazy  options={"mode": "lazy"}: co-execution whose graph runs only when Python waits

    python -m benchmarks.dynamo_bench [--programs mlp,branches,materialize] [--reps 5]
        [--warmup 2] [--steps N] [--backends eager,inductor,...] [--out FILE]

Each (program, backend) cell runs in its own process (Dynamo's caches and terra_torch's
dispatcher interceptor stay inside it): build, step 0 alone (compilation: reported as first
step), `--warmup` untimed repetitions, then `--reps` timed repetitions of N steps (the program's
quick count unless --steps); reported is the median repetition as steps/s and its ratio to
eager. Losses are compared with eager's after timing. Results: benchmarks/results/dynamo.json
and a table on stdout. The file keeps a summary of each cell's per-step losses instead of the
losses (`compact_results`): the comparison with eager is made before writing, and thousands of
losses per cell made the file megabytes. This parent process never imports torch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "dynamo.json"
BACKENDS = ("eager", "inductor", "aot_eager", "terra", "terra-overlap", "terra-coexec", "terra-lazy")
PROGRAMS = ("mlp", "branches", "materialize")
RESULT_TAG = "DYNAMO_BENCH_RESULT "


# ---- one cell (child process) ------------------------------------------------------------------


def _compile_hook(backend: str) -> Any:
    import torch

    if backend == "eager":
        return lambda model, example_inputs: model
    if backend == "inductor":
        return lambda model, example_inputs: torch.compile(model)
    if backend == "aot_eager":
        return lambda model, example_inputs: torch.compile(model, backend="aot_eager")
    if backend == "terra":
        return lambda model, example_inputs: torch.compile(model, backend="terra")
    if backend == "terra-overlap":
        return lambda model, example_inputs: torch.compile(model, backend="terra", options={"overlap": True})
    if backend in ("terra-coexec", "terra-lazy"):
        mode = backend.split("-")[1]
        return lambda model, example_inputs: torch.compile(model, backend="terra", options={"mode": mode})
    raise ValueError(f"unknown backend {backend!r}")


def _sync(backend: str) -> None:
    if backend.startswith("terra"):
        import terra_torch

        terra_torch.synchronize()


def run_cell(program: str, backend: str, reps: int, warmup: int, steps: int | None, seed: int) -> dict[str, Any]:
    """Time one program under one backend; failures are recorded, never raised."""
    import contextlib

    import torch
    from torch._dynamo.utils import counters

    from benchmarks.harness.runtime import Runtime, load_program

    # One intra-op thread, as the main harness: the comparison is about per-op overhead and
    # overlap, not about how many cores a 2-core shared machine lends to a kernel.
    torch.set_num_threads(1)
    result: dict[str, Any] = {"program": program, "backend": backend, "status": "ok"}
    phase = "build"
    try:
        module = load_program(program)
        n = steps or getattr(module, "QUICK_STEPS_PER_REP", module.STEPS_PER_REP)
        rt = Runtime("cpu", _compile_hook(backend))
        state = module.build(seed, rt)
        losses: list[Any] = []
        devnull = open(os.devnull, "w")  # the programs print progress; it is not measured output
        with contextlib.redirect_stdout(devnull):
            phase = "first step"
            t0 = time.perf_counter()
            losses.append(module.step(state, 0))
            _sync(backend)
            result["first_step_s"] = time.perf_counter() - t0
            i = 1
            phase = "warm-up"
            for _ in range(warmup):
                for _ in range(n):
                    losses.append(module.step(state, i))
                    i += 1
                _sync(backend)
            phase = "timed repetitions"
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(n):
                    losses.append(module.step(state, i))
                    i += 1
                _sync(backend)
                times.append(time.perf_counter() - t0)
        phase = "results"
        result.update(steps_per_rep=n, rep_s=times, steps_per_s=n / statistics.median(times),
                      losses=[float(v) for v in losses],
                      digest=[float(v) for v in module.digest(state)] if hasattr(module, "digest") else [])
        result["dynamo"] = {
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "frames_compiled": int(counters["frames"]["total"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
        }
        if backend.startswith("terra"):
            result["terra"] = _terra_summary()
    except Exception as exc:  # noqa: BLE001 - a failing backend is a result, not a crash
        msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
        result.update(status="failed", phase=phase, reason=" | ".join(msg[:3])[:600])
    return result


def _terra_summary() -> dict[str, Any]:
    from terra_torch import dynamo_backend

    graphs = dynamo_backend.graphs()
    iterations = {"tracing": 0, "coexec": 0, "eager": 0, "direct": 0, "deferred": 0, "recorded": 0}
    out: dict[str, Any] = {"graphs": len(graphs), "fallbacks": 0, "sync_s": 0.0, "python_exec_s": 0.0,
                           "graph_exec_s": 0.0, "graph_stall_s": 0.0,
                           "eager_graphs": [f"{g.name}: {g.eager_reason}" for g in graphs if g.eager_reason]}
    out["direct_refused"] = [f"{g.name}: {g.direct_reason}" for g in graphs if g.direct_reason]
    for g in graphs:
        out["sync_s"] += g.sync_s
        iterations["direct"] += g.direct_calls
        iterations["deferred"] += g.deferred_calls
        iterations["recorded"] += g.traced_calls
        st = g.stats()
        if st is None:
            continue
        for k, v in st.iterations.items():
            iterations[k] = iterations.get(k, 0) + v
        out["fallbacks"] += st.fallbacks
        out["python_exec_s"] += st.python_exec_s
        out["graph_exec_s"] += st.graph_exec_s
        out["graph_stall_s"] += st.graph_stall_s
    out["iterations"] = iterations
    return out


# ---- the parent ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="torch.compile backends: eager, inductor, aot_eager, terra")
    p.add_argument("--programs", default=",".join(PROGRAMS), help="comma-separated benchmarks/programs names")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {', '.join(BACKENDS)}")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions after step 0")
    p.add_argument("--steps", type=int, default=None, help="steps per repetition (default: the program's quick count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results file")
    p.add_argument("--cell", nargs=2, metavar=("PROGRAM", "BACKEND"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _spawn(program: str, backend: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.dynamo_bench", "--cell", program, backend,
           "--reps", str(args.reps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"program": program, "backend": backend, "status": "failed", "phase": "cell",
                "reason": f"timed out after {args.timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            result["cell_wall_s"] = time.perf_counter() - t0
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"program": program, "backend": backend, "status": "failed", "phase": "process",
            "reason": f"exit {proc.returncode}: " + " | ".join(tail)}


def _agreement(result: dict[str, Any], eager: dict[str, Any] | None) -> str:
    """How the cell's losses compare with eager's: bitwise, or the largest relative difference."""
    if result.get("status") != "ok" or not eager or eager.get("status") != "ok":
        return "-"
    a, b = result["losses"], eager["losses"]
    if a == b and result.get("digest") == eager.get("digest"):
        return "bitwise"
    rel = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)
    return f"max rel {rel:.1e}"


def _loss_summary(losses: list[float], eager: dict[str, Any] | None) -> dict[str, Any]:
    """Enough of a cell's losses to tell runs apart: the hash changes with any bit of any loss, and
    the first step that differs from eager's says where a disagreement started."""
    out: dict[str, Any] = {"steps": len(losses), "first": losses[0] if losses else None,
                           "last": losses[-1] if losses else None,
                           "sha256": hashlib.sha256(json.dumps(losses).encode()).hexdigest()}
    if eager and eager.get("status") == "ok":
        ref = eager["losses"]
        diff = next((i for i, (x, y) in enumerate(zip(losses, ref)) if x != y), None)
        if diff is None and len(losses) != len(ref):
            diff = min(len(losses), len(ref))
        out["first_difference_with_eager"] = diff
    return out


def compact_results(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results as saved: each cell's per-step `losses` replaced by `loss_summary`. Needs the
    eager cells' full losses, so it runs once, on the results as the cells returned them."""
    by = {(r["program"], r["backend"]): r for r in results}
    out = []
    for r in results:
        r = dict(r)
        losses = r.pop("losses", None)
        if losses is not None:
            r["loss_summary"] = _loss_summary(losses, by.get((r["program"], "eager")))
        out.append(r)
    return out


def render(results: list[dict[str, Any]], programs: list[str], backends: list[str]) -> str:
    """The report; reads only what the saved file keeps (`agreement_with_eager`, not the losses)."""
    by = {(r["program"], r["backend"]): r for r in results}
    lines = ["steps/s (ratio to eager); median of the timed repetitions", ""]
    lines.append("| program | " + " | ".join(backends) + " |")
    lines.append("|---|" + "---|" * len(backends))
    for p in programs:
        eager = by.get((p, "eager"))
        base = eager.get("steps_per_s") if eager and eager.get("status") == "ok" else None
        cells = []
        for b in backends:
            r = by.get((p, b))
            if r is None:
                cells.append("")
            elif r.get("status") != "ok":
                cells.append(f"failed ({r.get('phase')})")
            else:
                ratio = f" ({r['steps_per_s'] / base:.2f}x)" if base and b != "eager" else ""
                cells.append(f"{r['steps_per_s']:.0f}{ratio}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines += ["", "first step s (compilation) / Dynamo graphs / frames compiled / losses vs eager", ""]
    lines.append("| program | " + " | ".join(backends) + " |")
    lines.append("|---|" + "---|" * len(backends))
    for p in programs:
        cells = []
        for b in backends:
            r = by.get((p, b))
            if r is None or r.get("status") != "ok":
                cells.append("-" if r is None else "n/a")
                continue
            d = r.get("dynamo", {})
            cells.append(f"{r['first_step_s']:.1f} / {d.get('unique_graphs', 0)} / {d.get('frames_compiled', 0)} / "
                         f"{r.get('agreement_with_eager', '-')}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    failures = [r for r in results if r.get("status") != "ok"]
    if failures:
        lines += ["", "failures:"]
        lines += [f"- {r['program']} / {r['backend']} ({r.get('phase')}): {r.get('reason')}" for r in failures]
    terra = [r for r in results if r.get("terra")]
    if terra:
        lines += ["", "terra: graphs, calls per phase (direct/recorded: mode graph), fallbacks, wait for the "
              "graph (s; mode graph: whole runs), graphs run eagerly or not directly", ""]
        for r in terra:
            t = r["terra"]
            lines.append(f"- {r['program']} / {r['backend']}: {t['graphs']} graphs, {t['iterations']}, "
                         f"{t['fallbacks']} fallbacks, sync {t['sync_s']:.3f} s, "
                         f"eager graphs: {'; '.join(t['eager_graphs']) or 'none'}, "
                         f"not direct: {'; '.join(t.get('direct_refused', [])) or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cell:
        program, backend = args.cell
        result = run_cell(program, backend, args.reps, args.warmup, args.steps, args.seed)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    programs = [p.strip() for p in args.programs.split(",") if p.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    if "eager" not in backends:
        backends.insert(0, "eager")  # the reference for ratios and results
    results = []
    started = time.perf_counter()
    for p in programs:
        for b in backends:
            r = _spawn(p, b, args)
            status = f"{r['steps_per_s']:.0f} steps/s" if r.get("status") == "ok" else f"failed: {r.get('reason')}"
            print(f"[dynamo_bench] {p:12s} {b:10s} {status}", file=sys.stderr, flush=True)
            results.append(r)
    by = {(r["program"], r["backend"]): r for r in results}
    for r in results:
        r["agreement_with_eager"] = _agreement(r, by.get((r["program"], "eager")))
    table = render(results, programs, backends)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.dynamo_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "reps": args.reps, "warmup": args.warmup, "steps": args.steps, "seed": args.seed,
        "threads_per_cell": 1, "wall_s": time.perf_counter() - started,
    }
    out.write_text(json.dumps({"meta": meta, "table": table, "results": compact_results(results)}, indent=1) + "\n")
    print(f"\nwritten: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
