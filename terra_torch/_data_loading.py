"""A DataLoader's work in a co-executed training loop runs outside the program.

Under `terra_torch.wrap` the region spans the training loop's body, so `next(loader_iter)` runs
inside it: a map-style dataset indexes its tensors per sample and the collate function stacks
them. Recorded, those ops took the per-op path and made the graph assemble every batch one op at
a time from fed indices (an MLP over a shuffled TensorDataset co-executed at 0.47x eager). The
stand-ins here run `DataLoader.__iter__` and each iterator's `__next__` in an
`_C.outside_program()` block: an op in it runs for real where Python issues it, unrecorded, where
nothing the graph owes can reach it, and is recorded as before otherwise (a draw from the default
generator, a read of a parameter or of a value of the program: csrc/capture/outside_program.h).
Outside a co-executed or traced iteration the block changes nothing (interception is off there).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch.utils.data
import torch.utils.data.dataloader

from terra_torch import _C

_installed = False


def _outside(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _C.outside_program():
            return method(*args, **kwargs)

    call._terra_outside = True  # type: ignore[attr-defined]
    return call


def install() -> None:
    """Idempotent: wraps DataLoader.__iter__ and the iterators' __next__ (every iterator class
    inherits `_BaseDataLoaderIter.__next__`)."""
    global _installed
    if _installed:
        return
    for cls, name in ((torch.utils.data.DataLoader, "__iter__"),
                      (torch.utils.data.dataloader._BaseDataLoaderIter, "__next__")):
        method = cls.__dict__.get(name)
        if method is not None and not getattr(method, "_terra_outside", False):
            setattr(cls, name, _outside(method))
    _installed = True
