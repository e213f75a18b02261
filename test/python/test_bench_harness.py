"""The benchmark harness's bookkeeping (benchmarks/run.py, benchmarks/harness/report.py).

Pure Python over synthetic result documents, with the worker processes replaced by a fake
`run_cell`: ratios must divide by the eager baseline of the cell's own run (issue 15 item 7),
eager must bracket each runner group, a merged table must keep earlier runs' baselines exactly
as long as cells of theirs remain, terra's coverage column must compute its shares and rates
(issue 16 item 8), and a program whose optional package is missing must be skipped for every
runner. The hf_gpt2 program itself is checked at the end (skipped without transformers).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a package of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import run as bench_run  # noqa: E402
from benchmarks.harness import report  # noqa: E402


class FakeCells:
    """Stands in for run.run_cell: returns the next steps/s for a runner, records the order."""

    def __init__(self, speeds: dict[str, list[float]], extra: dict[str, Any] | None = None):
        self.speeds = {k: list(v) for k, v in speeds.items()}
        self.extra = extra or {}
        self.calls: list[str] = []

    def __call__(self, program: str, runner: str, args: Any, scratch: Path,
                 rerun: bool = False) -> dict[str, Any]:
        self.calls.append(runner)
        cell = {"program": program, "runner": runner, "status": "ok",
                "steps_per_s": self.speeds[runner].pop(0), "cell_wall_s": 0.0}
        cell.update(self.extra.get(runner, {}))
        return cell


def _run(monkeypatch: pytest.MonkeyPatch, fake: FakeCells, cells: dict[str, Any],
         runners: list[str], run_id: str) -> None:
    monkeypatch.setattr(bench_run, "run_cell", fake)
    bench_run.run_program("mlp", runners, argparse.Namespace(), Path("/nonexistent"), cells,
                          run_id)


def _doc(cells: dict[str, Any], run_ids: list[str]) -> dict[str, Any]:
    return {"meta": {"settings": {}, "runs": [{"id": r} for r in run_ids]},
            "cells": {"mlp": cells}}


def test_eager_brackets_each_group_and_cells_carry_the_run(monkeypatch):
    fake = FakeCells({"eager": [100.0, 90.0, 80.0], "jit-trace": [95.0], "compile": [70.0],
                      "terra": [50.0], "terra-lazy": [40.0]})
    cells: dict[str, Any] = {}
    _run(monkeypatch, fake, cells, ["eager", "compile", "terra", "jit-trace", "terra-lazy"], "A")
    # Peers as one group, terra as another, eager before and after each.
    assert fake.calls == ["eager", "compile", "jit-trace", "eager", "terra", "terra-lazy",
                          "eager"]
    assert {c["run_id"] for c in cells.values()} == {"A"}
    eager = cells["eager"]
    assert eager["steps_per_s_runs"] == [100.0, 90.0, 80.0]
    assert eager["baselines"]["A"]["steps_per_s"] == 100.0
    assert report.ratio(_doc(cells, ["A"]), "mlp", "terra") == pytest.approx(0.5)


def test_merged_run_keeps_each_cells_own_baseline(monkeypatch):
    cells: dict[str, Any] = {}
    _run(monkeypatch, FakeCells({"eager": [100.0, 100.0], "terra": [50.0]}), cells,
         ["eager", "terra"], "A")
    # A quieter later run re-measures eager and a peer only: the terra cell of run A must stay
    # against A's eager (100), not the new, faster one (200), and the peer against 200.
    _run(monkeypatch, FakeCells({"eager": [200.0, 180.0], "jit-trace": [150.0]}), cells,
         ["eager", "jit-trace"], "B")
    doc = _doc(cells, ["A", "B"])
    assert cells["terra"]["run_id"] == "A"
    assert report.ratio(doc, "mlp", "terra") == pytest.approx(0.5)
    assert report.ratio(doc, "mlp", "jit-trace") == pytest.approx(0.75)
    assert set(cells["eager"]["baselines"]) == {"A", "B"}
    assert "R1" in report.cell_text(doc, "mlp", "terra")
    assert "R2" in report.cell_text(doc, "mlp", "jit-trace")
    assert "R1, R2" in report.ratio_source(doc)
    # Re-measuring terra too leaves no cell of run A: its baseline and the run go.
    _run(monkeypatch, FakeCells({"eager": [120.0, 110.0], "terra": [60.0]}), cells,
         ["eager", "terra"], "C")
    assert set(cells["eager"]["baselines"]) == {"B", "C"}
    doc = _doc(cells, ["A", "B", "C"])
    bench_run.prune_runs(doc)
    assert [r["id"] for r in doc["meta"]["runs"]] == ["B", "C"]
    assert report.ratio(doc, "mlp", "terra") == pytest.approx(0.5)


def test_a_merged_cell_keeps_the_verdict_of_its_own_run():
    """Correctness, like speed, is judged within one run: a later run's eager (here with other
    bits, as another host's MKL gives) must not turn an earlier bitwise cell into a MISMATCH,
    while a cell of the later run is judged against it."""
    def losses(*values: float) -> dict[str, Any]:
        return {"status": "ok", "losses": list(values), "digest": [1.0]}

    cells = {"eager": {**losses(1.0, 0.5), "run_id": "A", "rerun": losses(1.0, 0.5)},
             "terra": {**losses(1.0, 0.5), "run_id": "A"}}
    doc = _doc(cells, ["A"])
    bench_run.attach_correctness(doc, "A")
    assert cells["terra"]["correctness"]["verdict"] == "bitwise"
    cells["eager"] = {**losses(1.0, 0.5000001), "run_id": "B", "rerun": losses(1.0, 0.5000001)}
    cells["terra-lazy"] = {**losses(1.0, 0.5), "run_id": "B"}
    bench_run.attach_correctness(doc, "B")
    assert cells["terra"]["correctness"]["verdict"] == "bitwise"  # (run A's verdict)
    assert cells["terra-lazy"]["correctness"]["verdict"] == "MISMATCH"  # (against run B's eager)
    bench_run.attach_correctness(doc)  # (without a run: everything against the eager cell)
    assert cells["terra"]["correctness"]["verdict"] == "MISMATCH"


def test_no_ratio_without_a_same_run_eager():
    cells = {"eager": {"status": "ok", "steps_per_s": 100.0, "run_id": "B",
                       "baselines": {"B": {"steps_per_s": 100.0}}},
             "terra": {"status": "ok", "steps_per_s": 50.0, "run_id": "A"}}
    doc = _doc(cells, ["A", "B"])
    assert report.ratio(doc, "mlp", "terra") is None
    assert "no same-run eager" in report.cell_text(doc, "mlp", "terra")


def test_legacy_results_get_one_legacy_run():
    doc = {"meta": {"settings": {}, "updated": "then"}, "cells": {"mlp": {
        "eager": {"status": "ok", "steps_per_s": 100.0, "steps_per_s_runs": [90.0, 100.0]},
        "terra": {"status": "ok", "steps_per_s": 25.0}}}}
    bench_run.migrate(doc)
    assert [r["id"] for r in doc["meta"]["runs"]] == [bench_run.LEGACY_RUN]
    assert doc["cells"]["mlp"]["terra"]["run_id"] == bench_run.LEGACY_RUN
    assert report.ratio(doc, "mlp", "terra") == pytest.approx(0.25)
    bench_run.migrate(doc)  # idempotent: loading a migrated document adds nothing
    assert len(doc["meta"]["runs"]) == 1


def test_skipped_program_runs_no_other_cell(monkeypatch):
    skipped = {"status": "unavailable", "program_unavailable": True,
               "reason": "program skipped: transformers is not installed", "steps_per_s": None}
    fake = FakeCells({"eager": [None]}, extra={"eager": skipped})
    cells: dict[str, Any] = {}
    _run(monkeypatch, fake, cells, ["eager", "compile", "terra"], "A")
    assert fake.calls == ["eager"]
    assert cells["terra"]["status"] == "unavailable" and cells["terra"]["runner"] == "terra"
    doc = _doc(cells, ["A"])
    assert report.cell_text(doc, "mlp", "terra") == "n/a"
    lines = report.unavailable_lines(doc)
    assert len(lines) == 1 and "transformers is not installed" in lines[0]


def test_coverage_shares_and_fallback_rates():
    terra = {"status": "ok", "steps_per_s": 10.0, "run_id": "A",
             "stats": {"phases": {"tracing": 5, "coexec": 90, "eager": 5}, "fallbacks": 4},
             "timed_counters": {"steps": 40, "iterations_tracing": 2.0,
                                "iterations_coexec": 38.0, "iterations_eager": 0.0,
                                "fallbacks": 1.0}}
    cov = report.coverage(terra)
    assert cov["timed"]["coexec_share"] == pytest.approx(0.95)
    assert cov["timed"]["fallbacks_per_100"] == pytest.approx(2.5)
    assert cov["cell"]["coexec_share"] == pytest.approx(0.90)
    assert cov["cell"]["fallbacks_per_100"] == pytest.approx(4.0)
    doc = _doc({"eager": {"status": "ok", "steps_per_s": 20.0, "run_id": "A"}, "terra": terra},
               ["A"])
    assert report.coverage_text(doc, "mlp") == "95% / 2.5 (cell 90% / 4.0)"
    # Cells from before timed fallbacks were counted: share known, rate unknown, not zero.
    del terra["timed_counters"]["fallbacks"]
    assert report.coverage_text(doc, "mlp").startswith("95% / ?")
    assert report.summary_table(doc).splitlines()[2].endswith("| 95% / ? (cell 90% / 4.0) |")


def test_hf_gpt2_is_skipped_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    module = importlib.reload(importlib.import_module("benchmarks.programs.hf_gpt2"))
    try:
        assert module.UNAVAILABLE and "transformers" in module.UNAVAILABLE
        from benchmarks.harness import worker

        cfg = worker.CellConfig(seed=0, warmup=0, reps=1, steps_per_rep=1, quick=True,
                                threads=1, rerun=False)
        result = worker.run_cell("hf_gpt2", "eager", cfg)
        assert result["status"] == "unavailable" and result["program_unavailable"]
        assert "transformers" in result["reason"]
    finally:
        monkeypatch.delitem(sys.modules, "transformers")
        importlib.reload(module)


def test_hf_gpt2_trains_and_is_deterministic():
    pytest.importorskip("transformers", reason="transformers not installed (the test extra)")
    from benchmarks.harness.runtime import Runtime, load_program

    module = load_program("hf_gpt2")
    assert module.UNAVAILABLE is None

    def train() -> tuple[list[float], list[float]]:
        state = module.build(0, Runtime("cpu", lambda model, example: model))
        losses = [float(module.step(state, i)) for i in range(6)]
        return losses, module.digest(state)

    losses, digest = train()
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(module.VOCAB), rel=0.05)  # random init
    assert losses[-1] < losses[0]  # AdamW moves the weights the loss depends on
    assert train() == (losses, digest)  # same seed, same trajectory: the eager reference
