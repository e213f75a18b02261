"""Runners: the ways a user can run the same imperative training loop.

A runner decides where the program's tensors live, what `rt.wrap(model, example_inputs)` does,
whether the step function itself is wrapped, and what happens between and after steps. Each is a
small class; RUNNERS maps the command-line name to a factory. Runners import their tools lazily
(inside methods), so importing this module costs only `import torch`.

Adding a runner: subclass Runner, override what differs, and add it with `register_runner`. The
terra_torch runners live in benchmarks/harness/terra.py (registered below); see docs/BENCHMARKS.md.
"""

from __future__ import annotations

import logging
import re
import types
from typing import Any, Callable

import torch

StepFn = Callable[[Any, int], Any]


class RunnerUnavailable(Exception):
    """Raised by a runner once it finds, after the program is built, that it cannot run it (the
    graph-only bound when the graph needs input a replay cannot give): recorded like
    `unavailable_reason`, as "n/a" with the reason, not as a failure of the program."""


class Runner:
    """Eager PyTorch; the base every other runner changes as little as it can."""

    name = "eager"
    device = "cpu"
    note = "plain imperative PyTorch (the reference)"

    def unavailable_reason(self) -> str | None:
        """None when the runner can run here, else a one-line reason recorded in the results."""
        return None

    def setup(self) -> None:
        """Called once per worker process, before the program is built."""

    def bind_program(self, module: types.ModuleType) -> None:
        """Called with the program's module before it is built (its optional settings)."""

    def wrap_model(self, model: Any, example_inputs: tuple[Any, ...]) -> Any:
        """What `rt.wrap(model, example_inputs)` returns."""
        return model

    def wrap_step(self, step: StepFn) -> StepFn:
        """What the harness calls each step instead of `program.step`."""
        return step

    def end_step(self) -> None:
        """Called after every step (LazyTensor cuts its graph here)."""

    def sync(self) -> None:
        """Called at the end of each timed repetition: all queued work must be finished."""

    def settle(self) -> float:
        """Called once after the warm-up repetitions, before the timed ones: a runner whose code
        is still being prepared in the background (compiled segments) waits for it here, so that
        the timed steps measure the prepared code. Returns the seconds it waited."""
        return 0.0

    def stats(self) -> dict[str, Any]:
        """Runner-specific counters (graph breaks, recompiles, lazy compiles, ...)."""
        return {}

    def breakdown(self) -> dict[str, float] | None:
        """Time breakdown (PythonRunner/GraphRunner exec and stall); None = not measured."""
        return None

    def counters(self) -> dict[str, float]:
        """Cumulative numbers (seconds, iteration counts) read before and after the timed
        repetitions; the worker reports their difference, so the first step and warm-up (tracing,
        graph generation) do not blur the steady-state breakdown."""
        return {}


class CompileRunner(Runner):
    """torch.compile(model) with the default Inductor backend: the one-line peer."""

    name = "compile"
    note = "torch.compile(model), backend inductor, default options"

    def __init__(self) -> None:
        self._recompiles = _DynamoLogCounter()

    def setup(self) -> None:
        import torch._dynamo

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        self._recompiles.install()

    def wrap_model(self, model: Any, example_inputs: tuple[Any, ...]) -> Any:
        return torch.compile(model)

    def stats(self) -> dict[str, Any]:
        return {**_dynamo_counters(), **self._recompiles.summary()}


class CompileStepRunner(CompileRunner):
    """torch.compile over the whole step function (forward, backward, optimizer, Python logic)."""

    name = "compile-step"
    note = "torch.compile(step_fn): the training-step body, not only the model"

    def wrap_model(self, model: Any, example_inputs: tuple[Any, ...]) -> Any:
        return model

    def wrap_step(self, step: StepFn) -> StepFn:
        return torch.compile(step)


class TraceRunner(Runner):
    """torch.jit.trace(model, example_inputs): records one run's ops, control flow baked in."""

    name = "jit-trace"
    note = "torch.jit.trace(model, example_inputs, check_trace=False)"

    def wrap_model(self, model: Any, example_inputs: tuple[Any, ...]) -> Any:
        # check_trace=False: the checker would run forward again, repeating its side effects
        # (BatchNorm statistics, Python counters); it finds nothing the comparison with eager
        # below does not.
        return torch.jit.trace(model, example_inputs, check_trace=False)


class ScriptRunner(Runner):
    """torch.jit.script(model): compiles forward from source, in TorchScript's typed subset."""

    name = "jit-script"
    note = "torch.jit.script(model)"

    def wrap_model(self, model: Any, example_inputs: tuple[Any, ...]) -> Any:
        return torch.jit.script(model)


class LazyRunner(Runner):
    """LazyTensor (torch._lazy, TorchScript backend): ops recorded, executed at mark_step."""

    name = "lazy"
    device = "lazy"
    note = "torch._lazy TorchScript backend, device='lazy', mark_step() after every step"

    def unavailable_reason(self) -> str | None:
        try:
            import torch._lazy
            import torch._lazy.ts_backend

            torch._lazy.ts_backend.init()
            probe = (torch.ones(2, device="lazy") * 2).sum()
            torch._lazy.mark_step()
            if float(probe.cpu()) != 4.0:
                return "torch._lazy probe computed a wrong value"
        except Exception as exc:  # any failure here is the reason the column is empty
            return f"torch._lazy unavailable: {type(exc).__name__}: {_first_line(exc)}"
        return None

    def setup(self) -> None:
        import torch._lazy.metrics

        torch._lazy.metrics.reset()

    def end_step(self) -> None:
        import torch._lazy

        torch._lazy.mark_step()

    def sync(self) -> None:
        import torch._lazy

        torch._lazy.mark_step()
        torch._lazy.wait_device_ops()

    def stats(self) -> dict[str, Any]:
        import torch._lazy.metrics as metrics

        wanted = ("UncachedCompile", "CachedCompile", "DeviceDataCacheMiss", "MarkStep")
        present = set(metrics.counter_names())
        return {f"lazy_{name}": int(metrics.counter_value(name)) for name in wanted
                if name in present}


RunnerFactory = Callable[[], Runner]

RUNNERS: dict[str, RunnerFactory] = {}


def register_runner(name: str, factory: RunnerFactory) -> None:
    """Make `--runners name` available."""
    RUNNERS[name] = factory


def make_runner(name: str) -> Runner:
    """A fresh runner for one worker process."""
    if name not in RUNNERS:
        raise KeyError(f"unknown runner {name!r}; known: {', '.join(RUNNERS)}")
    return RUNNERS[name]()


register_runner("eager", Runner)
register_runner("compile", CompileRunner)
register_runner("compile-step", CompileStepRunner)
register_runner("jit-trace", TraceRunner)
register_runner("jit-script", ScriptRunner)
register_runner("lazy", LazyRunner)


def _terra(name: str, mode: str, optimize: bool | str = False) -> RunnerFactory:
    def make() -> Runner:
        from benchmarks.harness.terra import TerraRunner

        return TerraRunner(name, mode, optimize)

    return make


def _graph_only(fused: bool = False) -> RunnerFactory:
    def make() -> Runner:
        from benchmarks.harness.terra import GraphOnlyRunner

        return GraphOnlyRunner(fused)

    return make


register_runner("terra", _terra("terra", "coexec"))
register_runner("terra-lazy", _terra("terra-lazy", "lazy"))
register_runner("terra-graph-only", _graph_only())
# optimize="fused": straight-line stretches compiled by AOTInductor (docs/RUNTIME.md, "Compiled
# segments"); results within a tolerance of eager, like torch.compile's.
register_runner("terra-fused", _terra("terra-fused", "coexec", "fused"))
register_runner("terra-graph-only-fused", _graph_only(fused=True))


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:limit]


def _dynamo_counters() -> dict[str, Any]:
    """Graph breaks and graphs from torch._dynamo.utils.counters (cheap, always on)."""
    from torch._dynamo.utils import counters

    breaks = dict(counters.get("graph_break", {}))
    reasons = sorted(breaks.items(), key=lambda kv: -kv[1])[:5]
    return {
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": [f"{n}x {_squash(str(r).split(' Explanation:')[0])}"
                                for r, n in reasons],
        "unique_graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
        "frames_compiled": int(counters.get("frames", {}).get("total", 0)),
        "compile_time_s": _dynamo_compile_seconds(),
    }


def _dynamo_compile_seconds() -> float:
    """Total seconds Dynamo spent compiling frames (all phases), from its own timers."""
    from torch._dynamo.utils import compilation_time_metrics

    times = compilation_time_metrics.get("_compile.compile_inner", [])
    return round(float(sum(times)), 3)


def _squash(text: str, limit: int = 160) -> str:
    return " ".join(str(text).split())[:limit]


class _DynamoLogCounter(logging.Handler):
    """Counts Dynamo recompilations and recompile-limit hits from its own log records.

    Dynamo logs "Recompiling function ..." on its `recompiles` artifact logger (enabled here
    with torch._logging.set_logs, which also echoes it to the worker's log) and warns "torch._dynamo
    hit config.recompile_limit" from torch._dynamo.convert_frame when it gives up on a frame and
    runs it eagerly. A record can reach this handler through several loggers: count it once.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.recompiles = 0
        self.limit_hits = 0
        self.first_reasons: list[str] = []
        self._seen: set[tuple[float, str, int]] = set()

    def install(self) -> None:
        import torch._logging

        torch._logging.set_logs(recompiles=True)
        loggers = _artifact_loggers("recompiles") + [logging.getLogger("torch._dynamo")]
        for logger in loggers:
            if self not in logger.handlers:
                logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        key = (record.created, record.pathname, record.lineno)
        if key in self._seen:
            return
        self._seen.add(key)
        message = record.getMessage()
        if message.startswith("Recompiling function"):
            self.recompiles += 1
            reason = message.split("guard failure(s):", 1)[-1].split("(HINT", 1)[0]
            reason = _squash(re.sub(r"^\s*- \d+/\d+: ", "", reason), 200)
            if reason not in self.first_reasons and len(self.first_reasons) < 3:
                self.first_reasons.append(reason)
        elif "hit config." in message:
            self.limit_hits += 1

    def summary(self) -> dict[str, Any]:
        return {
            "recompiles": self.recompiles,
            "recompile_limit_hits": self.limit_hits,
            "recompile_reasons": list(self.first_reasons),
        }


def _artifact_loggers(artifact: str) -> list[logging.Logger]:
    """Loggers torch._logging created for an artifact (named '<module>.__<artifact>')."""
    suffix = f".__{artifact}"
    manager = logging.Logger.manager
    return [logger for name, logger in manager.loggerDict.items()
            if name.endswith(suffix) and isinstance(logger, logging.Logger)]
