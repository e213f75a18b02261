"""A co-executed training loop to profile (docs/ARCHITECTURE.md, "Per-op cost"): the MLP of
benchmarks.coexec_bench's size with a chosen optimizer, under terra_torch.wrap or eagerly, for a
fixed number of steps and nothing else, so that a profiler's samples are the steady loop's.

    perf record --call-graph dwarf,16384 -D 2500 -o perf.data \\
        .venv/bin/python -m benchmarks.coexec_profile --optimizer adam --steps 5000
    perf script -i perf.data --no-inline -F tid,ip,sym > perf.txt

(-D skips the import; the Python thread is the process's lowest thread id.) It prints the loop's
wall and Python-thread CPU time per step and, under terra, the runtime's counters.

`--program NAME` runs a program of the benchmark suite (benchmarks/programs/NAME.py) instead,
wrapped the way the suite's `terra` column wraps it (`terra_torch.wrap(model)`, or
`terra_torch.function(step)` where the program sets TERRA_ITERATION = "step"); `--optimizer` is
then ignored; `--optimize fused` runs it with compiled segments (timed once they are compiled,
checked and through their speed trial). The speed check is the caller's to turn off
(TERRA_SPEED_CHECK=0), so that every step co-executes.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn


OPTIMIZERS = ("sgd", "sgd-foreach", "adam", "adam-fused", "adam-foreach", "adamw", "rmsprop", "adagrad", "adadelta",
              "adamax", "nadam", "nadam-foreach", "radam", "radam-foreach", "asgd", "rprop")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    p.add_argument("--eager", action="store_true", help="run eagerly (the same loop, for comparison)")
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--schedule", action="store_true",
                   help="a learning rate set every step (ExponentialLR stepped after each opt.step())")
    p.add_argument("--program", default=None, help="a benchmark program (benchmarks/programs) instead of the MLP")
    p.add_argument("--optimize", choices=("none", "fused"), default="none",
                   help="with --program: optimize=\"fused\" (compiled segments); the loop waits until they are "
                        "compiled and runs 300 more steps before it times")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.program is not None:
        run_program(args)
        return
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    params = model.parameters()
    if not args.eager:  # (before the scheduler: it wraps the optimizer's step() as it finds it)
        import terra_torch
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=0.01, momentum=0.9),
           "sgd-foreach": lambda: torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True),
           "adam": lambda: torch.optim.Adam(params, lr=1e-3),
           "adam-fused": lambda: torch.optim.Adam(params, lr=1e-3, fused=True),
           "adam-foreach": lambda: torch.optim.Adam(params, lr=1e-3, foreach=True),
           "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3, momentum=0.9),
           "adagrad": lambda: torch.optim.Adagrad(params, lr=1e-2, lr_decay=1e-4),
           "adadelta": lambda: torch.optim.Adadelta(params, lr=1.0),
           "adamax": lambda: torch.optim.Adamax(params, lr=2e-3),
           "adamw": lambda: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
           "nadam": lambda: torch.optim.NAdam(params, lr=2e-3),
           "nadam-foreach": lambda: torch.optim.NAdam(params, lr=2e-3, foreach=True),
           "radam": lambda: torch.optim.RAdam(params, lr=1e-3),
           "radam-foreach": lambda: torch.optim.RAdam(params, lr=1e-3, foreach=True),
           "asgd": lambda: torch.optim.ASGD(params, lr=1e-2),
           "rprop": lambda: torch.optim.Rprop(params, lr=1e-2)}[args.optimizer]()
    schedule = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9999) if args.schedule else None
    if not args.eager:
        model = terra_torch.wrap(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 32, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(8)]
    warm = min(50, args.steps // 2)
    for i in range(args.steps):
        if i == warm:
            t0, c0 = time.perf_counter(), time.thread_time()
        x, y = batches[i % len(batches)]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if schedule is not None:
            schedule.step()
    if not args.eager:
        terra_torch.synchronize()
    n = args.steps - warm
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    print(f"{'eager' if args.eager else 'terra'} {args.optimizer}: {wall * 1e3 / n:.3f} ms/step wall, "
          f"{cpu * 1e3 / n:.3f} ms/step Python-thread CPU")
    if not args.eager:
        s = terra_torch.stats(model)
        print("  iterations", s.iterations, "fallbacks", s.fallbacks,
              {k: s.runner.get(k) for k in ("backward_replayed", "calls_replayed", "calls_per_op", "python_reads",
                                            "known_reads")})
        from benchmarks.harness.terra import TIME_FIELDS

        done = max(1, sum(s.iterations.values()))
        print("  ms/iteration over the run (terra_torch.stats):",
              ", ".join(f"{k[:-2]} {getattr(s, k) * 1e3 / done:.3f}" for k in TIME_FIELDS))


def run_program(args: argparse.Namespace) -> None:
    """The loop of a suite program: build, then `step(state, i)` for every step, wrapped by the
    suite's own `terra` runner (benchmarks/harness/terra.py) or, with --eager, by nothing."""
    from benchmarks.harness.runners import Runner
    from benchmarks.harness.runtime import Runtime, load_program
    from benchmarks.harness.terra import TerraRunner

    module = load_program(args.program)
    fused = args.optimize == "fused" and not args.eager
    runner = Runner() if args.eager else TerraRunner("terra", "coexec", optimize="fused" if fused else False)
    if runner.unavailable_reason():
        raise SystemExit(runner.unavailable_reason())
    runner.bind_program(module)
    state = module.build(0, Runtime("cpu", runner.wrap_model))
    step = runner.wrap_step(module.step)
    warm = min(50, args.steps // 2)
    if fused:  # compiled, checked and through their speed trial before the timed steps
        for i in range(300):
            step(state, i)
        runner.settle()
        for i in range(300, 600):
            step(state, i)
        warm = 0
    start = 600 if fused else 0
    for i in range(args.steps):
        if i == warm:
            t0, c0 = time.perf_counter(), time.thread_time()
        step(state, start + i)
    runner.sync()
    n = args.steps - warm
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    print(f"{'eager' if args.eager else 'terra-fused' if fused else 'terra'} {args.program}: {wall * 1e3 / n:.3f} ms/step wall, "
          f"{cpu * 1e3 / n:.3f} ms/step Python-thread CPU")
    if not args.eager:
        st = runner.stats()
        print("  iterations", st["phases"], "fallbacks", st["fallbacks"])
        b = runner.breakdown() or {}
        done = max(1, sum(st["phases"].values()))
        print("  ms/iteration over the run (terra_torch.stats):",
              ", ".join(f"{k[:-2]} {v * 1e3 / done:.3f}" for k, v in b.items()))
        for o in st["programs"]:
            r = o["runner"]
            print("  ", o["wrapped"], {k: r[k] for k in sorted(r) if k.endswith(("reads", "replayed", "threads"))})

if __name__ == "__main__":
    main()
