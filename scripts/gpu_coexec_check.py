"""Co-execution on CUDA (docs/RUNTIME.md, "Streams"): a small MLP and a small CNN train 30 steps
eagerly and under terra_torch.wrap from the same seed, on the default stream and on a side stream
the user made current; the logged losses and the final parameters must match, the program must
have co-executed, and the graph must have run on a pool stream (not the default stream, not the
user's stream).

    python scripts/gpu_coexec_check.py [OUT.json]      # prints "no CUDA, skipped" without a GPU

Tolerance: losses and parameters are compared bitwise first; where they differ, they must agree
within rtol 1e-5 / atol 1e-6 (cuBLAS may choose another algorithm per stream), and the report
says which. Exit status 0 when every case passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 30
RTOL, ATOL = 1e-5, 1e-6


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 1))


def dataset(kind: str, dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000)
    shape = (16, 32) if kind == "mlp" else (16, 3, 16, 16)
    return [(torch.randn(shape, generator=g).to(dev), torch.randn(16, 1, generator=g).to(dev)) for _ in range(5)]


def train(kind: str, terra: bool, side_stream: bool, dev: torch.device) -> dict:
    import terra_torch

    torch.manual_seed(0)
    model = (mlp() if kind == "mlp" else cnn()).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if terra:
        model = terra_torch.wrap(model)
    data = dataset(kind, dev)
    stream = torch.cuda.Stream() if side_stream else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())  # the data was made on the default stream
    losses = []
    info: dict = {}
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        user_stream_id = torch.cuda.current_stream().stream_id
        for i in range(STEPS):
            x, y = data[i % len(data)]
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if terra:
            terra_torch.synchronize()
            st = terra_torch.stats(model)
            info = {"iterations": dict(st.iterations), "fallbacks": st.fallbacks,
                    "graph_stream_id": st.runner.get("graph_stream_id", 0),
                    "graph_stream_device": st.runner.get("graph_stream_device", ""),
                    "user_stream_id": user_stream_id,
                    "default_stream_id": torch.cuda.default_stream().stream_id}
            terra_torch.unwrap(model)
        params = [p.detach().clone() for p in model.parameters()]
    torch.cuda.synchronize()
    return {"losses": losses, "params": params, "info": info}


def compare(eager: dict, terra: dict) -> dict:
    le, lt = torch.tensor(eager["losses"], dtype=torch.float64), torch.tensor(terra["losses"], dtype=torch.float64)
    bitwise = eager["losses"] == terra["losses"] and all(torch.equal(a, b) for a, b in zip(eager["params"], terra["params"]))
    close = torch.allclose(lt, le, rtol=RTOL, atol=ATOL) and all(
        torch.allclose(b, a, rtol=RTOL, atol=ATOL) for a, b in zip(eager["params"], terra["params"]))
    worst = max(float((a - b).abs().max()) for a, b in zip(eager["params"], terra["params"]))
    return {"bitwise": bitwise, "close": close, "max_param_diff": worst,
            "max_loss_diff": float((le - lt).abs().max())}


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA, skipped")
        return 0
    dev = torch.device("cuda")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": STEPS, "cases": []}
    ok = True
    for kind in ("mlp", "cnn"):
        for side in (False, True):
            t0 = time.perf_counter()
            eager = train(kind, terra=False, side_stream=side, dev=dev)
            terra = train(kind, terra=True, side_stream=side, dev=dev)
            cmp = compare(eager, terra)
            info = terra["info"]
            checks = {
                "values match": cmp["close"],
                "co-executed": info["iterations"].get("coexec", 0) > 0,
                "graph on a stream of its own": info["graph_stream_id"] not in (0, info["default_stream_id"],
                                                                              info["user_stream_id"]),
                "graph on the model's device": info["graph_stream_device"] == str(torch.device("cuda", torch.cuda.current_device())),
            }
            good = all(checks.values())
            ok &= good
            case = {"model": kind, "user_stream": "side" if side else "default", "ok": good, "checks": checks, **cmp,
                    **info, "seconds": round(time.perf_counter() - t0, 2)}
            report["cases"].append(case)
            print(f"{kind} on the {case['user_stream']} stream: {'ok' if good else 'FAILED'} "
                  f"({'bitwise' if cmp['bitwise'] else 'within tolerance' if cmp['close'] else 'MISMATCH'}, "
                  f"max param diff {cmp['max_param_diff']:.2e}, coexec iterations {info['iterations'].get('coexec', 0)}, "
                  f"fallbacks {info['fallbacks']}, graph stream {info['graph_stream_id']} on {info['graph_stream_device']}, "
                  f"user stream {info['user_stream_id']})", flush=True)
            if not good:
                print("  failed checks:", [k for k, v in checks.items() if not v], flush=True)
    out = sys.argv[1] if len(sys.argv) > 1 else (os.path.join(os.environ["OUT"], "gpu_coexec_check.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
