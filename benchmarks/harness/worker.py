"""Runs one (program, runner) cell in this process and writes its result as JSON.

Started by benchmarks/run.py as `python -m benchmarks.harness.worker --program P --runner R
--out FILE ...`, one process per cell, so that tools with global state (Dynamo caches, the lazy
backend, terra_torch's dispatcher interceptor) cannot affect other cells and a crash or hang
costs one cell. The result records timings, the loss trajectory (exact floats, for the
correctness check against eager), the final-state digest, runner statistics, warnings raised,
and, on failure, where and why it failed.

Timing: step 0 alone (first call: tracing, compiling), then `warmup` untimed repetitions, then
`reps` timed repetitions of `steps_per_rep` steps each; every repetition ends with runner.sync().
Losses are converted to floats only after all repetitions, outside the timed region. The
runner's cumulative counters (terra: per-runner times and phase counts) are read before and
after the timed repetitions, so their difference describes the steady state only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CellConfig:
    """What the parent decides for every cell alike."""

    seed: int
    warmup: int
    reps: int
    steps_per_rep: int | None  # None: the program's own (quick or full)
    quick: bool
    threads: int
    rerun: bool  # eager only: run the whole program a second time to test determinism


def run_cell(program: str, runner_name: str, cfg: CellConfig) -> dict[str, Any]:
    """Everything about one cell; never raises for a failure of the program or runner."""
    import torch

    from benchmarks.harness.runners import make_runner

    torch.set_num_threads(cfg.threads)
    runner = make_runner(runner_name)
    result: dict[str, Any] = {"program": program, "runner": runner_name, "note": runner.note,
                              "status": "ok", "torch": torch.__version__}
    # A program that needs a missing optional package (hf_gpt2: transformers) is skipped for
    # every runner alike; run.py sees `program_unavailable` on the eager cell and spawns no more.
    from benchmarks.harness.runtime import load_program

    skip = getattr(load_program(program), "UNAVAILABLE", None)
    if skip:
        result.update(status="unavailable", reason=f"program skipped: {skip}",
                      program_unavailable=True)
        return result
    reason = runner.unavailable_reason()
    if reason is not None:
        result.update(status="unavailable", reason=reason)
        return result
    runner.setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        result.update(_timed_run(program, runner, cfg))
        if cfg.rerun and result["status"] == "ok":
            try:
                result["rerun"] = _untimed_run(program, runner, cfg, result["steps_total"])
            except Exception as exc:
                result["rerun"] = {"error": _describe(exc)}
    result["warnings"] = _summarize_warnings(caught)
    result["stats"] = _safe(runner.stats, {})
    result["breakdown"] = _safe(runner.breakdown, None)
    return result


def _timed_run(program: str, runner: Any, cfg: CellConfig) -> dict[str, Any]:
    """Build, first step, warm-up, timed repetitions; returns timings and trajectory."""
    from benchmarks.harness.runners import RunnerUnavailable
    from benchmarks.harness.runtime import Runtime, load_program

    module = load_program(program)
    spr = cfg.steps_per_rep or _program_steps(module, cfg.quick)
    out: dict[str, Any] = {"description": module.DESCRIPTION, "features": list(module.FEATURES),
                           "steps_per_rep": spr, "reps": cfg.reps, "warmup": cfg.warmup}
    phase = "build"
    outputs: list[Any] = []
    at: dict[str, Any] = {}
    rep_times: list[float] = []
    try:
        runner.bind_program(module)
        rt = Runtime(device=runner.device, wrap_hook=runner.wrap_model)
        start = time.perf_counter()
        state = module.build(cfg.seed, rt)
        out["build_s"] = time.perf_counter() - start
        out["wrap_s"] = rt.wrap_seconds
        out["wrapped"] = rt.wrapped
        step = runner.wrap_step(module.step)
        phase = "steps"
        out["first_step_s"] = _time_steps(step, runner, state, 0, 1, outputs, at)
        before: dict[str, float] = {}
        for rep in range(cfg.warmup + cfg.reps):
            # Compiled segments (terra-fused) are waited for before the last warm-up repetition,
            # which then runs their check and speed trial, as compile-step's warm-up runs its
            # compiles and recompiles: the timed repetitions see the settled program.
            if rep == max(0, cfg.warmup - 1):
                out["settle_s"] = runner.settle()
            if rep == cfg.warmup:
                before = runner.counters()
            first = 1 + rep * spr
            rep_times.append(_time_steps(step, runner, state, first, spr, outputs, at))
        out["timed_counters"] = _difference(runner.counters(), before, cfg.reps * spr)
        out.update(_timing_summary(rep_times[cfg.warmup:], spr))
        out["warmup_rep_s"] = rep_times[:cfg.warmup]
        phase = "digest"
        out["digest"] = _digest(module, state)
    except BaseException as exc:  # record and return: the cell failed, the harness goes on
        if isinstance(exc, KeyboardInterrupt):
            raise
        if isinstance(exc, RunnerUnavailable):
            out.update(status="unavailable", reason=str(exc))
            out["losses"], out["steps_total"] = _to_floats(outputs), len(outputs)
            return out
        if phase == "steps":
            stage = "" if at.get("stage") == "step" else f" ({at.get('stage')})"
            phase = f"step {at.get('step')}{stage}"
            # Timed repetitions that finished before the failure: a speed worth knowing, shown
            # only next to the failure, never as the cell's result.
            done = rep_times[cfg.warmup:]
            if done:
                out["partial"] = {"timed_reps": len(done),
                                  "steps_per_s": _timing_summary(done, spr)["steps_per_s"]}
        out.update(status="error", phase=phase, error=_describe(exc))
    out["losses"] = _to_floats(outputs)
    out["steps_total"] = len(outputs)
    return out


def _untimed_run(program: str, runner: Any, cfg: CellConfig, steps: int) -> dict[str, Any]:
    """The same program from the same seed again (eager determinism check)."""
    from benchmarks.harness.runtime import Runtime, load_program

    module = load_program(program)
    outputs: list[Any] = []
    runner.bind_program(module)
    rt = Runtime(device=runner.device, wrap_hook=runner.wrap_model)
    state = module.build(cfg.seed, rt)
    step = runner.wrap_step(module.step)
    _time_steps(step, runner, state, 0, steps, outputs)
    return {"losses": _to_floats(outputs), "digest": _digest(module, state)}


def _time_steps(step: Any, runner: Any, state: Any, first: int, count: int,
                outputs: list[Any], at: dict[str, Any] | None = None) -> float:
    """Run steps first..first+count-1, sync, and return the wall time.

    `at` (if given) tracks the step and stage (step, end_step, sync) being run, so that a
    failure can be placed exactly: LazyTensor, for one, raises a step's error at mark_step.
    """
    at = {} if at is None else at
    sink = io.StringIO()  # programs print like users do; keep it off the worker's stdout
    start = time.perf_counter()
    with contextlib.redirect_stdout(sink):
        for i in range(first, first + count):
            at.update(step=i, stage="step")
            outputs.append(step(state, i))
            at["stage"] = "end_step"
            runner.end_step()
        at["stage"] = "sync"
        runner.sync()
    return time.perf_counter() - start


def _difference(after: dict[str, float], before: dict[str, float], steps: int) -> dict[str, Any]:
    """Counters accumulated during the timed repetitions (runner-specific keys), and the steps."""
    if not after:
        return {}
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {"steps": steps, **delta}


def _program_steps(module: Any, quick: bool) -> int:
    full = int(module.STEPS_PER_REP)
    return int(getattr(module, "QUICK_STEPS_PER_REP", full)) if quick else full


def _timing_summary(rep_times: list[float], spr: int) -> dict[str, Any]:
    median = statistics.median(rep_times)
    return {
        "rep_s": rep_times,
        "median_rep_s": median,
        "steps_per_s": spr / median if median > 0 else math.inf,
        "rep_spread": (max(rep_times) - min(rep_times)) / median if median > 0 else 0.0,
    }


def _to_floats(outputs: list[Any]) -> list[float]:
    """Loss values as exact Python floats, up to the first one that cannot be read.

    After a failed step a runner may be unable to produce earlier values too (LazyTensor loses
    every pending tensor when mark_step fails): the trajectory ends where values end.
    """
    values: list[float] = []
    for value in outputs:
        try:
            values.append(float(value))
        except Exception:
            break
    return values


def _digest(module: Any, state: Any) -> list[float] | None:
    fn = getattr(module, "digest", None)
    return [float(v) for v in fn(state)] if callable(fn) else None


def _describe(exc: BaseException) -> dict[str, str]:
    """Exception type, message (first and last lines), and the innermost benchmark frame."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    message = lines[0] if lines else ""
    if len(lines) > 1:
        message += " ... " + lines[-1]  # TorchScript puts the real reason last
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "benchmarks/programs" in f.filename] or \
        [f for f in frames if "benchmarks/harness" in f.filename]
    where = ""
    if ours:
        where = f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno} in {ours[-1].name}"
    return {"type": type(exc).__name__, "message": message[:400], "where": where}


def _summarize_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """Distinct warnings (category and first line), at most 8: trace's TracerWarnings matter."""
    seen: list[str] = []
    for w in caught:
        text = f"{w.category.__name__}: {str(w.message).strip().splitlines()[0][:200]}"
        if text not in seen:
            seen.append(text)
    return seen[:8]


def _safe(fn: Any, default: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        return {"stats_error": f"{type(exc).__name__}: {exc}"} if default == {} else default


def _json_ready(value: Any) -> Any:
    """Replace non-finite floats (which JSON cannot hold) with strings, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--program", required=True)
    p.add_argument("--runner", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rerun", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    cfg = CellConfig(seed=args.seed, warmup=args.warmup, reps=args.reps, steps_per_rep=args.steps,
                     quick=args.quick, threads=args.threads, rerun=args.rerun)
    result = run_cell(args.program, args.runner, cfg)
    with open(args.out, "w") as f:
        json.dump(_json_ready(result), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
