"""backward() in co-execution without the autograd engine (docs/RUNTIME.md, "backward() in
co-execution"; csrc/runtime/backward_replay.h).

torch.autograd.backward and torch.autograd.grad reach the engine through one object,
``torch.autograd.variable.Variable._execution_engine`` (torch/autograd/graph.py,
``_engine_run_backward``). `install()` puts a stand-in there that, while a co-executed iteration is
open, asks the program's runtime first: a backward it has recorded before is replayed (its posts go
to the graph, the leaves get their ``.grad``) and the engine does not run; otherwise the engine runs
as always and the runtime records what it did. Outside co-execution the stand-in only forwards.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from torch.autograd.variable import Variable

from terra_torch import _data_parallel, runtime


# TERRA_BACKWARD_REPLAY=0 keeps every backward() on the per-op path (to compare the two).
enabled = os.environ.get("TERRA_BACKWARD_REPLAY", "1") != "0"


class _Engine:
    """Forwards everything to torch's engine; `run_backward` asks the co-executing program first."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def run_backward(self, tensors: Sequence[Any], grad_tensors: Sequence[Any], keep_graph: bool,
                     create_graph: bool, inputs: Sequence[Any] = (), allow_unreachable: bool = False,
                     accumulate_grad: bool = True) -> Any:
        program = runtime.active()
        region = program._region if enabled and program is not None and program.phase == "coexec" else None
        session = None
        path = None
        if region is not None and all(isinstance(t, torch.Tensor) for t in tensors):
            session = program._session
            path = session.backward_begin(region, list(tensors), list(grad_tensors), bool(keep_graph),
                                          bool(create_graph), bool(inputs), bool(accumulate_grad))
        result: Any = ()
        if path != "replayed":
            # One call site for every path: this frame is part of the location of each backward op
            # (docs/LOCATIONS.md), so it must not differ between traced and co-executed iterations.
            completed = False
            try:
                result = self._engine.run_backward(tensors, grad_tensors, keep_graph, create_graph, inputs,
                                                   allow_unreachable, accumulate_grad)
                completed = True
            finally:
                if session is not None:
                    session.backward_end(region, completed)
        if accumulate_grad and not inputs:
            # terra_torch.wrap(DDP(model)) reduces gradients here, whichever path ran (one call
            # site: the location of its ops must not depend on the path).
            _data_parallel.after_backward(tensors)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def install() -> None:
    """Idempotent: the stand-in replaces torch's engine object once."""
    if not isinstance(Variable._execution_engine, _Engine):
        Variable._execution_engine = _Engine(Variable._execution_engine)
