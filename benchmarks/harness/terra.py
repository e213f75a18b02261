"""The terra_torch runners: co-execution, lazy (serialized) co-execution, and the graph-only bound.

Kept apart from runners.py because they need more than a one-line wrap: which object marks the
iteration boundary depends on the program, their statistics are structured (phases, fallbacks,
per-runner times), and the graph-only bound drives the GraphRunner itself.

* `TerraRunner(name, mode)`: `terra_torch.wrap(model, mode=mode)` when the program calls its one
  model once per step (the paper's setting: an iteration runs from one forward call to the next),
  else `terra_torch.function(step, mode=mode)` (one call of the step function = one iteration).
  A program says which with `TERRA_ITERATION = "model" | "step"` (default "model").
* `GraphOnlyRunner`: records a few iterations of the program eagerly (terra_torch.graph.record),
  generates their graph (terra_torch._runtime.Plan, the GraphRunner's own graph builder) and then
  only replays those iterations on the GraphRunner's worker thread, cycling through them: no
  program Python runs, so its steps/s bound what co-execution could reach with Python fully
  hidden. Its results are not the program's trajectory (replays repeat recorded inputs and
  branch decisions), so its correctness is checked differently: each recorded iteration is
  replayed once from a snapshot of the state before it, and the loss and every state tensor it
  updates must equal what eager computed, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import types
from typing import Any

import torch

from benchmarks.harness.runners import Runner, RunnerUnavailable, StepFn, _first_line

# Stats fields summed over the wrapped objects of one program (seconds).
TIME_FIELDS = ("python_exec_s", "python_stall_s", "graph_exec_s", "graph_stall_s", "tracing_s")
PHASES = ("tracing", "coexec", "eager")
WAIT_S = 30.0  # a replayed iteration that takes longer than this is stuck, not slow
# Channel ops a recorded script can serve (terra_torch._runtime.post / collect; Python numbers
# fed per iteration too, Script.scalars). A graph with any other terra:: op would wait forever.
REPLAYABLE_OPS = frozenset({"feed", "feed_or_none", "case_select", "loop_cond", "fetch", "feed_scalar", "feed_int",
                            "feed_bool", "feed_int_list", "feed_float_list", "feed_number_list"})


class TerraRunner(Runner):
    """terra_torch co-execution ("coexec") or its serialized baseline ("lazy")."""

    # settle(): how long compiled segments may take to be compiled (each ~20 s on 2 cores).
    SETTLE_LIMIT_S = 1800.0

    def __init__(self, name: str, mode: str, optimize: bool | str = False) -> None:
        self.name = name
        self.mode = mode
        self.optimize = optimize
        self.note = f"terra_torch, mode={mode}" + (f", optimize={optimize!r}" if optimize else "")
        self.iteration = "model"
        self._terra: Any = None
        self._wrapped: list[tuple[str, Any]] = []  # (label, object terra_torch.stats accepts)

    def unavailable_reason(self) -> str | None:
        try:
            import terra_torch
        except Exception as exc:  # an import error is the column's reason, not a crash
            return f"import terra_torch failed: {type(exc).__name__}: {_first_line(exc)}"
        missing = [api for api in ("wrap", "function", "synchronize", "stats")
                   if not hasattr(terra_torch, api)]
        if missing:
            return f"terra_torch lacks {', '.join(missing)}"
        self._terra = terra_torch
        return None

    def bind_program(self, module: types.ModuleType) -> None:
        self.iteration = getattr(module, "TERRA_ITERATION", "model")
        if self.iteration not in ("model", "step"):
            raise ValueError(f"TERRA_ITERATION must be 'model' or 'step', got {self.iteration!r}")
        how = ("terra_torch.wrap(model)" if self.iteration == "model"
               else "@terra_torch.function on the step")
        self.note = f"terra_torch, mode={self.mode}, {how}" + (f", optimize={self.optimize!r}" if self.optimize else "")

    def wrap_model(self, model: Any, example_inputs: tuple[Any, ...]) -> Any:
        if self.iteration != "model":
            return model
        wrapped = self._terra.wrap(model, mode=self.mode, optimize=self.optimize)
        self._wrapped.append((f"wrap({type(model).__name__})", wrapped))
        return wrapped

    def wrap_step(self, step: StepFn) -> StepFn:
        if self.iteration != "step":
            return step
        fn = self._terra.function(step, mode=self.mode, optimize=self.optimize)
        self._wrapped.append(("function(step)", fn))
        return fn

    def sync(self) -> None:
        self._terra.synchronize()

    def _segments(self) -> list[dict[str, Any]]:
        return [s for _, obj in self._wrapped for s in (self._terra.explain(obj).segments or [])]

    def settle(self) -> float:
        """optimize="fused": wait until every segment that has run is compiled (or stays
        interpreted), so that the timed steps run the compiled code."""
        if self.optimize != "fused":
            return 0.0
        t0 = time.perf_counter()
        while any(s["state"] in ("requested", "compiling") for s in self._segments()):
            if time.perf_counter() - t0 > self.SETTLE_LIMIT_S:
                break
            time.sleep(0.5)
        return time.perf_counter() - t0

    def counters(self) -> dict[str, float]:
        """Cumulative times and phase counts; the worker takes differences over the timed reps."""
        out = {key: 0.0 for key in TIME_FIELDS}
        out.update({f"iterations_{p}": 0.0 for p in PHASES})
        out["fallbacks"] = 0.0  # differenced like the rest: the report's coverage column
        for _, obj in self._wrapped:
            st = self._terra.stats(obj)
            for key in TIME_FIELDS:
                out[key] += float(getattr(st, key))
            for phase in PHASES:
                out[f"iterations_{phase}"] += float(st.iterations.get(phase, 0))
            out["fallbacks"] += float(st.fallbacks)
        return out

    def stats(self) -> dict[str, Any]:
        """Per wrapped object: phases, transitions, fallbacks with reasons, runner counters."""
        per_object = []
        for label, obj in self._wrapped:
            st = self._terra.stats(obj)
            program = obj._terra_program
            per_object.append({
                "wrapped": label,
                "iterations": dict(st.iterations),
                "transitions": [list(t) for t in st.transitions[:8]],
                "transitions_total": len(st.transitions),
                "graph_builds": st.graph_builds,
                "fallbacks": st.fallbacks,
                "fallback_reasons": _fallback_reasons(program.fallbacks),
                "runner": {k: v for k, v in st.runner.items() if isinstance(v, (int, float))},
                **{key: round(float(getattr(st, key)), 6) for key in TIME_FIELDS},
            })
        phases = {p: sum(o["iterations"].get(p, 0) for o in per_object) for p in PHASES}
        out = {"iteration": self.iteration, "mode": self.mode, "phases": phases,
               "fallbacks": sum(o["fallbacks"] for o in per_object), "programs": per_object}
        if self.optimize == "fused":
            out["segments"] = _segment_summary(self._segments())
        return out

    def breakdown(self) -> dict[str, float] | None:
        if not self._wrapped:
            return None
        totals = self.counters()
        return {key: totals[key] for key in TIME_FIELDS}


def _segment_summary(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """Compiled segments of a fused runner: how many in each state, ops compiled, the largest
    difference their checks saw, and the reasons of those left interpreted."""
    states: dict[str, int] = {}
    for s in segments:
        states[s["state"]] = states.get(s["state"], 0) + 1
    return {"states": states,
            "ops_compiled": sum(s["ops"] for s in segments if s["state"] == "trusted"),
            "ops_in_segments": sum(s["ops"] for s in segments),
            "max_difference": max((s.get("max_difference", 0.0) for s in segments), default=0.0),
            "interpreted": sorted({s["reason"] for s in segments if s["state"] == "interpreted"})[:5]}


def _fallback_reasons(fallbacks: list[Any], limit: int = 5) -> list[str]:
    """Distinct reasons, how often and where: '3x (first at iteration 52) file:line: reason'."""
    groups: dict[tuple[str, str], list[int]] = {}
    for fb in fallbacks:
        groups.setdefault((fb.source_line, fb.reason), []).append(fb.iteration)
    lines = []
    for (where, reason), iterations in list(groups.items())[:limit]:
        where = where.replace("\\", "/").split("/benchmarks/")[-1]
        lines.append(f"{len(iterations)}x (first at iteration {iterations[0]}) {where}: "
                     f"{' '.join(reason.split())[:240]}")
    return lines


# ---------------------------------------------------------------- graph-only bound

@dataclasses.dataclass
class _Replay:
    """One replayed iteration whose loss is fetched at the next sync (never inside timing)."""

    script: Any
    value: torch.Tensor | None = None

    def __float__(self) -> float:
        if self.value is None:
            raise RuntimeError("graph-only replay: the loss was never fetched (no sync ran)")
        return float(self.value)


class GraphOnlyRunner(Runner):
    """The generated graph replayed on the GraphRunner with no program Python (a speed bound).

    The first step runs step 0 eagerly (it creates optimizer state), then records RECORDED more
    steps, generates their graph, checks it (see the module docstring) and starts the worker.
    Every later step posts one recorded iteration's decisions and feeds, cycling through them,
    without waiting; `sync` collects the fetched losses and waits for the worker.
    """

    RECORDED = 6

    def __init__(self, fused: bool = False) -> None:
        # fused: the GraphRunner runs compiled segments (mode="fused"); they are compiled right
        # after the replay check (itself interpreted, bitwise), outside the timed steps.
        self.fused = fused
        self.name = "terra-graph-only-fused" if fused else "terra-graph-only"
        self.note = (f"terra_torch graph only: {self.RECORDED} recorded iterations replayed on the "
                     "GraphRunner, no program Python (timing bound)"
                     + ("; straight-line segments compiled by AOTInductor" if fused else ""))
        self._recordings: list[Any] = []
        self._scripts: list[Any] = []
        self._runner: Any = None
        self._pending: list[_Replay] = []
        self._next = 0
        self._check: dict[str, Any] = {}
        self._plan_info: dict[str, Any] = {}

    def unavailable_reason(self) -> str | None:
        try:
            from terra_torch import _runtime, graph  # noqa: F401
        except Exception as exc:
            return f"import terra_torch failed: {type(exc).__name__}: {_first_line(exc)}"
        return None

    def wrap_step(self, step: StepFn) -> StepFn:
        def replay_step(state: Any, i: int) -> Any:
            if self._runner is None:
                return self._record_and_build(step, state, i)
            return self._post_next()

        return replay_step

    def _record_and_build(self, step: StepFn, state: Any, i: int) -> Any:
        from terra_torch import _runtime, graph

        loss = step(state, i)
        snapshots = [_snapshot(state)]
        rng_states = []  # the CPU generator before each recorded iteration (see _replay_check)
        for k in range(1, self.RECORDED + 1):
            rng_states.append(torch.get_rng_state())
            self._recordings.append(graph.record(step, state, i + k))
            snapshots.append(_snapshot(state))
        plan = _runtime.Plan(self._recordings, optimize=False)  # wrap's default: optimize=False
        unserved = sorted(set(re.findall(r"terra::(\w+)", plan.text)) - REPLAYABLE_OPS)
        if unserved:
            raise RunnerUnavailable(
                "no replay: the generated graph takes input through "
                + ", ".join(f"terra::{op}" for op in unserved)
                + ", which recorded scripts (terra_torch._runtime.Plan.script) do not provide; "
                "see the derived graph-only figure from the terra cell")
        self._runner = plan.runner("fused" if self.fused else "interpreter")
        self._check = _replay_check(plan, self._runner, self._recordings, snapshots, rng_states)
        self._scripts = [plan.script(r) for r in self._recordings]
        self._plan_info = {
            "recorded_iterations": len(self._recordings), "sites": len(plan.sites),
            "graph_lines": plan.text.count("\n"),
            "feeds_per_iteration": [len(s.feeds) for s in self._scripts],
            "decisions_per_iteration": [len(s.decisions) for s in self._scripts],
            "fetches_per_iteration": [len(s.fetches) for s in self._scripts],
            "recorded_losses": [_loss_value(r) for r in self._recordings],
            "first_recorded_step": i + 1,
        }
        if self.fused:
            self._compile_segments()
        return loss

    def _compile_segments(self) -> None:
        """Compile every segment the check's runs requested (in this process: nothing else runs
        now), then replay each script once so that each segment's checked first compiled run
        is not timed."""
        from terra_torch import _fused, _runtime

        t0 = time.perf_counter()
        # (twice: a segment whose first run was one of the check's, from restored snapshots,
        # may be planned again from the scripts' inputs in the replays after its compile)
        for _ in range(2):
            while _fused.compile_one(self._runner.fused, 0.0):
                pass
            for script in self._scripts:
                _runtime.run_iteration(self._runner, script, WAIT_S)
            if not any(s["state"] == "requested" for s in self._runner.fused.report()):
                break
        self._plan_info["compile_s"] = time.perf_counter() - t0

    def _post_next(self) -> _Replay:
        from terra_torch import _runtime

        script = self._scripts[self._next % len(self._scripts)]
        self._next += 1
        self._runner.start_iteration()
        _runtime.post(self._runner.channel, script)
        pending = _Replay(script)
        self._pending.append(pending)
        return pending

    def sync(self) -> None:
        from terra_torch import _runtime

        if self._runner is None:
            return
        try:
            for pending in self._pending:
                pending.value = _runtime.collect(self._runner.channel, pending.script,
                                                 WAIT_S).outputs[0]
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; the graph waits for "
                               f"{self._runner.channel.graph_waiting_for()}") from exc
        self._pending.clear()
        self._runner.synchronize(WAIT_S)

    def counters(self) -> dict[str, float]:
        if self._runner is None:
            return {}
        raw = self._runner.stats
        stall = raw.get("graph_stall_ns", 0)
        return {"graph_exec_s": max(0, raw.get("exec_ns", 0) - stall) / 1e9,
                "graph_stall_s": stall / 1e9,
                "python_stall_s": raw.get("python_stall_ns", 0) / 1e9,
                "iterations_graph": float(raw.get("iterations_run", 0))}

    def stats(self) -> dict[str, Any]:
        raw = dict(self._runner.stats) if self._runner is not None else {}
        out = {"replay_check": self._check, "plan": self._plan_info, "runner": raw}
        if self.fused and self._runner is not None:
            out["segments"] = _segment_summary(list(self._runner.fused.report()))
        return out

    def breakdown(self) -> dict[str, float] | None:
        c = self.counters()
        if not c:
            return None
        return {"python_exec_s": 0.0, "python_stall_s": c["python_stall_s"],
                "graph_exec_s": c["graph_exec_s"], "graph_stall_s": c["graph_stall_s"],
                "tracing_s": 0.0}


def _loss_value(recording: Any) -> float | None:
    outputs = recording.outputs
    return float(outputs[0]) if outputs else None


# State snapshots for the replay check. Tensors are found by walking the program's state object
# (dataclass fields, attributes, containers, modules, optimizer state), keyed by id: the
# recording names its external tensors by object, and a snapshot taken before an iteration holds
# the values the graph must start from.

Snapshot = dict[int, tuple[str, torch.Tensor, torch.Tensor]]  # id -> (path, live, clone)
_LEAVES = (str, bytes, int, float, bool, complex, type(None), types.FunctionType,
           types.MethodType, types.BuiltinFunctionType, type, types.ModuleType,
           types.GeneratorType)


def _snapshot(root: Any, limit: int = 50_000) -> Snapshot:
    out: Snapshot = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("state", root)]
    while stack and len(seen) < limit:
        path, obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if id(obj) not in out:
                out[id(obj)] = (path, obj, obj.detach().clone())
            if obj.grad is not None:
                stack.append((f"{path}.grad", obj.grad))
            continue
        if isinstance(obj, _LEAVES) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            for index, (key, value) in enumerate(obj.items()):
                stack.append((f"{path}[{_short(key, index)}]", value))
                if isinstance(key, torch.Tensor):
                    stack.append((f"{path}.key", key))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[{k}]", v) for k, v in enumerate(obj))
        elif isinstance(obj, torch.optim.Optimizer):
            stack.append((f"{path}.state", obj.state))
            stack.append((f"{path}.param_groups", obj.param_groups))
        elif hasattr(obj, "__dict__"):
            stack.extend((f"{path}.{k}", v) for k, v in vars(obj).items())
    return out


def _short(key: Any, index: int) -> str:
    """A dict key in a path; keys that print badly (optimizer state keys are parameters) are
    named by position, which keeps paths unique."""
    return repr(key) if isinstance(key, (str, int)) else f"#{index} {type(key).__name__}"


def _replay_check(plan: Any, runner: Any, recordings: list[Any], snapshots: list[Snapshot],
                  rng_states: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """Replay recording k from snapshot k's copies; compare with eager (snapshot k+1), bitwise.
    `rng_states[k]`: the CPU generator's state when recording k began, restored before its
    replay, so that a program's random draws (a GAN's noise, dropout) are eager's again; the
    generator's state after the check is the one it had before."""
    resume = torch.get_rng_state()
    try:
        return _replay_check_each(plan, runner, recordings, snapshots, rng_states)
    finally:
        torch.set_rng_state(resume)


def _replay_check_each(plan: Any, runner: Any, recordings: list[Any], snapshots: list[Snapshot],
                       rng_states: list[torch.Tensor] | None) -> dict[str, Any]:
    from terra_torch import _runtime

    loss_ok = 0
    checked = 0
    unmapped = 0
    mismatches: list[str] = []
    for k, rec in enumerate(recordings):
        before, after = snapshots[k], snapshots[k + 1]
        externals = rec.externals
        copies: list[torch.Tensor] = []
        compare: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for t in externals:
            entry = before.get(id(t))
            if entry is None or entry[1] is not t:
                unmapped += 1  # not reachable from the state: replayed on the live tensor
                copies.append(t)
                continue
            copy = entry[2].clone()
            copies.append(copy)
            later = after.get(id(t))
            if later is not None and later[1] is t:
                compare.append((entry[0], copy, later[2]))
        if rng_states is not None:
            torch.set_rng_state(rng_states[k])
        try:
            out = _runtime.run_iteration(runner, plan.script(rec, copies), WAIT_S)
        except TimeoutError as exc:
            raise TimeoutError(f"replay check, iteration {k}: {exc}; the graph waits for "
                               f"{runner.channel.graph_waiting_for()}") from exc
        got = out.outputs[0] if out.outputs else None
        want = rec.outputs[0] if rec.outputs else None
        if got is not None and want is not None and _bitwise(got, want):
            loss_ok += 1
        elif len(mismatches) < 8:
            mismatches.append(f"iteration {k}: loss {_value(got)} vs eager {_value(want)}")
        for path, replayed, eager in compare:
            checked += 1
            if not _bitwise(replayed, eager) and len(mismatches) < 8:
                diff = (replayed.double() - eager.double()).abs().max().item() \
                    if replayed.shape == eager.shape else math.inf
                mismatches.append(f"iteration {k}: {path} differs (max abs {diff:.3g})")
    bitwise = loss_ok == len(recordings) and not mismatches
    return {"verdict": "bitwise" if bitwise else "DIFFERS", "iterations": len(recordings),
            "losses_bitwise": loss_ok, "state_tensors_checked": checked,
            "unmapped_externals": unmapped, "mismatches": mismatches}


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _value(t: torch.Tensor | None) -> str:
    if t is None:
        return "none"
    return f"{float(t):.9g}" if t.numel() == 1 else f"tensor{tuple(t.shape)}"

