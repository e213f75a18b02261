"""The Python a replayed optimizer step runs every step: the stand-in's key (terra_torch/_optimizer/).

A replayed step still computes, in Python, the key that says whether a recorded step stands for
this one (hyperparameters by value, per parameter its gradient and state). It runs once per
parameter every step, so its cost grows with the model: this times it with `timeit` for an
optimizer over N parameters with gradients and state, outside co-execution (the key does not
depend on it; the numbers Adam, Adamax and NAdam compute from known step counters are not included,
and RAdam, whose key needs the counters, is not timed).

    python -m benchmarks.step_key_bench --params 6,100 [--number 2000]

To compare with another build, run it from that checkout too (PYTHONPATH=<checkout>), in turns.
"""

from __future__ import annotations

import argparse
import timeit

import torch
from torch import nn

from terra_torch._optimizer.adagrad import adagrad_key
from terra_torch._optimizer.adam_family import adam_key, nadam_key
from terra_torch._optimizer.clip import clip_key
from terra_torch._optimizer.lr_passed import rmsprop_key, rprop_key, sgd_key

OPTIMIZERS = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), sgd_key),
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-3), adam_key),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=1e-2), adagrad_key),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps, lr=1e-3), rmsprop_key),
    "nadam": (lambda ps: torch.optim.NAdam(ps, lr=2e-3), nadam_key),
    "rprop": (lambda ps: torch.optim.Rprop(ps, lr=1e-2), rprop_key),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="6,100", help="parameter counts, comma-separated")
    p.add_argument("--number", type=int, default=2000, help="calls per measurement (best of 5)")
    args = p.parse_args(argv)
    for n in (int(v) for v in args.params.split(",")):
        params = [nn.Parameter(torch.randn(8, 8)) for _ in range(n)]
        for q in params:
            q.grad = torch.randn(8, 8)
        for name, (make, key_of) in OPTIMIZERS.items():
            opt = make(params)
            opt.step()  # (the state the key reads)
            assert key_of((opt,), {})[2] is not None, name
            best = min(timeit.repeat(lambda: key_of((opt,), {}), number=args.number, repeat=5))
            print(f"{name:8s} {n:4d} parameters: {1e6 * best / args.number:7.2f} us per key")
        best = min(timeit.repeat(lambda: clip_key((params, 1.0), {}), number=args.number, repeat=5))
        print(f"{'clip':8s} {n:4d} parameters: {1e6 * best / args.number:7.2f} us per key")


if __name__ == "__main__":
    main()
