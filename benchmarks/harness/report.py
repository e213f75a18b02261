"""Turns results.json into report.md, speedup.png and breakdown.png (no torch needed).

The Markdown report leads with one table (steps/s, ratio to eager, correctness mark per cell,
terra's coverage: share of iterations co-executed and fallbacks per 100 iterations), the runs its
cells came from (with `uptime` before and after each), then correctness details, every failure with its reason, first-call costs, compiler statistics,
terra_torch's phases and fallbacks, and the terra time breakdown per step (PythonRunner and
GraphRunner execution and stall over the timed repetitions). The plots show speed-up over eager
per program and runner, and that breakdown relative to eager's time per step (Figure 6 of the
Terra paper, for these programs).

Every ratio divides a cell by the eager baseline of the run that measured the cell (see
benchmarks/run.py): `baseline()` is the one place that picks it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.compare import EARLY_RTOL, EARLY_STEPS, RTOL
from benchmarks.programs import PROGRAMS

DISPLAY_ORDER = ("eager", "compile", "compile-step", "jit-trace", "jit-script", "lazy",
                 "terra", "terra-lazy", "terra-graph-only", "terra-fused", "terra-graph-only-fused")
TERRA = ("terra", "terra-lazy", "terra-graph-only", "terra-fused", "terra-graph-only-fused")
MARKS = {"bitwise": "=", "close": "~", "drift": "~drift", "WRONG": "WRONG", "deterministic": "=",
         "NOT deterministic": "nondet", "MISMATCH": "MISMATCH"}
NOISY = 0.25  # repetition spread (max - min) / median above which a timing gets a dagger
BREAKDOWN_KEYS = ("python_exec_s", "python_stall_s", "graph_exec_s", "graph_stall_s")  # + tracing_s


# ---------------------------------------------------------------- ordering and cell text

def ordered_programs(doc: dict[str, Any]) -> list[str]:
    present = doc["cells"]
    return [p for p in PROGRAMS if p in present] + sorted(set(present) - set(PROGRAMS))


def ordered_runners(doc: dict[str, Any]) -> list[str]:
    present = {r for cells in doc["cells"].values() for r in cells}
    return [r for r in DISPLAY_ORDER if r in present] + sorted(present - set(DISPLAY_ORDER))


def baseline(doc: dict[str, Any], program: str, runner: str) -> float | None:
    """Eager's steps/s from the run that measured `runner`'s cell of `program`, else None.

    Never another run's: a merged results.json keeps cells of several runs, and dividing by an
    eager measured under other load would make a ratio too small or too large. A document
    without run ids (coexec_bench's) has one run: eager's own steps/s serves when neither cell
    names a run.
    """
    cells = doc["cells"][program]
    eager = cells.get("eager", {})
    run_id = cells.get(runner, {}).get("run_id")
    if "baselines" in eager:
        base = (eager["baselines"].get(run_id) or {}).get("steps_per_s")
    else:
        base = eager.get("steps_per_s") if run_id == eager.get("run_id") else None
    return base if isinstance(base, (int, float)) and base > 0 else None


def ratio(doc: dict[str, Any], program: str, runner: str) -> float | None:
    """steps/s of the cell over the same run's eager steps/s; None when either is missing."""
    sps = doc["cells"][program].get(runner, {}).get("steps_per_s")
    base = baseline(doc, program, runner)
    if not isinstance(sps, (int, float)) or base is None:
        return None
    return sps / base


def run_labels(doc: dict[str, Any]) -> dict[str, str]:
    """Short labels R1, R2, ... for the runs in meta.runs, in the order they ran."""
    return {r["id"]: f"R{k}" for k, r in enumerate(doc["meta"].get("runs", []), start=1)}


def several_runs(doc: dict[str, Any]) -> bool:
    """Whether the table holds cells of more than one run (then every cell names its run)."""
    return len({c.get("run_id") for cells in doc["cells"].values() for c in cells.values()}) > 1


def _run_tag(doc: dict[str, Any], cell: dict[str, Any]) -> str:
    if not several_runs(doc):
        return ""
    return ", " + run_labels(doc).get(cell.get("run_id"), "R?")


def coverage(cell: dict[str, Any]) -> dict[str, Any] | None:
    """terra's coverage in a cell: share of iterations co-executed, fallbacks per 100 iterations.

    Two scopes: the timed repetitions (steady state, after tracing and warm-up) and the whole
    cell (first step and warm-up included). None when the cell has no terra statistics.
    """
    stats = cell.get("stats") or {}
    phases = stats.get("phases")
    if not phases:
        return None
    out: dict[str, Any] = {}
    total = sum(phases.get(p, 0) for p in ("tracing", "coexec", "eager"))
    if total:
        out["cell"] = {"iterations": total, "coexec_share": phases.get("coexec", 0) / total,
                       "fallbacks_per_100": 100.0 * stats.get("fallbacks", 0) / total}
    timed = cell.get("timed_counters") or {}
    total = sum(timed.get(f"iterations_{p}", 0) for p in ("tracing", "coexec", "eager"))
    if total:
        fallbacks = timed.get("fallbacks")  # absent in cells measured before it was counted
        out["timed"] = {"iterations": total,
                        "coexec_share": timed.get("iterations_coexec", 0) / total,
                        "fallbacks_per_100": (None if fallbacks is None
                                              else 100.0 * fallbacks / total)}
    return out or None


def coverage_text(doc: dict[str, Any], program: str, runner: str = "terra") -> str:
    """'98% / 0.0 (cell 90% / 2.1)': timed-repetition share and fallbacks per 100 iterations,
    then the whole cell's; '-' when the cell did not run or has no statistics."""
    cell = doc["cells"][program].get(runner)
    cov = coverage(cell) if cell else None
    if cov is None:
        return "-"
    parts = []
    for scope in ("timed", "cell"):
        c = cov.get(scope)
        if c is None:
            continue
        fb = c["fallbacks_per_100"]
        text = f"{c['coexec_share']:.0%} / {'?' if fb is None else f'{fb:.1f}'}"
        parts.append(text if scope == "timed" else f"(cell {text})")
    if "timed" not in cov:
        parts.insert(0, "timed reps n/a")
    return " ".join(parts)


def verdict_of(cell: dict[str, Any]) -> str:
    return cell.get("correctness", {}).get("verdict", "")


def cell_text(doc: dict[str, Any], program: str, runner: str) -> str:
    """'1234 (1.05x) =' for a finished cell, 'FAIL: reason' / 'n/a' otherwise."""
    cell = doc["cells"][program].get(runner)
    if cell is None:
        return ""
    status = cell.get("status")
    if status == "unavailable":
        derived = derived_graph_only(doc, program) if runner == "terra-graph-only" else None
        if derived is None:
            return "n/a"
        base = baseline(doc, program, "terra")  # derived from the terra cell: its run
        terra = doc["cells"][program].get("terra", {})
        r = (f" ({derived['steps_per_s'] / base:.2f}x{_run_tag(doc, terra)})"
             if base is not None else "")
        return f"d:{derived['steps_per_s']:.0f}{r}"
    if status != "ok":
        partial = (cell.get("partial") or {}).get("steps_per_s")
        before = f"; {partial:.0f}/s before" if isinstance(partial, (int, float)) else ""
        return f"FAIL ({status}{before})"
    r = ratio(doc, program, runner)
    mark = MARKS.get(verdict_of(cell), verdict_of(cell))
    speed = f"{cell['steps_per_s']:.0f}" + ("†" if cell.get("rep_spread", 0) > NOISY else "")
    tag = _run_tag(doc, cell)
    if r is not None:
        return f"{speed} ({r:.2f}x{tag}) {mark}"
    # No eager baseline from this cell's run (it failed): no ratio rather than a cross-run one.
    return f"{speed} (no same-run eager{tag}) {mark}" if runner != "eager" else f"{speed} {mark}"


# ---------------------------------------------------------------- Markdown

def summary_table(doc: dict[str, Any]) -> str:
    runners = ordered_runners(doc)
    cov = "terra coverage: coexec % / fallbacks per 100 it."
    lines = ["| program | " + " | ".join(runners) + f" | {cov} |",
             "|---|" + "---|" * (len(runners) + 1)]
    for program in ordered_programs(doc):
        row = [cell_text(doc, program, r) for r in runners] + [coverage_text(doc, program)]
        lines.append(f"| {program} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def ratio_source(doc: dict[str, Any]) -> str:
    """One line under the table: which run the ratios came from."""
    labels = run_labels(doc)
    used = [r["id"] for r in doc["meta"].get("runs", [])
            if any(c.get("run_id") == r["id"] for cells in doc["cells"].values()
                   for c in cells.values())]
    if len(used) == 1:
        return (f"All cells and ratios from one run, {labels[used[0]]} ({used[0]}); see Runs.")
    if not used:
        return "No run ids recorded: ratios use eager's steps/s as stored."
    return ("Cells from runs " + ", ".join(labels[u] for u in used) + "; each cell names its "
            "run, and its ratio divides by that run's eager only; see Runs.")


def runs_table(doc: dict[str, Any]) -> str:
    """The runs the table's cells came from: when, what they measured, `uptime` around them."""
    labels = run_labels(doc)
    counts: dict[str, int] = {}
    for cells in doc["cells"].values():
        for cell in cells.values():
            counts[cell.get("run_id")] = counts.get(cell.get("run_id"), 0) + 1
    lines = ["| run | started | finished | cells in this table | programs x runners | "
             "uptime before | uptime after |", "|---|---|---|---|---|---|---|"]
    for run in doc["meta"].get("runs", []):
        what = (f"{', '.join(run.get('programs', []))} x {', '.join(run.get('runners', []))}"
                if run.get("programs") else _md(run.get("note", "")))
        lines.append(
            f"| {labels[run['id']]} | {run.get('started', '?')} | {run.get('finished', '?')} | "
            f"{counts.get(run['id'], 0)} | {what} | {_uptime_text(run.get('before'))} | "
            f"{_uptime_text(run.get('after'))} |")
    return "\n".join(lines) if len(lines) > 2 else "No run recorded."


def _uptime_text(u: dict[str, Any] | None) -> str:
    if not u:
        return "-"
    loads = ", ".join(f"{v:.2f}" for v in u.get("load_avg", []))
    return f"load {loads}" if loads else _md(u.get("uptime", ""))


def legend() -> str:
    return (
        "Cells: steps/s (median of the timed repetitions), ratio to eager's steps/s, and the "
        "correctness mark against eager from the same seed: `=` every loss and the final-state "
        f"digest bitwise equal; `~` within tolerance (|x - eager| <= {RTOL:g} * max(1, |eager|) at "
        f"every step); `~drift` within {EARLY_RTOL:g} for the first {EARLY_STEPS} steps, beyond "
        f"{RTOL:g} only later (rounding differences amplified by training); `WRONG` ran to the "
        "end but differs beyond that (a silently wrong result); `FAIL (error|crashed|timeout)` "
        "did not finish (reasons below); `n/a` runner not available; `MISMATCH` (terra columns "
        "only) not bitwise equal to a deterministic eager, which terra_torch promises. In the "
        "eager column the "
        "mark is eager's own determinism (two runs compared). `†`: the timed repetitions "
        f"spread by more than {NOISY:.0%} of their median (load from other processes). "
        "Ratios come from one run: a cell is divided by the eager baseline of the run that "
        "measured it (`R1`, `R2`, ... in the cell when the table merges several runs; see Runs "
        "below), never by another run's eager. In each run eager is timed before the first "
        "group of runners and after each group (the peers, then the terra runners); the "
        "baseline is the fastest of those (so load on this shared machine cannot inflate a "
        "speed-up); all are listed under Programs. `no same-run eager`: that run's eager "
        "failed, so no ratio is given. A cell's correctness mark, too, is against the eager "
        "of its own run.\n\n"
        "terra coverage (the `terra` cell): share of iterations co-executed and fallbacks per "
        "100 iterations over the timed repetitions (after tracing and warm-up), then `(cell "
        "...)` the same over the whole cell (first step and warm-up included); an iteration is "
        "a forward call, or a step where the step is wrapped (see \"terra: phases and "
        "fallbacks\"). `?`: fallbacks were not counted per repetition when that cell ran.\n\n"
        "terra columns: `terra` is co-execution (`mode=\"coexec\"`), `terra-lazy` the "
        "serialized baseline (`mode=\"lazy\"`: the graph runs when Python needs a value), both "
        "through `terra_torch.wrap(model)` or, where a step calls its models several times, "
        "`@terra_torch.function` on the step (see \"terra: phases and fallbacks\"); their "
        "correctness mark compares the whole run with eager like every other column. "
        "`terra-graph-only` replays recorded iterations of the generated graph on the "
        "GraphRunner with no program Python (a bound, not a way to train): its mark is its replay "
        "check (each recorded iteration replayed from a snapshot of the state before it must "
        "reproduce eager's loss and state updates bit for bit) plus the steps it ran as the "
        "program. `d:N` in that column: no replay was possible; N is **derived**, not measured: "
        "1 / (GraphRunner exec time per co-executed iteration) from the `terra` cell. "
        "`FAIL (error; N/s before)`: the run failed; N is the speed of the timed repetitions "
        "that finished before the failure (for orientation only)."
    )


def first_call_table(doc: dict[str, Any]) -> str:
    """Build+wrap time and first step (tracing, compiling) per cell, in seconds."""
    runners = [r for r in ordered_runners(doc) if r not in TERRA or _any_ok(doc, r)]
    lines = ["| program | " + " | ".join(runners) + " |", "|---|" + "---|" * len(runners)]
    for program in ordered_programs(doc):
        row = []
        for runner in runners:
            cell = doc["cells"][program].get(runner, {})
            if "first_step_s" in cell:
                row.append(f"{cell.get('wrap_s', 0):.2f} + {cell['first_step_s']:.2f}")
            else:
                row.append("")
        lines.append(f"| {program} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def compiler_table(doc: dict[str, Any]) -> str:
    """Dynamo's counters for the compile runners and LazyTensor's compile counters.

    frames: frames Dynamo converted (recompilations included); a frame with no graph ran
    eagerly (Dynamo gives up on a function whose loop holds a graph break, for one).
    """
    lines = ["| program | runner | Dynamo compile s | frames | graphs | graph breaks | recompiles | "
             "recompile-limit hits | lazy compiles (uncached/cached) | top graph-break reasons |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for program in ordered_programs(doc):
        for runner in ("compile", "compile-step", "lazy"):
            stats = doc["cells"][program].get(runner, {}).get("stats")
            if not stats:
                continue
            lazy = ""
            if runner == "lazy":
                lazy = (f"{stats.get('lazy_UncachedCompile', '-')}/"
                        f"{stats.get('lazy_CachedCompile', '-')}")
            lines.append(
                f"| {program} | {runner} | {stats.get('compile_time_s', '')} | "
                f"{stats.get('frames_compiled', '')} | {stats.get('unique_graphs', '')} | {stats.get('graph_breaks', '')} | "
                f"{stats.get('recompiles', '')} | {stats.get('recompile_limit_hits', '')} | "
                f"{lazy} | "
                f"{_md('; '.join(stats.get('graph_break_reasons', [])[:3]))} |")
    return "\n".join(lines) if len(lines) > 2 else "No compile or lazy cell in this run."


def failure_lines(doc: dict[str, Any]) -> list[str]:
    """Unavailable runners grouped by reason, then one bullet per failed or wrong cell."""
    lines = unavailable_lines(doc)
    for program in ordered_programs(doc):
        for runner in ordered_runners(doc):
            cell = doc["cells"][program].get(runner)
            if cell is None or cell.get("status") == "unavailable":
                continue
            text = _failure_text(cell)
            if text:
                lines.append(f"- **{program} / {runner}**: {text}")
            for warning in cell.get("warnings", []):
                if warning.startswith("HARNESS:"):  # the worker misbehaved after its result
                    lines.append(f"- **{program} / {runner}**: {_md(warning)[:500]}")
    return lines


def unavailable_lines(doc: dict[str, Any]) -> list[str]:
    """Skipped programs, then '- **runner**: unavailable (programs): reason' per runner and
    reason."""
    skipped = [p for p in ordered_programs(doc)
               if doc["cells"][p].get("eager", {}).get("program_unavailable")]
    lines = [f"- **{p}** (every runner): "
             f"{_md(doc['cells'][p]['eager'].get('reason', ''))}" for p in skipped]
    programs = [p for p in ordered_programs(doc) if p not in skipped]
    for runner in ordered_runners(doc):
        by_reason: dict[str, list[str]] = {}
        for program in programs:
            cell = doc["cells"][program].get(runner, {})
            if cell.get("status") == "unavailable":
                by_reason.setdefault(cell.get("reason", ""), []).append(program)
        for reason, names in by_reason.items():
            where = "all programs" if len(names) == len(programs) else ", ".join(names)
            lines.append(f"- **{runner}** unavailable ({where}): {_md(reason)}")
    return lines


def correctness_table(doc: dict[str, Any]) -> str:
    """Per cell: verdict, max relative loss error, first step that is not bit-identical."""
    runners = [r for r in ordered_runners(doc) if r != "eager" and _any_ok(doc, r)]
    lines = ["| program | eager (2 runs) | " + " | ".join(runners) + " |",
             "|---|---|" + "---|" * len(runners)]
    for program in ordered_programs(doc):
        cells = doc["cells"][program]
        row = [verdict_of(cells.get("eager", {}))]
        for runner in runners:
            row.append(_correctness_text(cells.get(runner, {})))
        lines.append(f"| {program} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _correctness_text(cell: dict[str, Any]) -> str:
    corr = cell.get("correctness", {})
    v = corr.get("verdict", "")
    if corr.get("basis") == "replay" and corr.get("replay"):
        rep = corr["replay"]
        text = (f"{v} (replay: {rep.get('losses_bitwise')}/{rep.get('iterations')} losses, "
                f"{rep.get('state_tensors_checked')} state tensors checked)")
        return text if v == "bitwise" else f"{text}: {_md('; '.join(rep.get('mismatches') or []))[:300]}"
    losses = corr.get("losses") or {}
    if v in ("bitwise", "n/a", "") or not losses:
        return v
    if v == "MISMATCH":
        v = f"MISMATCH (would be '{corr.get('tolerance_class')}' for a compiler)"
    if v == "error":
        n = losses.get("compared", 0)
        return f"error after {n} steps" + (f" ({corr.get('prefix')} until then)" if n else "")
    detail = f"max rel {losses['max_rel_err']:.1e}"
    if losses.get("first_diff_step") is not None:
        detail += f", 1st diff @{losses['first_diff_step']}"
    digest = corr.get("digest") or {}
    if digest and not digest.get("bitwise", True):
        detail += f", digest rel {digest['max_rel_err']:.1e}"
    return f"{v}: {detail}"


def _failure_text(cell: dict[str, Any]) -> str:
    status = cell.get("status")
    corr = cell.get("correctness", {})
    if status in ("timeout", "crashed"):
        return f"{status}: {cell.get('reason', '')}"
    if status == "error":
        err = cell.get("error", {})
        where = f" at {err['where']}" if err.get("where") else ""
        prefix = corr.get("prefix")
        tail = f"; steps before the failure: {prefix}" if prefix and prefix != "none" else ""
        return (f"error in {cell.get('phase')}{where}: {err.get('type')}: "
                f"{_md(err.get('message', ''))}{tail}")
    if corr.get("verdict") == "WRONG" and corr.get("basis") == "replay":
        rep = corr.get("replay") or {}
        steps = corr.get("losses") or {}
        parts = [] if steps.get("bitwise", True) else [
            f"recorded steps differ from eager from step {steps.get('first_diff_step')}"]
        parts += rep.get("mismatches") or []
        return ("graph replay WRONG (the generated graph does not reproduce eager): "
                + _md("; ".join(parts)))
    if corr.get("verdict") == "WRONG":
        return "silently WRONG: " + _wrong_detail(corr, cell)
    if corr.get("verdict") == "MISMATCH":
        losses = corr.get("losses") or {}
        digest = corr.get("digest") or {}
        text = (f"MISMATCH with eager (terra_torch promises bitwise equality): first loss that "
                f"differs at step {losses.get('first_diff_step')}, max rel err "
                f"{losses.get('max_rel_err', 0):.3g}")
        if digest and not digest.get("bitwise", True):
            text += f"; final-state digest max rel err {digest.get('max_rel_err', 0):.3g}"
        return text
    return ""


def _wrong_detail(corr: dict[str, Any], cell: dict[str, Any]) -> str:
    losses = corr.get("losses") or {}
    digest = corr.get("digest") or {}
    parts = []
    if losses.get("bitwise"):
        parts.append("every loss bitwise equal")
    if not losses.get("within_tol", True):
        parts.append(f"losses leave tolerance at step {losses['first_bad_step']} "
                     f"(first bit difference at step {losses['first_diff_step']}, "
                     f"max rel err {losses['max_rel_err']:.3g})")
    if digest and not digest.get("within_tol", True):
        parts.append(f"final-state digest differs (max rel err {digest['max_rel_err']:.3g})")
    warned = [w for w in cell.get("warnings", []) if w.startswith("TracerWarning")]
    if warned:
        parts.append(f"trace warned once at trace time: '{_md(warned[0][:140])}'")
    return "; ".join(parts) or "differs"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _any_ok(doc: dict[str, Any], runner: str) -> bool:
    return any(c.get(runner, {}).get("status") == "ok" for c in doc["cells"].values())


def per_step_ms(cell: dict[str, Any]) -> dict[str, float] | None:
    """The timed repetitions' runner times per step, in ms (None when not measured)."""
    timed = cell.get("timed_counters") or {}
    steps = timed.get("steps")
    if not steps or "graph_exec_s" not in timed:
        return None
    keys = BREAKDOWN_KEYS + ("tracing_s",)
    return {k: 1e3 * float(timed.get(k, 0.0)) / steps for k in keys}


def derived_graph_only(doc: dict[str, Any], program: str) -> dict[str, Any] | None:
    """Graph-only speed derived from the terra cell: 1 / (GraphRunner exec per coexec iteration).

    From the timed repetitions when they finished, else from the whole cell (warm-up included).
    """
    cell = doc["cells"][program].get("terra", {})
    timed = cell.get("timed_counters") or {}
    exec_s, iters, scope = timed.get("graph_exec_s"), timed.get("iterations_coexec"), "timed"
    if not iters:
        objs = (cell.get("stats") or {}).get("programs") or []
        exec_s = sum(o.get("graph_exec_s", 0.0) for o in objs)
        iters = sum(o.get("iterations", {}).get("coexec", 0) for o in objs)
        scope = "whole cell"
    if not iters or not exec_s:
        return None
    return {"steps_per_s": iters / exec_s, "ms": 1e3 * exec_s / iters, "scope": scope,
            "iterations": int(iters)}


def terra_table(doc: dict[str, Any]) -> str:
    """Per program and terra runner: how it was wrapped, phases, fallbacks and their reasons."""
    lines = ["| program | runner | iteration = | iterations tracing / coexec / eager (whole cell) "
             "| timed reps: coexec share | graph builds | fallbacks | first fallback reasons |",
             "|---|---|---|---|---|---|---|---|"]
    for program in ordered_programs(doc):
        for runner in ("terra", "terra-lazy"):
            cell = doc["cells"][program].get(runner)
            stats = (cell or {}).get("stats") or {}
            if not stats.get("programs"):
                continue
            ph = stats.get("phases", {})
            timed = cell.get("timed_counters") or {}
            total = sum(timed.get(f"iterations_{p}", 0) for p in ("tracing", "coexec", "eager"))
            share = f"{timed.get('iterations_coexec', 0) / total:.0%}" if total else "-"
            wrapped = ", ".join(o["wrapped"] for o in stats["programs"])
            builds = sum(o.get("graph_builds", 0) for o in stats["programs"])
            reasons = [r for o in stats["programs"] for r in o.get("fallback_reasons", [])]
            lines.append(
                f"| {program} | {runner} | {wrapped} | {ph.get('tracing', 0)} / "
                f"{ph.get('coexec', 0)} / {ph.get('eager', 0)} | {share} | {builds} | "
                f"{stats.get('fallbacks', 0)} | {_md('; '.join(reasons[:2]))[:400]} |")
    return "\n".join(lines)


def breakdown_section(doc: dict[str, Any]) -> str:
    rows = []
    for program in ordered_programs(doc):
        cells = doc["cells"][program]
        eager = baseline(doc, program, "terra")  # the terra cells' run (same for terra-lazy
        # unless a merge re-measured only one of them; the table shows terra's)
        eager_ms = f"{1e3 / eager:.3f}" if isinstance(eager, (int, float)) else ""
        derived = derived_graph_only(doc, program)
        derived_ms = f"{derived['ms']:.3f}" if derived else ""
        replay = cells.get("terra-graph-only", {})
        replay_ms = (f"{1e3 / replay['steps_per_s']:.3f}"
                     if replay.get("status") == "ok" and replay.get("steps_per_s") else "")
        for runner in ("terra", "terra-lazy"):
            cell = cells.get(runner, {})
            b = per_step_ms(cell)
            if b is None:
                continue
            timed = cell["timed_counters"]
            phases = "/".join(f"{timed.get(f'iterations_{p}', 0):.0f}"
                              for p in ("tracing", "coexec", "eager"))
            # Mean wall time per step (the counters are sums over every timed repetition, so a
            # median would not add up with them).
            mean_ms = 1e3 * sum(cell.get("rep_s", [])) / timed["steps"]
            values = " | ".join(f"{b[k]:.3f}" for k in BREAKDOWN_KEYS + ("tracing_s",))
            accounted = b["python_exec_s"] + b["python_stall_s"] + b["tracing_s"]
            other = f"{mean_ms - accounted:.3f}"
            rows.append(f"| {program} | {runner} | {phases} | {mean_ms:.3f} | {values} | {other} | "
                        f"{eager_ms} | "
                        f"{replay_ms} | {derived_ms if runner == 'terra' else ''} |")
    if not rows:
        return "No terra cell finished its timed repetitions: nothing to break down."
    head = ("Milliseconds per step over the timed repetitions (warm-up and tracing of the first "
            "iterations excluded), as `terra_torch.stats()` reports them: PythonRunner exec "
            "(Python running the program, co-executed iterations) and stall (Python waiting for "
            "a value from the graph), GraphRunner exec (the graph computing) and stall (the graph "
            "waiting for Python's decisions and feeds), and tracing (iterations run eagerly while "
            "recording); `other` is the mean wall time per step minus the Python-side times, "
            "i.e. what no co-executed or traced iteration accounts for: iterations in phase "
            "`eager` (terra_torch does not time them), waiting in `synchronize` at the end of "
            "each repetition. `graph-only replay` is the `terra-graph-only` cell's measured time per "
            "replayed step; `graph exec (derived)` is GraphRunner exec per co-executed iteration "
            "of the `terra` cell: the same bound, derived from statistics, not measured.")
    table = ["| program | runner | timed iterations trace/coexec/eager | wall (mean) | Python exec "
             "| Python stall | graph exec | graph stall | tracing | other | eager "
             "| graph-only replay | graph exec (derived) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"] + rows
    return head + "\n\n" + "\n".join(table)


def program_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    labels = run_labels(doc)
    for program in ordered_programs(doc):
        eager = doc["cells"][program].get("eager", {})
        feats = ", ".join(eager.get("features", []))
        per_run = [(labels.get(rid, "R?"), b.get("steps_per_s_runs") or [])
                   for rid, b in (eager.get("baselines") or {}).items()]
        if not per_run:
            per_run = [("", eager.get("steps_per_s_runs", []))]
        runs = "; ".join(f"{label + ': ' if label else ''}"
                         + ", ".join(f"{r:.0f}" for r in values)
                         for label, values in per_run if values)
        measured = f"; eager measured {runs} steps/s" if runs else ""
        lines.append(f"- **{program}**: {eager.get('description', '')} (features: {feats}; "
                     f"{eager.get('steps_per_rep', '?')} steps per repetition{measured})")
    return lines


def markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    s = meta["settings"]
    torch_version = next((c.get("torch") for cells in doc["cells"].values()
                          for c in cells.values() if c.get("torch")), "?")
    m = meta.get("machine", {})
    parts = [
        "# terra_torch benchmarks: eager, peers and terra" + (" (quick)" if s.get("quick") else ""),
        "",
        f"Updated {meta.get('updated')}; torch {torch_version}; Python {m.get('python')}; "
        f"{m.get('cpus')} CPUs (load {m.get('load_avg_1m')} at the end); {m.get('platform')}.",
        f"Settings: {s['warmup']} warm-up + {s['reps']} timed repetitions (median), "
        f"{s['threads']} intra-op thread(s), seed {s['seed']}, "
        f"{'quick' if s.get('quick') else 'full'} steps per repetition. Generated by "
        "`python -m benchmarks.run`; see docs/BENCHMARKS.md for method and caveats.",
        "",
        "## Steps per second, ratio to eager, correctness",
        "",
        summary_table(doc),
        "",
        ratio_source(doc),
        "",
        legend(),
        "",
        "![speed-up over eager](speedup.png)",
        "",
        "## Runs",
        "",
        "The runs the cells above came from (a run restricted with `--only`/`--runners` merges "
        "into the table; each cell's ratio uses its own run's eager), with the load averages "
        "(1, 5, 15 minutes, from `uptime`) before and after each run.",
        "",
        runs_table(doc),
        "",
        "## Correctness details",
        "",
        "Verdict, largest relative difference of a loss from eager's, first step whose loss is "
        "not bit-identical, and the final-state digest's difference (sums of parameters, "
        "buffers and the program's Python-side counters).",
        "",
        correctness_table(doc),
        "",
        "## Failures, unavailable runners and wrong results",
        "",
        *(failure_lines(doc) or ["None."]),
        "",
        "## First call: wrap + first step (seconds)",
        "",
        "Wrap is `rt.wrap(...)` (trace/script compile there); the first step includes Dynamo "
        "and Inductor compilation, LazyTensor's first graph compile, TorchScript profiling runs.",
        "",
        first_call_table(doc),
        "",
        "## Compiler statistics",
        "",
        "Frames: frame conversions Dynamo ran (recompilations and resume functions included); "
        "graphs: FX graphs it produced. A frame that produced no graph runs eagerly: Dynamo "
        "falls back to eager for a whole function when it cannot resume after a graph break "
        "(a data-dependent `if` inside a loop), and for a frame past the recompile limit.",
        "",
        compiler_table(doc),
        "",
        "## terra: phases and fallbacks",
        "",
        "How each program was co-executed: the wrapped object (`wrap(Model)`: an iteration runs "
        "from one forward call to the next; `function(step)`: one call of the training step), "
        "the iterations per phase over the whole cell (first step and warm-up included), the "
        "share of co-executed iterations in the timed repetitions, and why iterations fell back "
        "to eager (a divergence from the traced iterations, or a graph that cannot be generated).",
        "",
        terra_table(doc),
        "",
        "## Time breakdown (terra PythonRunner / GraphRunner)",
        "",
        breakdown_section(doc),
        "",
        "![time breakdown](breakdown.png)",
        "",
        "## Programs",
        "",
        *program_lines(doc),
        "",
    ]
    return "\n".join(parts)


# ---------------------------------------------------------------- plots

def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(doc: dict[str, Any], path: Path) -> None:
    """Grouped bars: ratio to eager per program (groups) and runner (bars), log scale."""
    plt = _pyplot()
    programs = ordered_programs(doc)
    runners = [r for r in ordered_runners(doc) if r != "eager"]
    width = 0.8 / max(1, len(runners))
    fig, ax = plt.subplots(figsize=(max(10, 1.3 * len(programs)), 5.5))
    from matplotlib.patches import Patch

    palette = [plt.get_cmap("tab10")(i) for i in (0, 1, 2, 4, 5, 6, 7, 8, 9)]  # no red: red = WRONG
    handles = []
    for k, runner in enumerate(runners):
        color = palette[k % len(palette)]
        for j, program in enumerate(programs):
            x = j - 0.4 + width * (k + 0.5)
            _bar(ax, doc, program, runner, x, width, color)
        handles.append(Patch(color=color, label=runner))
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_yscale("log")
    ax.set_ylim(0.01, 10)
    ax.set_xticks(range(len(programs)))
    ax.set_xticklabels(programs, rotation=20, ha="right")
    ax.set_ylabel("steps/s relative to eager (log scale; 1 = eager)")
    ax.set_title("Speed-up over eager (same seed, checked against eager). Red /// = WRONG result; "
                 "red xx = terra not bitwise (MISMATCH);\ndotted = drift; x = failed; n/a = "
                 "unavailable; hollow d: = derived from statistics, not measured", fontsize=9)
    ax.legend(handles=handles, ncol=min(4, len(runners)), fontsize=8, loc="upper left")
    ax.set_xlim(-0.5, len(programs) - 0.5)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bar(ax: Any, doc: dict[str, Any], program: str, runner: str, x: float, width: float,
         color: Any) -> None:
    cell = doc["cells"][program].get(runner)
    if cell is None:
        return
    r = ratio(doc, program, runner)
    derived = derived_graph_only(doc, program) if runner == "terra-graph-only" else None
    base = baseline(doc, program, "terra")
    if cell.get("status") == "unavailable" and derived and isinstance(base, (int, float)):
        # Not measured: derived from the terra cell's statistics; drawn hollow and labelled.
        d = derived["steps_per_s"] / base
        ax.bar(x, d, width, facecolor="none", edgecolor=color, hatch="..", linewidth=1.0)
        ax.text(x, d * 1.08, f"d:{d:.2g}", rotation=90, ha="center", va="bottom", fontsize=6)
    elif cell.get("status") == "unavailable":
        ax.text(x, 0.012, "n/a", rotation=90, ha="center", va="bottom", fontsize=6, color="gray")
    elif r is None or cell.get("status") != "ok":
        ax.text(x, 0.012, "x", ha="center", va="bottom", fontsize=9, color=color, weight="bold")
    else:
        hatch, edge = {"WRONG": ("///", "red"), "MISMATCH": ("xx", "red"),
                       "drift": ("..", "black")}.get(verdict_of(cell), (None, None))
        ax.bar(x, r, width, color=color, hatch=hatch, edgecolor=edge or color,
               linewidth=1.2 if edge else 0)
        ax.text(x, r * 1.08, f"{r:.2g}", rotation=90, ha="center", va="bottom", fontsize=6)


PY_PARTS = (("python_exec_s", "Python exec", "#1f77b4", None),
            ("python_stall_s", "Python stall", "#aec7e8", None),
            ("tracing_s", "tracing (eager, recorded)", "#c7c7c7", "//"),
            ("other_s", "not in any timed iteration (eager phase, synchronize)", "#f2f2f2", ".."))
GRAPH_PARTS = (("graph_exec_s", "graph exec", "#ff7f0e", None),
               ("graph_stall_s", "graph stall", "#ffbb78", None))


def plot_breakdown(doc: dict[str, Any], path: Path) -> None:
    """Figure-6-like: per program, PythonRunner and GraphRunner time per step (stacked exec,
    stall, tracing) relative to eager's time per step, one panel per terra mode; markers for the
    measured graph-only replay and the derived graph exec per iteration."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    programs = ordered_programs(doc)
    fig, axes = plt.subplots(2, 1, figsize=(max(11, 1.2 * len(programs)), 8.5), sharex=True)
    for ax, runner in zip(axes, ("terra", "terra-lazy")):
        top = 0.0
        for j, program in enumerate(programs):
            top = max(top, _breakdown_bars(ax, doc, program, runner, j))
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_ylim(0, min(max(2.0, top * 1.15), 8.0))
        ax.set_ylabel("time per step / eager's")
        ax.set_title(f"{runner}: left bar PythonRunner, right bar GraphRunner (timed repetitions)",
                     fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(range(len(programs)))
    axes[-1].set_xticklabels(programs, rotation=20, ha="right")
    axes[-1].set_xlim(-0.6, len(programs) - 0.4)
    handles = [Patch(facecolor=c, hatch=h, label=lbl, edgecolor="gray")
               for _, lbl, c, h in PY_PARTS + GRAPH_PARTS]
    handles += [Line2D([], [], color="black", label="eager = 1"),
                Line2D([], [], color="green", marker="v", linestyle="", label="graph-only replay"),
                Line2D([], [], color="purple", marker="x", linestyle="",
                       label="graph exec per iteration (derived)")]
    fig.legend(handles=handles, ncol=4, fontsize=8, loc="lower center")
    fig.suptitle("Where a step's time goes under terra_torch (ms per step / eager's ms per step; "
                 "numbers above the bars: ms per step of the cell)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _breakdown_bars(ax: Any, doc: dict[str, Any], program: str, runner: str, x: float) -> float:
    """Two stacked bars at x for one cell; returns the tallest value drawn (eager units)."""
    cells = doc["cells"][program]
    eager = baseline(doc, program, runner)
    cell = cells.get(runner, {})
    b = per_step_ms(cell)
    if not isinstance(eager, (int, float)) or b is None:
        why = "n/a" if cell.get("status") in (None, "unavailable") else "FAIL"
        ax.text(x, 0.05, why, ha="center", va="bottom", fontsize=7, color="firebrick", rotation=90)
        return 0.0
    eager_ms = 1e3 / eager
    timed = cell["timed_counters"]
    mean_ms = 1e3 * sum(cell.get("rep_s", [])) / timed["steps"]
    b = dict(b, other_s=max(0.0, mean_ms - b["python_exec_s"] - b["python_stall_s"]
                            - b["tracing_s"]))
    if not timed.get("iterations_coexec") and timed.get("iterations_eager"):
        ax.text(x, 0.05, "eager phase", ha="center", va="bottom", fontsize=7, rotation=90)
    tallest = 0.0
    for offset, parts in ((-0.18, PY_PARTS), (0.18, GRAPH_PARTS)):
        bottom = 0.0
        for key, _, color, hatch in parts:
            value = b[key] / eager_ms
            ax.bar(x + offset, value, 0.34, bottom=bottom, color=color, hatch=hatch,
                   edgecolor="gray", linewidth=0.3)
            bottom += value
        tallest = max(tallest, bottom)
    if cell.get("steps_per_s"):
        ax.text(x, tallest + 0.03, f"{1e3 / cell['steps_per_s']:.2g} ms", ha="center",
                va="bottom", fontsize=6)
    replay = cells.get("terra-graph-only", {})
    if replay.get("status") == "ok" and replay.get("steps_per_s"):
        ax.plot([x + 0.18], [(1e3 / replay["steps_per_s"]) / eager_ms], marker="v",
                color="green", markersize=6)
    derived = derived_graph_only(doc, program) if runner == "terra" else None
    if derived:
        ax.plot([x + 0.18], [derived["ms"] / eager_ms], marker="x", color="purple", markersize=6)
    return tallest


def write_all(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """report.md, speedup.png, breakdown.png in out_dir; returns the paths written."""
    paths = [out_dir / "report.md", out_dir / "speedup.png", out_dir / "breakdown.png"]
    paths[0].write_text(markdown(doc))
    plot_speedup(doc, paths[1])
    plot_breakdown(doc, paths[2])
    return paths
