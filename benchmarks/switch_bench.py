"""What a switch between co-execution and eager costs: iteration times around forced switches.

The speed check (terra_torch/_speed.py) moves a program between co-executed and eager
iterations to measure both; each move has a price the check's blocks do not see: the graph
drains before eager iterations (synchronize), the first co-executed iterations after eager ones
may wait for the graph (reads it cannot answer), and idle OpenMP teams of the mode just left may
spin on the cores the other mode needs. This replaces the check with a fixed schedule (`--period`
iterations co-executed, then as many eager, ...) and prints, for each stretch, its first
iterations, the median of its second half, and for co-executed stretches how long Python waited
for the graph and how many reads it posted in the stretch's first iterations.

    python -m benchmarks.switch_bench --program gpt --threads 2 --period 30 [--cycles 4]

Set TERRA_OPENMP_POOL_RELEASE=0 to see the switches with no OpenMP pool given back (neither
the worker's nor Python's).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--program", default="mlp", help="a benchmark program (benchmarks/programs)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--period", type=int, default=30, help="iterations per stretch")
    p.add_argument("--cycles", type=int, default=4, help="co-executed + eager stretch pairs")
    p.add_argument("--show", type=int, default=8, help="first iterations of each stretch to print")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import terra_torch
    import terra_torch.runtime as runtime
    from terra_torch._speed import COEXEC, EAGER
    from terra_torch.api import _program_of as program_of
    from benchmarks.harness.runtime import Runtime, load_program
    from benchmarks.harness.terra import TerraRunner

    period = args.period

    class Schedule(runtime.SpeedCheck):
        """Co-executed for `period` iterations, then eager for `period`, and so on."""

        def observe(self, mode, seconds, iteration, waited=None):  # noqa: ANN001, ANN201
            if not self.enabled:
                return mode
            return COEXEC if (iteration // period) % 2 == 0 else EAGER

        @property
        def probing(self) -> bool:
            return False

    runtime.SpeedCheck = Schedule  # (the Program builds its check from this name)
    module = load_program(args.program)
    runner = TerraRunner("terra", "coexec")
    if runner.unavailable_reason():
        raise SystemExit(runner.unavailable_reason())
    runner.bind_program(module)
    state = module.build(0, Runtime("cpu", runner.wrap_model))
    step = runner.wrap_step(module.step)
    times = []
    for i in range(2 * period * args.cycles):
        t0 = time.perf_counter()
        step(state, i)
        times.append(time.perf_counter() - t0)
    runner.sync()

    wrapped = [obj for _, obj in runner._wrapped]
    spans = {}
    for obj in wrapped:
        # (iteration, start, end, stall, decisions, feeds, reads) per co-executed iteration
        for it, start, end, stall, _, _, reads in program_of(obj)._session.iteration_spans():
            spans[it] = (stall / 1e6, reads)
    print(f"{args.program}, {args.threads} thread(s), stretches of {period}; phases:",
          [terra_torch.stats(obj).iterations for obj in wrapped])
    print("stretch  mode    first iterations, ms                          median of 2nd half")
    for k in range(0, len(times), period):
        mode = "coexec" if (k // period) % 2 == 0 else "eager"
        part = times[k:k + period]
        first = " ".join(f"{t * 1e3:.2f}" for t in part[:args.show])
        print(f"{k:7d}  {mode:6s}  {first:45s} {statistics.median(part[len(part) // 2:]) * 1e3:.3f}")
        if mode == "coexec" and k > 0:
            firsts = [spans[it] for it in range(k, k + 3) if it in spans]
            print(f"{'':17s}first 3: Python waited " + ", ".join(f"{s:.2f}" for s, _ in firsts) +
                  " ms; reads posted " + ", ".join(str(r) for _, r in firsts))


if __name__ == "__main__":
    main()
