"""A DataLoader's work in a co-executed training loop runs outside the program.

Under `terra_torch.wrap` the region spans the training loop's body, so `next(loader_iter)` runs
inside it: a map-style dataset indexes its tensors per sample and the collate function stacks
them. Recorded, those ops took the per-op path and made the graph assemble every batch one op at
a time from fed indices (an MLP over a shuffled TensorDataset co-executed at 0.54x eager). The
stand-ins here run `DataLoader.__iter__` and each iterator's `__next__` in an
`_C.outside_program()` block: an op in it runs for real where Python issues it, unrecorded, where
nothing the graph owes can reach it, and is recorded as before otherwise (a draw from the default
generator, a read of a parameter or of a value of the program: csrc/capture/outside_program.h).
Outside a co-executed or traced iteration the block changes nothing (interception is off there).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch.utils.data
import torch.utils.data.dataloader

from terra_torch import _C

_installed = False


@contextlib.contextmanager
def outside_program() -> Iterator[None]:
    """Runs a block of a training loop's body as code outside the program, the way terra_torch
    runs a DataLoader's `__next__`: for a loader of your own (indexing tensors you hold, stacking
    samples) inside a loop under `terra_torch.wrap`.

        for step in range(steps):
            with terra_torch.outside_program():
                x, y = my_batches.next_batch()
            loss = loss_fn(model(x), y)
            ...

    Each op in the block runs for real where Python issues it, unrecorded, when nothing the graph
    owes can reach it: its tensors are real and none shares memory with a tensor the program's
    ops have written, it writes only tensors made in the block, and it draws no random numbers
    from the default generator. Any other op stays the program's (recorded, computed by the
    graph, in program order), so the numbers are eager's either way
    (csrc/capture/outside_program.h). Outside a co-executed or traced iteration it changes
    nothing."""
    with _C.outside_program():
        yield


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
