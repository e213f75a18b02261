"""Python-level reads of tensor data that no aten op sees.

`t.numpy()`, `t.tolist()`, `np.asarray(t)` and pickling read a tensor's memory directly, not
through the dispatcher, so the PythonRunner never hears of them. These wrappers give a
placeholder its value first (and, for a real tensor the graph may update in place, wait for the
graph to catch up with Python) while a co-executed iteration is open; otherwise they cost one
attribute check.

torch implements some of these reads with internal ops (numpy() detaches first); they are no
ops of the user's program, so they run with interception suspended in every phase, which keeps
traced and co-executed iterations alike.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch

from terra_torch import _C, runtime

_READS = ("numpy", "tolist", "__array__", "__reduce_ex__", "__dlpack__", "data_ptr", "untyped_storage")
# Reads that hand Python the memory itself: writes through the array are no ops, so the runtime
# treats that memory as memory torch did not allocate from then on (runtime/feed_snapshot.h).
_EXPORTS = frozenset({"numpy", "__array__", "__dlpack__"})
_installed = False


def _array_holder(tensor: torch.Tensor, out: Any) -> torch.Tensor:
    """The tensor whose life bounds the array's hold on `tensor`'s memory: the array's base,
    which torch sets to the tensor it made the array from (torch/csrc/utils/tensor_numpy.cpp),
    or `tensor` itself (a DLPack capsule, an array numpy copied)."""
    base = getattr(out, "base", None)
    return base if isinstance(base, torch.Tensor) else tensor


def _reading(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    exports = name in _EXPORTS

    @functools.wraps(original)
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _C.runtime.direct_pending():
            # A deferred Dynamo-backend graph may still be writing this tensor; no op announces
            # this read, so the op-level wait (docs/DYNAMO_BACKEND.md, "Overlap") cannot see it.
            _C.runtime.wait_direct()
        program = runtime.active()
        if program is None or program._region_phase != "coexec":
            if _C.is_placeholder(self):  # no runtime can give it a value here
                raise RuntimeError(_C.placeholder_error(self))
            if program is None:
                out = original(self, *args, **kwargs)
                if exports:
                    _C.runtime.note_exported_memory(_array_holder(self, out))
                return out
        if program._region_phase == "coexec" and not (
                _C.outside_program_active() and program._region is not None and program._region.outside_tensor(self)):
            # (a DataLoader's sample, outside the program: memory the graph never writes)
            program.materialize(self)
        with _C.suspended():
            out = original(self, *args, **kwargs)
        if exports:
            _C.runtime.note_exported_memory(_array_holder(self, out))
            region = program._region
            if region is not None:
                # Python may write the array before the iteration's next op reads the tensor
                # (label smoothing through `t.numpy()[...] *= 0.5`): that read takes the memory,
                # not the value the region knew (the graph's, or the one fed before).
                region.note_memory_exported(self)
        return out

    read._terra_original = original  # type: ignore[attr-defined]
    return read


def install() -> None:
    global _installed
    if _installed:
        return
    if "torch._dynamo" in sys.modules:
        # Dynamo already ran in this process: code it generated calls Tensor.numpy, which is
        # about to become Python; traced into, the wrapper recurses (docs/DYNAMO_BACKEND.md).
        try:
            sys.modules["torch._dynamo"].trace_rules.add("terra_torch")
        except Exception:  # noqa: BLE001 - a private Dynamo API; without it only that case breaks
            pass
    for name in _READS:
        original = getattr(torch.Tensor, name, None)
        if original is not None:
            setattr(torch.Tensor, name, _reading(name, original))
    _installed = True
