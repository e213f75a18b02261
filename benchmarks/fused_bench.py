"""Graph-only replay of quick-suite programs: the TorchScript interpreter against compiled segments.

For each program: step 0 runs eagerly (optimizer state), the next `--recorded` steps are
recorded, their graph is generated (terra_torch._runtime.Plan, as the `terra-graph-only` cell
does) and replayed on two GraphRunners, one interpreting the graph and one with
`mode="fused"` (csrc/runtime/fused_executor.h). The fused runner's segments are compiled
synchronously before timing (the compile time is reported; packages go to TERRA_CACHE_DIR, so a
second run of this benchmark loads them: pass a fresh directory to time compiling), then each
replayed once so that the check of their first compiled run is not timed. Timing: `--reps`
rounds, each timing `--iters` replayed iterations per mode, modes in turn; medians. Replays
update the real state (parameters drift as in training), the same for both modes.

    python -m benchmarks.fused_bench --programs mlp,cnn_bn,lstm,gpt --reps 5 --iters 200

Prints one line per program and writes `--out` (JSON) with the segment reports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.runtime import Runtime, load_program

REPLAYABLE_OPS = frozenset({"feed", "feed_or_none", "case_select", "loop_cond", "fetch", "feed_scalar", "feed_int",
                            "feed_bool", "feed_int_list", "feed_float_list", "feed_number_list"})


def _time_replays(runner: Any, scripts: list[Any], iters: int) -> float:
    from terra_torch import _runtime

    t0 = time.perf_counter()
    pending = []
    for k in range(iters):
        script = scripts[k % len(scripts)]
        runner.start_iteration()
        _runtime.post(runner.channel, script)
        pending.append(script)
        if len(pending) >= 4:  # a few iterations ahead, as co-execution runs
            _runtime.collect(runner.channel, pending.pop(0), 60.0)
    for script in pending:
        _runtime.collect(runner.channel, script, 60.0)
    runner.synchronize(60.0)
    return (time.perf_counter() - t0) / iters * 1e3


def bench(name: str, recorded: int, reps: int, iters: int) -> dict[str, Any]:
    from terra_torch import _fused, _runtime, graph

    torch.manual_seed(0)
    mod = load_program(name)
    state = mod.build(0, Runtime("cpu", lambda model, example: model))
    mod.step(state, 0)
    recordings = [graph.record(mod.step, state, i) for i in range(1, recorded + 1)]
    plan = _runtime.Plan(recordings, optimize=False)
    unserved = sorted(set(re.findall(r"terra::(\w+)", plan.text)) - REPLAYABLE_OPS)
    if unserved:
        return {"program": name, "skipped": f"the graph takes input through terra::{', terra::'.join(unserved)}"}
    scripts = [plan.script(r) for r in recordings]
    runners = {"interpreter": plan.runner("interpreter"), "fused": plan.runner("fused")}
    fused = runners["fused"].fused
    for script in scripts:  # first runs: interpreted, each segment notes its call plan
        _runtime.run_iteration(runners["fused"], script, 60.0)
    t0 = time.perf_counter()
    compiled = 0
    while _fused.compile_one(fused, 0.0):
        compiled += 1
    compile_s = time.perf_counter() - t0
    for script in scripts:  # the check of each segment's first compiled run
        _runtime.run_iteration(runners["fused"], script, 60.0)
    for mode in runners:  # warm both; the fused runner's segments finish their speed trials
        _time_replays(runners[mode], scripts, max(len(scripts), 24))
    times: dict[str, list[float]] = {mode: [] for mode in runners}
    for _ in range(reps):
        for mode, runner in runners.items():
            times[mode].append(_time_replays(runner, scripts, iters))
    segments = list(fused.report())
    med = {mode: statistics.median(v) for mode, v in times.items()}
    return {
        "program": name,
        "ms_per_iteration": med,
        "each_round": times,
        "fused_speedup": med["interpreter"] / med["fused"],
        "compile_s": compile_s,
        "segments_compiled": compiled,
        "segments": segments,
        "ops_compiled": sum(s["ops"] for s in segments if s["state"] == "trusted"),
        "ops_in_segments": sum(s["ops"] for s in segments),
        "max_difference": max((s["max_difference"] for s in segments), default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default="mlp,cnn_bn,lstm,gpt")
    parser.add_argument("--recorded", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    print("uptime before:", load_before, flush=True)
    results = []
    for name in args.programs.split(","):
        r = bench(name, args.recorded, args.reps, args.iters)
        results.append(r)
        if "skipped" in r:
            print(f"{name:12s} skipped: {r['skipped']}", flush=True)
            continue
        ms = r["ms_per_iteration"]
        states = {}
        for s in r["segments"]:
            states[s["state"]] = states.get(s["state"], 0) + 1
        print(f"{name:12s} interpreter {ms['interpreter']:.3f} ms  fused {ms['fused']:.3f} ms  "
              f"({r['fused_speedup']:.2f}x)  compile {r['compile_s']:.1f} s for {r['segments_compiled']} segments; "
              f"{r['ops_compiled']} of {r['ops_in_segments']} segment ops compiled; states {states}; "
              f"max |compiled - interpreted| {r['max_difference']:.2e}", flush=True)
        for s in r["segments"]:
            if s["state"] == "interpreted":
                print(f"    {s['ops']} ops interpreted: {s['reason']}", flush=True)
    load_after = os.getloadavg()
    print("uptime after:", load_after, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"load_before_after": [load_before, load_after],
                                              "measured": time.strftime("%Y-%m-%d %H:%M"), "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
