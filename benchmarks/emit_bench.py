"""Graph generation time for a 10,000-op trace (issue 4, item 6).

A generated function of N statements (a chain of small CPU ops, each at its own program
location, so the TraceGraph has N op nodes and no loop folds them) is recorded eagerly, merged,
case-assigned, emitted as a TorchScript graph and optimized. "branchy" records the function twice
with flags that flip every 100 statements, so the graph has a switch every 100 ops.

    PYTHONPATH=<package dir> python benchmarks/emit_bench.py [--ops 10000] [--repeat 5]

Reported: median ms per phase over --repeat builds (record once). "graph run" replays the first
recording in the TorchScript interpreter with a scripted channel (first run, then the median of
--repeat runs); "eager run" is the plain function without capture.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from terra_torch import _C, graph

BODY = ["y = y + w", "y = y * w", "y = torch.sin(y)", "y = torch.relu(y)"]


def make_chain(n: int, branch_every: int = 0):
    lines = ["def chain(x, w, flags):", "    y = x"]
    for i in range(n):
        stmt = BODY[i % len(BODY)]
        if branch_every and i % branch_every == branch_every - 1:
            k = i // branch_every
            lines += [f"    if flags[{k}]:", f"        {stmt}", "    else:", "        y = y - w"]
        else:
            lines.append(f"    {stmt}")
    lines.append("    return y")
    scope: dict = {"torch": torch}
    exec(compile("\n".join(lines), f"<chain{n}>", "exec"), scope)
    return scope["chain"]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def bench(name: str, n: int, branch_every: int, repeat: int) -> None:
    fn = make_chain(n, branch_every)
    x, w = torch.rand(4), torch.full((4,), 0.5)
    flag_sets = [[True] * (n // max(branch_every, 1) + 1)]
    if branch_every:
        flag_sets.append([k % 2 == 0 for k in range(n // branch_every + 1)])
    recs = []
    record_ms = 0.0
    for flags in flag_sets:
        rec, ms = timed(lambda: graph.record(fn, x, w, flags))
        recs.append(rec)
        record_ms += ms
    eager_ms = timed(lambda: fn(x, w, flag_sets[0]))[1]

    rows = {k: [] for k in ("add_ms", "assign_cases_ms", "emit_ms", "optimize_ms", "total_ms")}
    for _ in range(repeat):
        t0 = time.perf_counter()
        builder = _C.emit.Builder()
        for r in recs:
            builder.add(r.region)
        add_ms = (time.perf_counter() - t0) * 1e3
        g = builder.build(True)
        total = (time.perf_counter() - t0) * 1e3
        st = g.stats
        rows["add_ms"].append(add_ms)
        for k in ("assign_cases_ms", "emit_ms", "optimize_ms"):
            rows[k].append(st[k])
        rows["total_ms"].append(total)
    wrapped = graph.build(recs)
    out, first_ms = timed(lambda: wrapped.run(recs[0]))  # includes compiling the interpreter code
    assert torch.equal(out.outputs[0], recs[0].outputs[0])
    run_ms = statistics.median(timed(lambda: wrapped.run(recs[0]))[1] for _ in range(repeat))
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{name:9s} ops={st['ops']:6d} graph_nodes={st['nodes']:6d} switches={st['switches']:4d} | "
          f"record {record_ms:7.1f} | merge {med['add_ms']:6.1f} | assign {med['assign_cases_ms']:5.1f} | "
          f"emit {med['emit_ms']:6.1f} | passes {med['optimize_ms']:6.1f} | total {med['total_ms']:6.1f} | "
          f"eager run {eager_ms:6.1f} | graph run first {first_ms:6.1f} then {run_ms:6.1f}  (ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {args.ops} ops, median of {args.repeat}")
    bench("straight", args.ops, 0, args.repeat)
    bench("branchy", args.ops, 100, args.repeat)


if __name__ == "__main__":
    main()
