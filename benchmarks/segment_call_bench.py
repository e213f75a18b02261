"""What calling an interpreted segment costs, and that a segment left in place costs nothing.

A recorded MLP + SGD-momentum step (one straight-line graph) is replayed three ways, on the
calling thread, thread CPU time per replay:

  interpreter   the generated graph as it is (TorchScriptExecutor);
  called        mode "fused" with nothing compiled: each segment is called and interpreted
                (the input list, the boxed terra::segment call, a new interpreter state, the
                result list, the views made again after the call);
  in place      mode "fused" once every segment is given up (FusedExecutor::failed): the graph is
                cut again with their ops left where they were (docs/RUNTIME.md, "Compiled
                segments" 7).

The modes take turns `--reps` times, `--iters` replays each; medians. "called" and "in place" run
on two graphs of the same recording, so the turns interleave all three.

    python -m benchmarks.segment_call_bench --reps 21 --iters 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args(argv)
    os.environ.setdefault("TERRA_CACHE_DIR", tempfile.mkdtemp(prefix="terra_segment_call_"))
    from terra_torch import graph

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(32, 32), torch.randint(0, 4, (32,))

    def step() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    step()  # (momentum buffers exist from here on)
    rec = graph.record(step)
    called, in_place = graph.build([rec]), graph.build([rec])
    in_place.run(rec, mode="fused")
    for k in range(len(in_place.segments)):
        in_place._graph.fused.failed(k, "given up by segment_call_bench")
    runs = {"interpreter": lambda: called.run(rec, mode="interpreter"),
            "called": lambda: called.run(rec, mode="fused"),
            "in place": lambda: in_place.run(rec, mode="fused")}
    for run in runs.values():
        for _ in range(20):
            run()
    before = _uptime()
    us: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            t = time.thread_time()
            for _ in range(args.iters):
                run()
            us[name].append((time.thread_time() - t) / args.iters * 1e6)
    after = _uptime()
    segments = called.segments
    print(f"MLP + SGD step, {len(segments)} segment(s) of {[s['ops'] for s in segments]} ops; "
          f"thread CPU per replay, medians of {args.reps} x {args.iters}")
    base = statistics.median(us["interpreter"])
    for name, values in us.items():
        m = statistics.median(values)
        print(f"  {name:12s} {m:7.1f} us  ({m / base:.3f}x the interpreter)")
    assert all(s["inlined"] for s in in_place.segments)
    print(f"uptime before: {before}\nuptime after:  {after}")


if __name__ == "__main__":
    main()
