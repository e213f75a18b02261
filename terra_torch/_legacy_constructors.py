"""`Tensor.new` and `Tensor.new_tensor` on a placeholder.

torch's legacy constructors take the device from the tensor's highest backend dispatch key
(torch/csrc/utils/tensor_new.cpp, `legacy_tensor_new` and `new_tensor`, called from
torch/csrc/autograd/python_variable_methods.cpp). A placeholder's highest backend key is terra's
own (PrivateUse3), which names no device, so they raised "DispatchKey PrivateUse3 doesn't
correspond to a device". torch.distributions' Exponential, Cauchy, Laplace, Geometric and
Multinomial sample through `rate.new(shape)`, and older models make hidden states with
`h.new(B, H).zero_()`.

Their result depends on the tensor's dtype and device only, never on its values, so on a
placeholder the call goes to a real empty tensor of that dtype and device (made once, with
interception suspended: it is no op of the program). The constructor's own ops (`empty`,
`lift_fresh`) are intercepted as they are for a real tensor, so traced and co-executed
iterations record the same ops. Elsewhere the wrapper costs one check.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from terra_torch import _C

_CONSTRUCTORS = ("new", "new_tensor")
_stand_ins: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    key = (t.dtype, t.device)
    real = _stand_ins.get(key)
    if real is None:
        with _C.suspended():
            real = _stand_ins[key] = torch.empty(0, dtype=t.dtype, device=t.device)
    return real


def _constructor(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def construct(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _C.is_placeholder(self):
            self = _stand_in(self)
        return original(self, *args, **kwargs)

    construct._terra_original = original  # type: ignore[attr-defined]
    return construct


def install() -> None:
    """Wrap each constructor once (a wrapped one is left as it is)."""
    for name in _CONSTRUCTORS:
        original = getattr(torch.Tensor, name)
        if not hasattr(original, "_terra_original"):
            setattr(torch.Tensor, name, _constructor(original))
