"""What a benchmark program sees of the harness: a device and a `wrap` call.

A program is written the way a user writes a training loop. The only harness-specific line is
the one a user would add to adopt a tool, `model = rt.wrap(model, example_inputs)`, which each
runner implements in its own way (torch.compile, torch.jit.trace, terra_torch.wrap, identity).
This module also defines the program contract and loads program modules by name.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

PROGRAM_PACKAGE = "benchmarks.programs"


class WrapHook(Protocol):
    """The runner side of `Runtime.wrap`: returns what the program will call instead of model."""

    def __call__(self, model: Any, example_inputs: tuple[Any, ...]) -> Any: ...


@dataclass
class Runtime:
    """Handed to `program.build(seed, rt)`.

    device: where the program puts its model and data ("cpu", or "lazy" for LazyTensor).
    wrap(model, example_inputs): the one line a user adds; example_inputs are real inputs of the
        first call, which torch.jit.trace needs (other runners ignore them).
    """

    device: str
    wrap_hook: WrapHook
    wrap_seconds: float = 0.0
    wrapped: list[str] = field(default_factory=list)

    def wrap(self, model: Any, example_inputs: tuple[Any, ...] = ()) -> Any:
        """Adopt the runner's tool for `model`; time spent here is reported as wrap time."""
        start = time.perf_counter()
        try:
            return self.wrap_hook(model, tuple(example_inputs))
        finally:
            self.wrap_seconds += time.perf_counter() - start
            self.wrapped.append(type(model).__name__)


REQUIRED = ("DESCRIPTION", "FEATURES", "STEPS_PER_REP", "build", "step")


def load_program(name: str) -> ModuleType:
    """Import benchmarks.programs.<name> and check that it follows the program contract.

    Contract (module level):
      DESCRIPTION: str, FEATURES: tuple[str, ...], STEPS_PER_REP: int,
      QUICK_STEPS_PER_REP: int (optional, defaults to STEPS_PER_REP),
      build(seed: int, rt: Runtime) -> state,
      step(state, i: int) -> loss (0-d tensor or float; read only after the timed region),
      digest(state) -> list[float] (optional: final-state summary compared against eager),
      UNAVAILABLE: str | None (optional: why the program cannot run here, e.g. a missing
        optional package; the harness then skips it with that reason).
    """
    module = importlib.import_module(f"{PROGRAM_PACKAGE}.{name}")
    missing = [attr for attr in REQUIRED if not hasattr(module, attr)]
    if missing:
        raise TypeError(f"program {name} lacks {', '.join(missing)}")
    return module
