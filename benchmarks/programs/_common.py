"""Small helpers the programs share: synthetic data pools and a final-state digest.

Kept tiny on purpose: each program should still read like a user's own training script. Data
comes from a private torch.Generator (never the global RNG), so drawing it does not shift the
random stream a program's own torch.randn calls see, and every runner sees identical data.
"""

from __future__ import annotations

from typing import Iterable

import torch


def data_generator(seed: int) -> torch.Generator:
    """A CPU generator for synthetic data, separate from the global RNG."""
    return torch.Generator().manual_seed(10_000 + seed)


def param_digest(modules: Iterable[torch.nn.Module]) -> list[float]:
    """Sum and sum of squares of every parameter and buffer: a cheap final-state fingerprint."""
    values: list[float] = []
    for module in modules:
        tensors = [t.detach().to("cpu", torch.float64) for t in module.state_dict().values()]
        values.append(float(sum(t.sum() for t in tensors)))
        values.append(float(sum(t.square().sum() for t in tensors)))
    return values
