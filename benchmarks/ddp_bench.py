"""Data-parallel training steps per second: eager DDP against terra_torch.wrap(DDP(model)), 2
processes on this machine (gloo over the loopback address), one intra-op thread each.

    .venv/bin/python -m benchmarks.ddp_bench [--reps 7] [--steps 200] [--models mlp,wide]

Both ranks run the same schedule: per model, a warm-up of each mode, then `reps` repetitions in
turns (eager, terra, terra with the speed check, eager, ...), each `steps` steps of forward, backward (with DDP's
gradient allreduce), optimizer step and a loss read every 10 steps; a repetition's time is the
slower rank's (a step ends when both ranks have it). "terra" co-executes every step
(speed_check=False); "terra default" is what a user gets by default: the speed check may run
either rank eagerly where that is faster. Cells are medians; the ratio divides cells of
this run. Every run also checks that both modes ended with the same parameters, bit for bit.
Results: benchmarks/results/ddp.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "results" / "ddp.json"
MODES = ("eager", "terra", "terra default")

MODELS = {
    # (layer widths, batch, optimizer): overhead-bound like the demo, and one where kernels and
    # the allreduce weigh more.
    "mlp": ((32, 64, 64, 10), 32, "adam"),
    "wide": ((256, 1024, 1024, 10), 64, "sgd"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=150, help="steps per mode before the timed turns")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--port", type=int, default=29650)
    p.add_argument("--out", default=str(OUT))
    return p.parse_args(argv)


def _steps(model: Any, opt: Any, data: list, n: int, offset: int) -> None:
    import torch.nn.functional as F

    for i in range(n):
        x, y = data[(offset + i) % len(data)]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i % 10 == 0:
            loss.item()


def _worker(rank: int, args: argparse.Namespace, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=dt.timedelta(seconds=120))
    import terra_torch

    results: dict[str, Any] = {}
    for name in args.models.split(","):
        widths, batch, optimizer = MODELS[name]
        g = torch.Generator().manual_seed(rank)
        data = [(torch.randn(batch, widths[0], generator=g), torch.randint(0, widths[-1], (batch,), generator=g))
                for _ in range(8)]
        runs = {}
        for mode in MODES:
            torch.manual_seed(0)
            layers: list[nn.Module] = []
            for a, b in zip(widths, widths[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            net = nn.Sequential(*layers[:-1])
            ddp = nn.parallel.DistributedDataParallel(net)
            model = terra_torch.wrap(ddp, speed_check=mode == "terra default") if mode != "eager" else ddp
            opt = (torch.optim.Adam(net.parameters(), lr=1e-3) if optimizer == "adam"
                   else torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
            runs[mode] = (net, model, opt)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}  # this process's CPU time, all threads
        offset = 0
        for mode in MODES:
            _, model, opt = runs[mode]
            _steps(model, opt, data, args.warmup, 0)
        for _ in range(args.reps):
            for mode in MODES:
                _, model, opt = runs[mode]
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                _steps(model, opt, data, args.steps, offset)
                if mode != "eager":
                    terra_torch.synchronize()
                c1 = time.process_time()
                dist.barrier()
                times[mode].append(time.perf_counter() - t0)
                cpu[mode].append(c1 - c0)
            offset += args.steps
        # Each mode ran the same steps from the same start: the same parameters, bit for bit.
        same = all(torch.equal(a, b) for m in MODES[1:]
                   for a, b in zip(runs["eager"][0].parameters(), runs[m][0].parameters()))
        stats = terra_torch.stats(runs["terra"][1])
        results[name] = {"eager_s": times["eager"], "terra_s": times["terra"], "default_s": times["terra default"],
                         "bitwise": same, "eager_cpu_s": cpu["eager"], "terra_cpu_s": cpu["terra"],
                         "iterations": dict(stats.iterations), "fallbacks": stats.fallbacks,
                         "default_iterations": dict(terra_torch.stats(runs["terra default"][1]).iterations),
                         "backward": {k: v for k, v in stats.runner.items() if k.startswith("backward")}}
        for m in MODES[1:]:
            terra_torch.unwrap(runs[m][1])
    queue.put((rank, results))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    args = parse_args(argv)
    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    load_after = os.getloadavg()
    table = {}
    print(f"{'model':8} {'eager steps/s':>14} {'terra steps/s':>14} {'ratio':>6} {'default':>8}  bitwise  "
          "co-executed  CPU ms/step per rank (eager, terra)")
    for name in args.models.split(","):
        r0, r1 = per_rank[0][name], per_rank[1][name]
        # A repetition ends when both ranks have finished it (they meet in a barrier anyway).
        eager = [max(a, b) for a, b in zip(r0["eager_s"], r1["eager_s"])]
        terra = [max(a, b) for a, b in zip(r0["terra_s"], r1["terra_s"])]
        default = [max(a, b) for a, b in zip(r0["default_s"], r1["default_s"])]
        e, t = args.steps / statistics.median(eager), args.steps / statistics.median(terra)
        d = args.steps / statistics.median(default)
        it = r0["iterations"]
        share = it.get("coexec", 0) / max(1, sum(it.values()))
        # CPU per step, all threads of a rank's process (Python, the graph's worker, gloo's):
        # with two ranks on two cores there is no idle core for co-execution to fill.
        ce = statistics.median(r0["eager_cpu_s"] + r1["eager_cpu_s"]) / args.steps * 1e3
        ct = statistics.median(r0["terra_cpu_s"] + r1["terra_cpu_s"]) / args.steps * 1e3
        table[name] = {"eager_steps_s": e, "terra_steps_s": t, "ratio": t / e, "default_steps_s": d,
                       "default_ratio": d / e, "eager_cpu_ms_step": ce,
                       "terra_cpu_ms_step": ct, "bitwise": r0["bitwise"] and r1["bitwise"], "coexec_share": share,
                       "ranks": per_rank_of(name, per_rank)}
        print(f"{name:8} {e:14.1f} {t:14.1f} {t / e:5.2f}x {d / e:7.2f}x  {str(table[name]['bitwise']):7}  "
              f"{share:11.0%}  {ce:.2f}, {ct:.2f}")
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
    out = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": platform.node(),
           "python": sys.version.split()[0], "args": vars(args), "load": [load_before[0], load_after[0]],
           "results": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def per_rank_of(name: str, per_rank: dict[int, Any]) -> dict[str, Any]:
    return {str(r): per_rank[r][name] for r in per_rank}


if __name__ == "__main__":
    sys.exit(main())
