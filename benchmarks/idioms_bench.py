"""Training loops written the way people write them, eager against terra, bitwise.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.idioms_bench [--reps 5] [--steps 300] [--only NAME ...]

Each idiom is a small program around one habit of real training scripts:

- autocast_bf16:   `torch.autocast("cpu", dtype=torch.bfloat16)` around the forward, AdamW
- grad_accum:      gradient accumulation, `loss / 4` and a step every fourth micro-batch
- warmup_clip:     AdamW under a LambdaLR warm-up then linear decay, `clip_grad_norm_` every step
- dataloader:      `DataLoader(TensorDataset, batch_size=32, shuffle=True)`, epochs of 8 batches
- transformer_enc: `nn.TransformerEncoder` (2 layers, dropout 0.1), Adam, MSE
- ema_mixup:       mixup with numpy's Beta draws and `torch.randperm`, an EMA of the weights with
                   `torch._foreach_lerp_`
- acc_item:        label smoothing, accuracy by `(out.argmax(1) == y).sum().item()` every step
- packed_gru:      Embedding + GRU over `pack_padded_sequence` (variable lengths), Adam
- get_batch:       nanoGPT's batch function (indices from `torch.randint`, 2 x 8 slices of a token
                   tensor stacked) before a small language model, AdamW
- get_batch_outside: the same with the batch function in `terra_torch.outside_program()`

Cells, in turns, each in its own process (`--reps` times): eager and terra (`terra_torch.wrap`,
speed check off). Per cell the median of steady-state ms per step (the last two thirds of
`--steps`), the ratio eager / terra, whether terra's losses and parameters equal eager's bit for
bit (a digest of both), terra's iterations by phase and its fallbacks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

from benchmarks.harness.interleaved import run_rounds

IDIOMS = ("autocast_bf16", "grad_accum", "warmup_clip", "dataloader", "transformer_enc", "ema_mixup", "acc_item",
          "packed_gru", "get_batch", "get_batch_outside")


def _programs() -> dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any], int], Any]]]:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                             nn.Linear(64, 4))

    def batches(n: int = 8, b: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(b, 32, generator=g), torch.randint(0, 4, (b,), generator=g)) for _ in range(n)]

    def adamw() -> dict[str, Any]:
        m = mlp()
        return dict(model=m, params=list(m.parameters()), opt=torch.optim.AdamW(m.parameters(), lr=1e-3),
                    data=batches())

    def autocast_step(st: dict[str, Any], i: int) -> Any:
        x, y = st["data"][i % 8]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(st["model"](x), y)
        st["opt"].zero_grad()
        loss.backward()
        st["opt"].step()
        return loss.detach()

    def accumulate_step(st: dict[str, Any], i: int) -> Any:
        x, y = st["data"][i % 8]
        loss = F.cross_entropy(st["model"](x), y) / 4
        loss.backward()
        if i % 4 == 3:
            st["opt"].step()
            st["opt"].zero_grad()
        return loss.detach()

    def scheduled() -> dict[str, Any]:
        st = adamw()
        st["opt"] = torch.optim.AdamW(st["params"], lr=1e-3, weight_decay=0.01)
        st["sched"] = torch.optim.lr_scheduler.LambdaLR(st["opt"],
                                                        lambda s: min(1.0, (s + 1) / 10) * max(0.0, 1 - s / 400))
        return st

    def clip_step(st: dict[str, Any], i: int) -> Any:
        x, y = st["data"][i % 8]
        loss = F.cross_entropy(st["model"](x), y)
        st["opt"].zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(st["params"], 1.0)
        st["opt"].step()
        st["sched"].step()
        return loss.detach()

    def loader() -> dict[str, Any]:
        m = mlp()
        g = torch.Generator().manual_seed(3)
        ds = torch.utils.data.TensorDataset(torch.randn(256, 32, generator=g), torch.randint(0, 4, (256,), generator=g))
        dl = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(5))
        return dict(model=m, params=list(m.parameters()),
                    opt=torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), loader=dl, it=None)

    def loader_step(st: dict[str, Any], i: int) -> Any:
        if st["it"] is None:
            st["it"] = iter(st["loader"])
        try:
            x, y = next(st["it"])
        except StopIteration:
            st["it"] = iter(st["loader"])
            x, y = next(st["it"])
        loss = F.cross_entropy(st["model"](x), y)
        st["opt"].zero_grad()
        loss.backward()
        st["opt"].step()
        return loss.detach()

    def encoder() -> dict[str, Any]:
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
        m = nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False))
        g = torch.Generator().manual_seed(1)
        d = [(torch.randn(4, 10, 32, generator=g), torch.randn(4, 10, 32, generator=g)) for _ in range(6)]
        return dict(model=m, params=list(m.parameters()), opt=torch.optim.Adam(m.parameters(), lr=1e-3), data=d)

    def encoder_step(st: dict[str, Any], i: int) -> Any:
        x, y = st["data"][i % 6]
        loss = F.mse_loss(st["model"](x), y)
        st["opt"].zero_grad()
        loss.backward()
        st["opt"].step()
        return loss.detach()

    def mixup() -> dict[str, Any]:
        st = adamw()
        st["ema"] = [p.detach().clone() for p in st["params"]]
        st["rng"] = np.random.default_rng(0)
        return st

    def mixup_step(st: dict[str, Any], i: int) -> Any:
        x, y = st["data"][i % 8]
        lam = float(st["rng"].beta(0.4, 0.4))
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(i))
        out = st["model"](lam * x + (1 - lam) * x[perm])
        loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
        st["opt"].zero_grad()
        loss.backward()
        st["opt"].step()
        with torch.no_grad():
            torch._foreach_lerp_(st["ema"], [p.detach() for p in st["params"]], 0.001)
        return loss.detach()

    def accuracy_step(st: dict[str, Any], i: int) -> Any:
        x, y = st["data"][i % 8]
        out = st["model"](x)
        loss = F.cross_entropy(out, y, label_smoothing=0.1)
        st["opt"].zero_grad()
        loss.backward()
        st["opt"].step()
        return loss.item() + (out.argmax(1) == y).sum().item() / y.numel()

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.rnn, self.out = nn.Embedding(50, 16), nn.GRU(16, 32, batch_first=True), nn.Linear(32, 3)

        def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
            return self.out(self.rnn(packed)[1][-1])

    def tagger() -> dict[str, Any]:
        m = Tagger()
        g = torch.Generator().manual_seed(2)
        d = [(torch.randint(1, 50, (8, 12), generator=g), torch.randint(3, 12, (8,), generator=g),
              torch.randint(0, 3, (8,), generator=g)) for _ in range(6)]
        return dict(model=m, params=list(m.parameters()), opt=torch.optim.Adam(m.parameters(), lr=1e-3), data=d)

    def tagger_step(st: dict[str, Any], i: int) -> Any:
        ids, lengths, y = st["data"][i % 6]
        loss = F.cross_entropy(st["model"](ids, lengths), y)
        st["opt"].zero_grad()
        loss.backward()
        st["opt"].step()
        return loss.detach()

    def tokens() -> dict[str, Any]:
        m = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
        return dict(model=m, params=list(m.parameters()), opt=torch.optim.AdamW(m.parameters(), lr=1e-3),
                    data=torch.randint(0, 64, (5000,), generator=torch.Generator().manual_seed(1)))

    def get_batch(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - 17, (8,))
        return torch.stack([data[i:i + 16] for i in ix]), torch.stack([data[i + 1:i + 17] for i in ix])

    def tokens_step(st: dict[str, Any], i: int, outside: bool = False) -> Any:
        if outside:
            import terra_torch

            with terra_torch.outside_program():
                x, y = get_batch(st["data"])
        else:
            x, y = get_batch(st["data"])
        loss = F.cross_entropy(st["model"](x).view(-1, 64), y.view(-1))
        st["opt"].zero_grad(set_to_none=True)
        loss.backward()
        st["opt"].step()
        return loss.detach()

    return {"get_batch": (tokens, tokens_step),
            "get_batch_outside": (tokens, lambda st, i: tokens_step(st, i, outside=True)),
            "autocast_bf16": (adamw, autocast_step), "grad_accum": (adamw, accumulate_step),
            "warmup_clip": (scheduled, clip_step), "dataloader": (loader, loader_step),
            "transformer_enc": (encoder, encoder_step), "ema_mixup": (mixup, mixup_step),
            "acc_item": (adamw, accuracy_step), "packed_gru": (tagger, tagger_step)}


def _worker(idiom: str, terra: bool, steps: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    if terra:
        import terra_torch
    build, step = _programs()[idiom]
    torch.manual_seed(0)
    st = build()
    if terra:
        st["model"] = terra_torch.wrap(st["model"], speed_check=False)
    losses = []
    start = 0.0
    for i in range(steps):
        if i == steps // 3:
            start = time.perf_counter()
        losses.append(step(st, i))
    if terra:
        terra_torch.synchronize()
    seconds = time.perf_counter() - start
    digest = hashlib.sha256()
    for v in losses:
        digest.update(repr(float(v)).encode())
    for p in st["params"]:
        digest.update(p.detach().contiguous().numpy().tobytes())
    out: dict[str, Any] = {"ms_per_step": seconds / (steps - steps // 3) * 1e3, "digest": digest.hexdigest()}
    if terra:
        s = terra_torch.stats(st["model"])
        out["iterations"], out["fallbacks"] = dict(s.iterations), s.fallbacks
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--only", nargs="*", default=list(IDIOMS))
    p.add_argument("--worker", nargs=3, metavar=("IDIOM", "MODE", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        idiom, mode, steps = args.worker
        print(json.dumps(_worker(idiom, mode == "terra", int(steps))))
        return 0
    print(f"uptime before: {os.getloadavg()}")
    print(f"{'idiom':16s} {'eager ms':>9s} {'terra ms':>9s} {'x eager':>8s}  bitwise  terra iterations, fallbacks")
    for idiom in args.only:
        cells = run_rounds("benchmarks.idioms_bench", idiom, [("eager", "eager", {}), ("terra", "terra", {})],
                           args.reps, args.steps)
        eager = statistics.median(r["ms_per_step"] for r in cells["eager"])
        terra = statistics.median(r["ms_per_step"] for r in cells["terra"])
        bitwise = {r["digest"] for r in cells["eager"]} == {r["digest"] for r in cells["terra"]}
        last = cells["terra"][-1]
        print(f"{idiom:16s} {eager:9.3f} {terra:9.3f} {eager / terra:7.2f}x  {str(bitwise):7s}  "
              f"{last['iterations']}, {last['fallbacks']}", flush=True)
    print(f"uptime after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
