"""One benchmark program under eager and under terra_torch, compared bitwise, with its fallbacks.

A quick check while working on the runtime (the full suite, `python -m benchmarks.run`, takes
minutes): the losses and the final-state digest must be bitwise equal, and the fallbacks say
where co-execution had to run eagerly and why.

    python -m benchmarks.terra_vs_eager try_except --steps 60 [--mode coexec|lazy]
"""

from __future__ import annotations

import argparse
import time

import torch

import terra_torch
from benchmarks.harness.runtime import Runtime, load_program


def _run(program, steps: int, mode: str | None) -> tuple[list[float], list[float], float, list]:
    wrapped: list = []

    def wrap(model, example_inputs):
        if mode is None:
            return model
        w = terra_torch.wrap(model, mode=mode)
        wrapped.append(w)
        return w

    state = program.build(0, Runtime("cpu", wrap))
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        losses.append(program.step(state, i))
    terra_torch.synchronize()
    seconds = time.perf_counter() - start
    return [float(v) for v in losses], program.digest(state), seconds, wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", help="a module of benchmarks/programs, e.g. try_except")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--mode", default="coexec", choices=("coexec", "lazy"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    program = load_program(args.program)
    eager_losses, eager_digest, eager_s, _ = _run(program, args.steps, None)
    losses, digest, terra_s, wrapped = _run(program, args.steps, args.mode)
    same = losses == eager_losses and digest == eager_digest
    first = next((i for i, (a, b) in enumerate(zip(losses, eager_losses)) if a != b), None)
    print(f"{args.program}: {'bitwise equal' if same else 'DIFFERS'} to eager over {args.steps} steps"
          + ("" if first is None else f" (first differing loss at step {first})"))
    print(f"eager {args.steps / eager_s:.0f} steps/s, terra {args.steps / terra_s:.0f} steps/s "
          f"({eager_s / terra_s:.2f}x; one short run: use benchmarks.run for timings)")
    for w in wrapped:
        stats = terra_torch.stats(w)
        print(f"{type(w).__name__}: iterations {dict(stats.iterations)}, {stats.fallbacks} fallbacks")
        for f in w._terra_program.fallbacks:
            print(f"  iteration {f.iteration} at {f.source_line}: {f.reason}")


if __name__ == "__main__":
    main()
