#!/usr/bin/env python3
"""GPU benchmark of convolution profile records against torch.backends.cudnn.benchmark.

Seed 001's claims, measured on PyTorch: (1) profiling at start-up overshoots memory, which
limits the batch size; (2) a record keyed without the batch size removes re-profiling for later
runs and other batch sizes. Issue 17 adds the steady state: with format 2 (cuDNN engine
configurations, cached execution plans) a step must cost what cudnn.benchmark's costs. For a
ResNet-50-style and an Inception-style model (defined below, no torchvision), each scenario runs
in a fresh process:

  benchmark         torch.backends.cudnn.benchmark = True (PyTorch's answer today)
  record-empty      terra_torch profile record enabled, file absent: profiles under the cap
  record-warm       the same record, written by record-empty: no profiling at all
  record-new-batch  the warm record at --new-batch: no profiling either, only new plans

and reports, per process: peak GPU memory during start-up (the first steps) and in the steady
state, time to first step, the steady step (CUDA events, median of --steps), and from
torch.profiler over --profile-steps steps the host time per call of the convolution ops
(aten::cudnn_convolution, aten::cudnn_convolution_transpose, aten::convolution_backward: the ops
terra's kernels replace, so the columns compare like with like) and the GPU-busy time per step
(union of kernel intervals). --autocast-run adds one ResNet-50 process under bfloat16 autocast
with a fresh record and reports whether the recorded configurations use tensor cores.
--headroom adds the batch-size headroom search (the largest batch a step reaches). The targets of
issue 17 (steady step within 3% of cudnn.benchmark's, first step with a warm record at most 1/10
of it, start-up peak at most 1.05x the steady peak) are checked and written under "targets".

Every worker imports terra_torch (its dispatcher hooks are then present in every column). Prints
a table and writes JSON after every scenario, so a run cut short by --time-budget or a kill keeps
what it measured. Without a CUDA GPU, or with a build of terra_torch without CUDA, it says so and
exits 0 (skipped). scripts/gpu_check.sh builds a CUDA terra_torch and runs this sized for a lease.
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
SCENARIOS = ("benchmark", "record-empty", "record-warm", "record-new-batch")
# The ops terra's kernels replace (csrc/profile/cuda/conv_kernels.cpp); PyTorch's run the same ops.
CONV_OPS = ("aten::cudnn_convolution", "aten::cudnn_convolution_transpose", "aten::convolution_backward")


def profiler_summary(prof: Any, steps: int) -> dict[str, Any]:
    """Host time per call of the convolution ops and GPU-busy time per step, from torch.profiler."""
    ops: dict[str, Any] = {}
    for e in prof.key_averages():
        if e.key in CONV_OPS and e.count:
            ops[e.key] = {"calls_per_step": e.count / steps, "cpu_us_per_call": e.cpu_time_total / e.count,
                          "self_cpu_us_per_call": e.self_cpu_time_total / e.count}
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in intervals:  # union: kernels of several streams may overlap
        if b > end:
            busy += b - max(a, end)
            end = b
    calls = sum(o["calls_per_step"] for o in ops.values())
    cpu = sum(o["cpu_us_per_call"] * o["calls_per_step"] for o in ops.values())
    return {"conv_ops": ops, "conv_calls_per_step": calls, "conv_cpu_us_per_call": cpu / calls if calls else None,
            "gpu_busy_ms_per_step": busy / 1000 / steps, "kernels": len(intervals)}


def tensor_core_share(entries: list[Any]) -> dict[str, Any]:
    """Of the recorded reduced-precision keys, how many have a tensor-core configuration first."""
    low = [e for e in entries if e.key.dtype in ("float16", "bfloat16")]
    tc = [e for e in low if "TENSOR_CORE" in e.best.numerical_notes]
    return {"reduced_precision_entries": len(low), "tensor_core_best": len(tc),
            "share": len(tc) / len(low) if low else None}

# ---- one scenario, in its own process ---------------------------------------------------------


def worker(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())  # an index: set_per_process_memory_fraction needs one
    if args.memory_limit_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_limit_gib * 2**30 / total), device)
    torch.backends.cudnn.benchmark = args.scenario == "benchmark"
    batch = args.new_batch if args.scenario == "record-new-batch" else args.batch
    autocast = getattr(torch, args.autocast) if args.autocast != "none" else None
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
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            out = model(x)
        loss_fn(out.float(), y).backward()
        opt.step()

    torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    step(batch)
    torch.cuda.synchronize(device)
    first_step_s = time.perf_counter() - t0  # model construction included
    first_step_only_s = time.perf_counter() - t1
    for _ in range(2):  # start-up: the first steps, where cudnn.benchmark profiles
        step(batch)
    torch.cuda.synchronize(device)
    startup_alloc = torch.cuda.max_memory_allocated(device)
    startup_reserved = torch.cuda.max_memory_reserved(device)
    startup_stats = profile.stats() if profile is not None else None

    # Steady steps, each timed on the GPU with CUDA events; the median is the figure.
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(batch)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    steady_alloc = torch.cuda.max_memory_allocated(device)
    steady_stats = profile.stats() if profile is not None else None

    prof_summary: dict[str, Any] = {}
    if args.profile_steps:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profile_steps):
                step(batch)
            torch.cuda.synchronize(device)
        prof_summary = profiler_summary(prof, args.profile_steps)

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
    lo, hi = batch, None
    while args.headroom and hi is None and lo * 2 <= args.max_batch:
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

    result = {"model": args.model, "scenario": args.scenario, "batch": batch, "autocast": args.autocast,
              "startup_peak_allocated_mib": startup_alloc / 2**20, "startup_peak_reserved_mib": startup_reserved / 2**20,
              "steady_peak_allocated_mib": steady_alloc / 2**20,
              "time_to_first_step_s": first_step_s, "first_step_only_s": first_step_only_s,
              "steady_step_ms": 1000 * statistics.median(times), "steady_step_ms_min": 1000 * min(times),
              "steady_step_ms_events": [1000 * t for t in times], **prof_summary}
    if args.headroom:
        result.update(max_batch=lo, max_batch_capped=hi is None, headroom_batches_tried=tried,
                      headroom_search_s=headroom_s)
    if profile is not None:
        stats = profile.stats()
        entries = profile.entries()
        # Steady steps must be plan-cache hits only: no profile, no build, one execute per call.
        steady = {k: steady_stats[k] - startup_stats[k] for k in steady_stats}
        result.update(profiles=stats["profiles"], startup_profiles=startup_stats["profiles"], calls=stats["calls"],
                      record_hits=stats["record_hits"], plan_hits=stats["plan_hits"],
                      plan_builds=stats["plan_builds"], heuristic_runs=stats["heuristic_runs"],
                      fallbacks=stats["fallbacks"], failures=stats["failures"], record_entries=len(entries),
                      steady_counters=steady, tensor_cores=tensor_core_share(entries))
        profile.disable()
    return result


# ---- driver ------------------------------------------------------------------------------------


def run_scenario(args: argparse.Namespace, model: str, scenario: str, record: str, timeout: float,
                 autocast: str = "none") -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--scenario", scenario,
           "--record", record, "--batch", str(args.batch), "--new-batch", str(args.new_batch), "--steps", str(args.steps),
           "--profile-steps", str(args.profile_steps), "--dtype", args.dtype, "--autocast", autocast,
           "--max-batch", str(args.max_batch), "--memory-limit-gib", str(args.memory_limit_gib),
           "--headroom-precision", str(args.headroom_precision)]
    if args.headroom:
        cmd.append("--headroom")
    if args.workspace_cap:
        cmd += ["--workspace-cap", args.workspace_cap]
    if args.channels_last:
        cmd.append("--channels-last")
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "scenario": scenario, "autocast": autocast, "error": [f"timed out after {timeout:.0f} s"]}
    wall = time.perf_counter() - t
    # Warnings (fallbacks, ...) go to stderr; keep their tail for the report.
    tail = proc.stderr.strip().splitlines()[-20:]
    if proc.returncode != 0:
        return {"model": model, "scenario": scenario, "autocast": autocast, "error": tail or ["failed"],
                "process_s": wall}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    if tail:
        result["stderr_tail"] = tail
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    cols = [("model", "model", "{}"), ("scenario", "scenario", "{}"), ("startup_peak_allocated_mib", "peak alloc MiB", "{:.0f}"),
            ("startup_peak_reserved_mib", "peak reserved MiB", "{:.0f}"),
            ("steady_peak_allocated_mib", "steady alloc MiB", "{:.0f}"), ("time_to_first_step_s", "first step s", "{:.2f}"),
            ("steady_step_ms", "step ms", "{:.2f}"), ("conv_cpu_us_per_call", "conv host us/call", "{:.1f}"),
            ("gpu_busy_ms_per_step", "GPU busy ms/step", "{:.2f}"), ("max_batch", "max batch", "{}"),
            ("profiles", "profiles", "{}"), ("plan_builds", "plan builds", "{}")]
    rows = [[h for _, h, _ in cols]]
    for r in results:
        if "error" in r:
            rows.append([r["model"], r["scenario"], "error: " + " ".join(r["error"])] + [""] * (len(cols) - 3))
            continue
        row = [fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in cols]
        if r.get("autocast", "none") != "none":
            row[1] += f" ({r['autocast']} autocast)"
        if r.get("max_batch_capped"):
            row[[k for k, _, _ in cols].index("max_batch")] += "+"
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def check_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 17's targets, per model, from the scenarios that ran."""
    out: list[dict[str, Any]] = []
    by = {(r["model"], r["scenario"], r.get("autocast", "none")): r for r in results if "error" not in r}
    for model in sorted({m for m, _, _ in by}):
        bench, warm = by.get((model, "benchmark", "none")), by.get((model, "record-warm", "none"))
        if bench and warm:
            ratio = warm["steady_step_ms"] / bench["steady_step_ms"]
            out.append({"model": model, "name": "steady step within 3% of cudnn.benchmark", "met": ratio <= 1.03,
                        "detail": f"{warm['steady_step_ms']:.2f} ms vs {bench['steady_step_ms']:.2f} ms ({ratio:.3f}x)"})
            first = warm["first_step_only_s"] / bench["first_step_only_s"]
            out.append({"model": model, "name": "warm first step <= 1/10 of cudnn.benchmark's", "met": first <= 0.1,
                        "detail": f"{warm['first_step_only_s']:.2f} s vs {bench['first_step_only_s']:.2f} s ({first:.3f}x)"})
        if warm:
            peak = warm["startup_peak_allocated_mib"] / warm["steady_peak_allocated_mib"]
            out.append({"model": model, "name": "warm start-up peak <= 1.05x steady peak", "met": peak <= 1.05,
                        "detail": f"{warm['startup_peak_allocated_mib']:.0f} / {warm['steady_peak_allocated_mib']:.0f} MiB "
                                  f"({peak:.3f}x)"})
            steady = warm.get("steady_counters", {})
            out.append({"model": model, "name": "warm steady steps: plan hits only", "met":
                        steady.get("profiles") == 0 and steady.get("plan_builds") == 0 and
                        steady.get("plan_hits") == steady.get("calls"), "detail": json.dumps(steady)})
        new = by.get((model, "record-new-batch", "none"))
        if new:
            out.append({"model": model, "name": "new batch size profiles nothing", "met": new.get("profiles") == 0,
                        "detail": f"profiles {new.get('profiles')}, plan builds {new.get('plan_builds')}, first step "
                                  f"{new['first_step_only_s']:.2f} s"})
    for (model, _, autocast), r in by.items():
        if autocast != "none":
            tc = r.get("tensor_cores", {})
            out.append({"model": model, "name": f"{autocast} autocast uses tensor cores",
                        "met": bool(tc.get("reduced_precision_entries")) and tc.get("share") == 1.0,
                        "detail": json.dumps(tc)})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50,inception", help="comma list of: " + ", ".join(MODELS))
    p.add_argument("--batch", type=int, default=32, help="training batch size (default 32)")
    p.add_argument("--steps", type=int, default=20, help="steady-state steps timed with CUDA events (default 20)")
    p.add_argument("--new-batch", type=int, default=48, help="batch of the record-new-batch scenario (default 48)")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="steps under torch.profiler for host time per conv call and GPU-busy time (default 5; 0 = none)")
    p.add_argument("--autocast", choices=("none", "bfloat16", "float16"), default="none", help=argparse.SUPPRESS)
    p.add_argument("--autocast-run", action="store_true",
                   help="add one resnet50 process under bfloat16 autocast with a fresh record (tensor cores)")
    p.add_argument("--headroom", action="store_true", help="search the largest batch a step reaches (slow)")
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
        print("gpu_profile_record: skipped: this benchmark needs a CUDA GPU; torch.cuda.is_available() is False "
              f"(torch {torch.__version__}). Run it on the GPU machine.", file=sys.stderr)
        return 0
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    from terra_torch import _C

    if not _C.profile.with_cuda:
        print("gpu_profile_record: skipped: terra_torch._C was built without CUDA/cuDNN; rebuild it on this "
              "machine (pip install -e . --no-build-isolation).", file=sys.stderr)
        return 0
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
        runs = [(model, scenario, "none") for model in models for scenario in scenarios]
        if args.autocast_run:
            runs += [("resnet50", "record-empty", "bfloat16")]
        for model, scenario, autocast in runs:
            record = os.path.join(record_dir, f"{model}{'-' + autocast if autocast != 'none' else ''}-record.json")
            if scenario == "record-empty" and os.path.exists(record):  # record-empty starts without a file
                os.remove(record)
            timeout: float = args.timeout
            if args.time_budget:
                timeout = min(timeout, args.time_budget - (time.perf_counter() - start))
            if timeout < 20:
                results.append({"model": model, "scenario": scenario, "autocast": autocast,
                                "error": ["skipped: time budget spent"]})
                continue
            label = f"[{model}] {scenario}" + (f" ({autocast} autocast)" if autocast != "none" else "")
            print(f"{label} ...", file=sys.stderr, flush=True)
            results.append(run_scenario(args, model, scenario, record, timeout, autocast))
            r = results[-1]
            print(f"{label}: " + ("error " + " | ".join(r["error"][-3:]) if "error" in r else
                  f"peak {r['startup_peak_allocated_mib']:.0f} MiB, first step {r['time_to_first_step_s']:.2f} s, "
                  f"step {r['steady_step_ms']:.2f} ms"), file=sys.stderr, flush=True)
            doc["targets"] = check_targets(results)
            save()
    print_table(results)
    doc["targets"] = check_targets(results)
    for t in doc["targets"]:
        print(f"target {t['model']:10s} {t['name']:40s} {'met' if t['met'] else 'MISSED'}: {t['detail']}")
    save()
    print(f"\nwritten {args.out}", file=sys.stderr)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
