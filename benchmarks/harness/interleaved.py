"""Cells of one benchmark item measured in turns, each run in a process of its own.

A benchmark that compares eager with terra (or terra under several settings) on a shared machine
must divide figures of the same run: every round runs each cell once, one after another, so that
a burst of load hits all cells of a round alike; the caller takes medians over the rounds. Each
run is `python -m <module> --worker <item> <mode> <steps>` with the cell's environment (the speed
check off), whose last line of output is a JSON object.

    rounds = run_rounds("benchmarks.idioms_bench", "get_batch",
                        [("eager", "eager", {}), ("terra", "terra", {})], reps=5, steps=300)
    statistics.median(r["ms_per_step"] for r in rounds["terra"])

(benchmarks/step_ab.py times quick-suite programs the same way, through the harness's programs.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Sequence


def run_rounds(module: str, item: str, cells: Sequence[tuple[str, str, dict[str, str]]], reps: int,
               steps: int) -> dict[str, list[dict[str, Any]]]:
    """Per cell name, the JSON results of `reps` rounds; a cell is (name, mode, environment)."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in cells}
    for _ in range(reps):
        for name, mode, env in cells:
            run = subprocess.run([sys.executable, "-m", module, "--worker", item, mode, str(steps)],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "TERRA_SPEED_CHECK": "0", **env})
            results[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
    return results
