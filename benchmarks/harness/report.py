"""Turns results.json into report.md, speedup.png and breakdown.png (no torch needed).

The Markdown report leads with one table (steps/s, ratio to eager, correctness mark per cell),
then first-call costs and compiler statistics, then every failure with its reason. The plots
show speed-up over eager per program and runner, and the terra time breakdown (PythonRunner and
GraphRunner execution and stall), which stays an explicit "not measured" placeholder until
terra_torch reports those statistics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.compare import EARLY_RTOL, EARLY_STEPS, RTOL
from benchmarks.programs import PROGRAMS

DISPLAY_ORDER = ("eager", "compile", "compile-step", "jit-trace", "jit-script", "lazy",
                 "terra", "terra-lazy", "terra-graph-only")
TERRA = ("terra", "terra-lazy", "terra-graph-only")
MARKS = {"bitwise": "=", "close": "~", "drift": "~drift", "WRONG": "WRONG", "deterministic": "=",
         "NOT deterministic": "nondet"}
NOISY = 0.25  # repetition spread (max - min) / median above which a timing gets a dagger
BREAKDOWN_KEYS = ("python_exec_s", "python_stall_s", "graph_exec_s", "graph_stall_s")


# ---------------------------------------------------------------- ordering and cell text

def ordered_programs(doc: dict[str, Any]) -> list[str]:
    present = doc["cells"]
    return [p for p in PROGRAMS if p in present] + sorted(set(present) - set(PROGRAMS))


def ordered_runners(doc: dict[str, Any]) -> list[str]:
    present = {r for cells in doc["cells"].values() for r in cells}
    return [r for r in DISPLAY_ORDER if r in present] + sorted(present - set(DISPLAY_ORDER))


def ratio(doc: dict[str, Any], program: str, runner: str) -> float | None:
    """steps/s of the cell over eager's steps/s for the program; None when either is missing."""
    cells = doc["cells"][program]
    sps = cells.get(runner, {}).get("steps_per_s")
    base = cells.get("eager", {}).get("steps_per_s")
    if not isinstance(sps, (int, float)) or not isinstance(base, (int, float)) or base <= 0:
        return None
    return sps / base


def verdict_of(cell: dict[str, Any]) -> str:
    return cell.get("correctness", {}).get("verdict", "")


def cell_text(doc: dict[str, Any], program: str, runner: str) -> str:
    """'1234 (1.05x) =' for a finished cell, 'FAIL: reason' / 'n/a' otherwise."""
    cell = doc["cells"][program].get(runner)
    if cell is None:
        return ""
    status = cell.get("status")
    if status == "unavailable":
        return "n/a"
    if status != "ok":
        return f"FAIL ({status})"
    r = ratio(doc, program, runner)
    mark = MARKS.get(verdict_of(cell), verdict_of(cell))
    speed = f"{cell['steps_per_s']:.0f}" + ("†" if cell.get("rep_spread", 0) > NOISY else "")
    return f"{speed} ({r:.2f}x) {mark}" if r is not None else f"{speed} {mark}"


# ---------------------------------------------------------------- Markdown

def summary_table(doc: dict[str, Any]) -> str:
    runners = ordered_runners(doc)
    lines = ["| program | " + " | ".join(runners) + " |",
             "|---|" + "---|" * len(runners)]
    for program in ordered_programs(doc):
        row = [cell_text(doc, program, r) for r in runners]
        lines.append(f"| {program} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def legend() -> str:
    return (
        "Cells: steps/s (median of the timed repetitions), ratio to eager's steps/s, and the "
        "correctness mark against eager from the same seed: `=` every loss and the final-state "
        f"digest bitwise equal; `~` within tolerance (|x - eager| <= {RTOL:g} * max(1, |eager|) at "
        f"every step); `~drift` within {EARLY_RTOL:g} for the first {EARLY_STEPS} steps, beyond "
        f"{RTOL:g} only later (rounding differences amplified by training); `WRONG` ran to the "
        "end but differs beyond that (a silently wrong result); `FAIL (error|crashed|timeout)` "
        "did not finish (reasons below); `n/a` runner not available. In the eager column the "
        "mark is eager's own determinism (two runs compared). `†`: the timed repetitions "
        f"spread by more than {NOISY:.0%} of their median (load from other processes). "
        "Eager is timed twice per program, before and after the other runners; the table and "
        "all ratios use the faster of the two (so load on this shared machine cannot inflate a "
        "speed-up); both are listed under Programs."
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
    return "\n".join(lines)


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
    return lines


def unavailable_lines(doc: dict[str, Any]) -> list[str]:
    """'- **runner**: unavailable (programs): reason', one line per runner and reason."""
    programs = ordered_programs(doc)
    lines = []
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
    losses = corr.get("losses") or {}
    if v in ("bitwise", "n/a", "") or not losses:
        return v
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
    if corr.get("verdict") == "WRONG":
        return "silently WRONG: " + _wrong_detail(corr, cell)
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


def breakdown_section(doc: dict[str, Any]) -> str:
    measured = [(p, r) for p in ordered_programs(doc) for r in TERRA
                if doc["cells"][p].get(r, {}).get("breakdown")]
    if not measured:
        return ("**NOT MEASURED.** terra_torch does not report PythonRunner/GraphRunner execution "
                "and stall times yet; `breakdown.png` is a placeholder. The harness reads them "
                "from `terra_torch.stats()` (keys " + ", ".join(f"`{k}`" for k in BREAKDOWN_KEYS)
                + ") once it exists.")
    lines = ["| program | runner | " + " | ".join(BREAKDOWN_KEYS) + " |",
             "|---|---|" + "---|" * len(BREAKDOWN_KEYS)]
    for program, runner in measured:
        b = doc["cells"][program][runner]["breakdown"]
        values = " | ".join(f"{b[k]:.3f}" for k in BREAKDOWN_KEYS)
        lines.append(f"| {program} | {runner} | {values} |")
    return "\n".join(lines)


def program_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    for program in ordered_programs(doc):
        eager = doc["cells"][program].get("eager", {})
        feats = ", ".join(eager.get("features", []))
        runs = " and ".join(f"{r:.0f}" for r in eager.get("steps_per_s_runs", []))
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
        "# terra_torch benchmarks: eager vs peers" + (" (quick)" if s.get("quick") else ""),
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
        legend(),
        "",
        "![speed-up over eager](speedup.png)",
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
                 "dotted = drift; x = failed; n/a = unavailable", fontsize=10)
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
    if cell.get("status") == "unavailable":
        ax.text(x, 0.012, "n/a", rotation=90, ha="center", va="bottom", fontsize=6, color="gray")
    elif r is None or cell.get("status") != "ok":
        ax.text(x, 0.012, "x", ha="center", va="bottom", fontsize=9, color=color, weight="bold")
    else:
        hatch, edge = {"WRONG": ("///", "red"), "drift": ("..", "black")}.get(
            verdict_of(cell), (None, None))
        ax.bar(x, r, width, color=color, hatch=hatch, edgecolor=edge or color,
               linewidth=1.2 if edge else 0)
        ax.text(x, r * 1.08, f"{r:.2g}", rotation=90, ha="center", va="bottom", fontsize=6)


def plot_breakdown(doc: dict[str, Any], path: Path) -> None:
    """Stacked per-program bars of terra's time breakdown, or a clearly marked placeholder."""
    plt = _pyplot()
    programs = ordered_programs(doc)
    fig, axes = plt.subplots(1, len(TERRA), figsize=(5 * len(TERRA), 4.5), sharey=True)
    for ax, runner in zip(axes, TERRA):
        data = [doc["cells"][p].get(runner, {}).get("breakdown") for p in programs]
        if not any(data):
            ax.text(0.5, 0.5, "NOT MEASURED\nterra_torch reports no\nPythonRunner/GraphRunner\n"
                    "exec/stall times yet", ha="center", va="center", transform=ax.transAxes,
                    fontsize=12, color="firebrick")
        else:
            _stacked(ax, programs, data)
        ax.set_title(runner)
        ax.set_xlim(-0.5, len(programs) - 0.5)
        ax.set_xticks(range(len(programs)))
        ax.set_xticklabels(programs, rotation=45, ha="right", fontsize=8)
    axes[0].set_ylabel("seconds (as terra_torch.stats() reports)")
    fig.suptitle("Time breakdown per runner (terra co-execution)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stacked(ax: Any, programs: list[str], data: list[dict[str, float] | None]) -> None:
    bottom = [0.0] * len(programs)
    for key in BREAKDOWN_KEYS:
        values = [(d or {}).get(key, 0.0) for d in data]
        ax.bar(range(len(programs)), values, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.legend(fontsize=7)


def write_all(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """report.md, speedup.png, breakdown.png in out_dir; returns the paths written."""
    paths = [out_dir / "report.md", out_dir / "speedup.png", out_dir / "breakdown.png"]
    paths[0].write_text(markdown(doc))
    plot_speedup(doc, paths[1])
    plot_breakdown(doc, paths[2])
    return paths
