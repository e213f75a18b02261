#!/usr/bin/env python3
"""GPU benchmark of convolution profile records against torch.backends.cudnn.benchmark.

Seed 001's claims, measured on PyTorch: (1) profiling at start-up overshoots memory, which
limits the batch size; (2) a record keyed without the batch size removes re-profiling for later
runs and other batch sizes. For a ResNet-50-style and an Inception-style model (defined below, no
torchvision), each scenario runs in a fresh process:

  benchmark      torch.backends.cudnn.benchmark = True (PyTorch's answer today)
  record-empty   terra_torch profile record enabled, file absent: profiles under the cap
  record-warm    the same record, written by record-empty: no profiling at all

and reports peak GPU memory during start-up (the first steps) and in the steady state, time to
first step, steady step time, and batch-size headroom: the largest batch a training step reaches
in that process after start-up (new batch sizes make cudnn.benchmark profile again; the record
reuses its entries). The GPU can be limited with --memory-limit-gib to emulate a smaller card and
to keep the headroom search short. Every worker imports terra_torch (its dispatcher hooks are
then present in all three columns). Prints a table and writes JSON after every scenario, so a run
cut short by --time-budget or a kill keeps what it measured. Needs a CUDA GPU and a CUDA build of
terra_torch; scripts/gpu_check.sh builds one and runs this with settings sized for a short lease.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

# ---- models (own definitions) ----------------------------------------------------------------


def conv_bn(cin: int, cout: int, k: Any, stride: int = 1, padding: Any = 0) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, padding, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(conv_bn(cin, width, 1), conv_bn(width, width, 3, stride, 1),
                                  nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet50(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [conv_bn(3, 64, 7, 2, 3), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


class Mixed(nn.Module):
    """An Inception-v3-style block: parallel 1x1, factorized 7x7 (1x7 then 7x1), double 3x3 and
    pooled branches, concatenated; many distinct convolution shapes, as in the paper's model."""

    def __init__(self, cin: int, c7: int) -> None:
        super().__init__()
        self.b1 = conv_bn(cin, 192, 1)
        self.b7 = nn.Sequential(conv_bn(cin, c7, 1), conv_bn(c7, c7, (1, 7), padding=(0, 3)),
                                conv_bn(c7, 192, (7, 1), padding=(3, 0)))
        self.b3 = nn.Sequential(conv_bn(cin, c7, 1), conv_bn(c7, c7, 3, padding=1), conv_bn(c7, 192, 3, padding=1))
        self.bp = nn.Sequential(nn.AvgPool2d(3, 1, 1), conv_bn(cin, 192, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b7(x), self.b3(x), self.bp(x)], 1)


def inception(classes: int = 1000) -> nn.Module:
    stem = [conv_bn(3, 32, 3, 2), conv_bn(32, 32, 3), conv_bn(32, 64, 3, padding=1), nn.MaxPool2d(3, 2),
            conv_bn(64, 80, 1), conv_bn(80, 192, 3), nn.MaxPool2d(3, 2)]
    # 35x35 then, after a strided reduction, 18x18: where Inception-v3 runs its mixed blocks.
    blocks = [Mixed(192, 64), conv_bn(768, 768, 3, 2, 1), Mixed(768, 128), Mixed(768, 160), Mixed(768, 192)]
    return nn.Sequential(*stem, *blocks, conv_bn(768, 1280, 3, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(1280, classes))


MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {"resnet50": (resnet50, 224), "inception": (inception, 299)}
SCENARIOS = ("benchmark", "record-empty", "record-warm")

# ---- one scenario, in its own process ---------------------------------------------------------


def worker(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())  # an index: set_per_process_memory_fraction needs one
    if args.memory_limit_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_limit_gib * 2**30 / total), device)
    torch.backends.cudnn.benchmark = args.scenario == "benchmark"
    # Imported in every scenario, so that all columns pay for terra_torch's dispatcher hooks alike.
    from terra_torch import profile as terra_profile

    profile = None
    if args.scenario.startswith("record"):
        profile = terra_profile
        profile.enable(args.record, args.workspace_cap or None)
    factory, size = MODELS[args.model]
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = factory().to(device=device, dtype=dtype, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(batch: int) -> None:
        x = torch.randn(batch, 3, size, size, device=device, dtype=dtype).contiguous(memory_format=fmt)
        y = torch.randint(0, 1000, (batch,), device=device)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x).float(), y).backward()
        opt.step()

    torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    step(args.batch)
    torch.cuda.synchronize(device)
    first_step_s = time.perf_counter() - t0  # model construction included
    first_step_only_s = time.perf_counter() - t1
    for _ in range(2):  # start-up: the first steps, where cudnn.benchmark profiles
        step(args.batch)
    torch.cuda.synchronize(device)
    startup_alloc = torch.cuda.max_memory_allocated(device)
    startup_reserved = torch.cuda.max_memory_reserved(device)
    startup_profiles = profile.stats()["profiles"] if profile is not None else None

    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step(args.batch)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    steady_alloc = torch.cuda.max_memory_allocated(device)

    def fits(batch: int) -> bool:
        try:
            step(batch)
            torch.cuda.synchronize(device)
            return True
        except torch.cuda.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            return False

    # Doubling, then bisection: at most a dozen training steps at new batch sizes.
    t_headroom = time.perf_counter()
    tried: list[int] = []
    lo, hi = args.batch, None
    while hi is None and lo * 2 <= args.max_batch:
        tried.append(lo * 2)
        if fits(lo * 2):
            lo *= 2
        else:
            hi = lo * 2
    while hi is not None and hi - lo > max(1, lo // args.headroom_precision):
        mid = (lo + hi) // 2
        tried.append(mid)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    headroom_s = time.perf_counter() - t_headroom

    result = {"model": args.model, "scenario": args.scenario, "batch": args.batch,
              "startup_peak_allocated_mib": startup_alloc / 2**20, "startup_peak_reserved_mib": startup_reserved / 2**20,
              "steady_peak_allocated_mib": steady_alloc / 2**20,
              "time_to_first_step_s": first_step_s, "first_step_only_s": first_step_only_s,
              "steady_step_ms": 1000 * statistics.median(times), "steady_step_ms_min": 1000 * min(times),
              "max_batch": lo, "max_batch_capped": hi is None, "headroom_batches_tried": tried,
              "headroom_search_s": headroom_s}
    if profile is not None:
        stats = profile.stats()
        result.update(profiles=stats["profiles"], startup_profiles=startup_profiles, calls=stats["calls"],
                      record_hits=stats["record_hits"], fallbacks=stats["fallbacks"], failures=stats["failures"],
                      record_entries=len(profile.entries()))
        profile.disable()
    return result


# ---- driver ------------------------------------------------------------------------------------


def run_scenario(args: argparse.Namespace, model: str, scenario: str, record: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--scenario", scenario,
           "--record", record, "--batch", str(args.batch), "--steps", str(args.steps), "--dtype", args.dtype,
           "--max-batch", str(args.max_batch), "--memory-limit-gib", str(args.memory_limit_gib),
           "--headroom-precision", str(args.headroom_precision)]
    if args.workspace_cap:
        cmd += ["--workspace-cap", args.workspace_cap]
    if args.channels_last:
        cmd.append("--channels-last")
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "scenario": scenario, "error": [f"timed out after {timeout:.0f} s"]}
    wall = time.perf_counter() - t
    # Warnings (fallbacks, ...) go to stderr; keep their tail for the report.
    tail = proc.stderr.strip().splitlines()[-20:]
    if proc.returncode != 0:
        return {"model": model, "scenario": scenario, "error": tail or ["failed"], "process_s": wall}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    if tail:
        result["stderr_tail"] = tail
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    cols = [("model", "model", "{}"), ("scenario", "scenario", "{}"), ("startup_peak_allocated_mib", "peak alloc MiB", "{:.0f}"),
            ("startup_peak_reserved_mib", "peak reserved MiB", "{:.0f}"),
            ("steady_peak_allocated_mib", "steady alloc MiB", "{:.0f}"), ("time_to_first_step_s", "first step s", "{:.2f}"),
            ("steady_step_ms", "step ms", "{:.1f}"), ("max_batch", "max batch", "{}"), ("profiles", "profiles", "{}")]
    rows = [[h for _, h, _ in cols]]
    for r in results:
        if "error" in r:
            rows.append([r["model"], r["scenario"], "error: " + " ".join(r["error"])] + [""] * (len(cols) - 3))
            continue
        row = [fmt.format(r[k]) if k in r else "-" for k, _, fmt in cols]
        if r.get("max_batch_capped"):
            row[[k for k, _, _ in cols].index("max_batch")] += "+"
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50,inception", help="comma list of: " + ", ".join(MODELS))
    p.add_argument("--batch", type=int, default=32, help="training batch size (default 32)")
    p.add_argument("--steps", type=int, default=20, help="steady-state steps timed (default 20)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--workspace-cap", default="1GiB", help="record scenarios' workspace cap (default 1GiB; '' = none)")
    p.add_argument("--memory-limit-gib", type=float, default=16.0,
                   help="limit the process to this much GPU memory (default 16, a common card; 0 = all)")
    p.add_argument("--max-batch", type=int, default=1024, help="stop the headroom search here (default 1024)")
    p.add_argument("--headroom-precision", type=int, default=16,
                   help="stop bisecting when the gap is below max batch / this (default 16)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per scenario process")
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds for the whole run; scenarios that no longer fit are skipped (default 0 = none)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma list of: " + ", ".join(SCENARIOS) + " (default all; record-warm needs record-empty "
                        "before it or a record already in --record-dir)")
    p.add_argument("--record-dir", default="",
                   help="keep the records written by the record scenarios here (default: a temporary folder)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "gpu_profile_record.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    p.add_argument("--record", help=argparse.SUPPRESS)
    args = p.parse_args()

    if not torch.cuda.is_available():
        print("gpu_profile_record: this benchmark needs a CUDA GPU; torch.cuda.is_available() is False "
              f"(torch {torch.__version__}). Run it on the GPU machine.", file=sys.stderr)
        return 1
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    from terra_torch import _C

    if not _C.profile.with_cuda:
        print("gpu_profile_record: terra_torch._C was built without CUDA/cuDNN; rebuild it on this machine "
              "(pip install -e . --no-build-isolation).", file=sys.stderr)
        return 1
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")

    scenarios = [s for s in SCENARIOS if s in args.scenarios.split(",")]
    if set(args.scenarios.split(",")) - set(SCENARIOS):
        p.error(f"unknown scenario(s) in {args.scenarios!r}; choose from {list(SCENARIOS)}")
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "config": {k: v for k, v in vars(args).items()
                                                              if k not in ("worker", "model", "scenario", "record")},
           "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save() -> None:  # after every scenario: a run cut short keeps what it measured
        tmp_out = args.out + ".tmp"
        with open(tmp_out, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp_out, args.out)

    with tempfile.TemporaryDirectory() as tmp:
        record_dir = args.record_dir or tmp
        os.makedirs(record_dir, exist_ok=True)
        for model in models:
            record = os.path.join(record_dir, f"{model}-record.json")
            if "record-empty" in scenarios and os.path.exists(record):  # record-empty starts without a file
                os.remove(record)
            for scenario in scenarios:
                timeout: float = args.timeout
                if args.time_budget:
                    timeout = min(timeout, args.time_budget - (time.perf_counter() - start))
                if timeout < 20:
                    results.append({"model": model, "scenario": scenario, "error": ["skipped: time budget spent"]})
                    continue
                print(f"[{model}] {scenario} ...", file=sys.stderr, flush=True)
                results.append(run_scenario(args, model, scenario, record, timeout))
                r = results[-1]
                print(f"[{model}] {scenario}: " + ("error " + " | ".join(r["error"][-3:]) if "error" in r else
                      f"peak {r['startup_peak_allocated_mib']:.0f} MiB, first step {r['time_to_first_step_s']:.2f} s, "
                      f"step {r['steady_step_ms']:.1f} ms, max batch {r['max_batch']}"), file=sys.stderr, flush=True)
                save()
    print_table(results)
    save()
    print(f"\nwritten {args.out}", file=sys.stderr)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
