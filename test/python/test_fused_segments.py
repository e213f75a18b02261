"""Compiled segments (csrc/emit/segments.h, csrc/runtime/fused_executor.h, terra_torch/_fused.py).

Eager is the oracle. Interpreted segments run eager's kernels, so until a segment is compiled
the cut graph must give eager's numbers bit for bit (the cut must keep every alias: an SGD step
writes parameters through the t() views linear's backward made). Compiled segments are checked
against the interpreter on their first run and must then stay within the stated tolerance.
Compiling costs about 20 s per segment on a 2-core machine, so only a few tests compile.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import terra_torch
from terra_torch import _C, _fused, graph
from terra_torch._speed import COEXEC, SpeedCheck


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)) for _ in range(n)]


def _recorded_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    def step() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return graph.record(step)


def _recorded_with_eager_twin():
    """A recorded SGD step of an MLP, and an eager copy of the model that has taken the same step
    (the recording ran one): (model, recording, eager model, its optimizer, x, y)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    (x, y), = _data(1)
    rec = _recorded_step(model, opt, x, y)
    F.cross_entropy(eager_model(x), y).backward()
    eager_opt.step()
    return model, rec, eager_model, eager_opt, x, y


def _eager_stepper(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    """The recorded step, eagerly on the twin: returns the loss (`.model` is the twin)."""
    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step.model = model  # type: ignore[attr-defined]
    return step


def _graph_after_its_first_run() -> tuple[torch.nn.Module, Any, Any, Callable[[], torch.Tensor]]:
    """(model, recording, graph, eager twin's step) after the graph's first fused run (each
    segment's first run: its plan noted, a compile requested) and the twin's matching step."""
    model, rec, eager_model, eager_opt, x, y = _recorded_with_eager_twin()
    eager_step = _eager_stepper(eager_model, eager_opt, x, y)
    g = graph.build([rec])
    g.run(rec, mode="fused")
    eager_step()
    return model, rec, g, eager_step


def _runs_bitwise_like_eager(g: Any, rec: Any, model: torch.nn.Module, eager_step: Callable[[], torch.Tensor],
                             runs: int) -> None:
    """`runs` fused runs of the graph, each bitwise equal to the eager twin's step: the loss and
    every parameter (interpreted segments, called or in place)."""
    for _ in range(runs):
        out = g.run(rec, mode="fused")
        assert torch.equal(out.outputs[0], eager_step())
        for p, q in zip(model.parameters(), eager_step.model.parameters()):
            assert torch.equal(p, q)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TERRA_CACHE_DIR", str(tmp_path / "cache"))
    # No speed trial (FusedExecutor::min_speedup) unless a test asks: the states these tests
    # expect must not depend on this machine's timing.
    monkeypatch.setenv("TERRA_FUSED_MIN_SPEEDUP", "0")
    # Nor a floor on a segment's first run (FusedExecutor::min_segment_us): these segments are
    # small, and which of them reach 10 us depends on the machine too.
    monkeypatch.setenv("TERRA_FUSED_MIN_SEGMENT_US", "0")


def test_a_cut_graph_runs_interpreted_bitwise_like_eager() -> None:
    # Graph side: the recorded step replayed three times with mode="fused" and nothing compiled.
    model, rec, eager_model, eager_opt, x, y = _recorded_with_eager_twin()
    g = graph.build([rec])
    assert "terra::segment" in g._graph.fused.text
    for _ in range(3):
        out = g.run(rec, mode="fused")
        eager_opt.zero_grad()
        loss = F.cross_entropy(eager_model(x), y)
        loss.backward()
        eager_opt.step()
        assert torch.equal(out.outputs[0], loss.detach())
        for p, q in zip(model.parameters(), eager_model.parameters()):
            assert torch.equal(p, q)  # written through the views, as eager writes them
    report = g.segments
    assert report and all(s["state"] == "requested" for s in report)
    assert sum(s["ops"] for s in report) >= 20  # forward, backward and the step in few segments


def test_segments_that_stay_interpreted_run_in_place_bitwise_like_eager() -> None:
    # A segment given up for good (here: its compile "failed") is no longer called: the graph is
    # cut again with its ops left in place, and runs stay bitwise eager.
    model, rec, g, eager_step = _graph_after_its_first_run()
    executor = g._graph.fused
    for k in range(len(g.segments)):
        executor.failed(k, "given up by the test")
    calls = [s["interpreted_runs"] for s in g.segments]
    _runs_bitwise_like_eager(g, rec, model, eager_step, 3)
    report = g.segments
    assert all(s["state"] == "interpreted" and s["inlined"] for s in report), report
    assert [s["interpreted_runs"] for s in report] == calls  # not called any more


def test_segments_waiting_for_the_compiler_run_in_place_and_are_called_once_loaded() -> None:
    # While a segment waits for its compiled code, the graph runs its ops in place (a call would
    # only cost): its interpreted_runs stop at the first run, which noted its plan. Once its
    # package is loaded, the graph calls it again, for the check and the compiled runs.
    model, rec, g, eager_step = _graph_after_its_first_run()
    _runs_bitwise_like_eager(g, rec, model, eager_step, 3)
    report = g.segments
    assert all(s["state"] == "requested" and s["inlined"] for s in report), report
    assert all(s["interpreted_runs"] == 1 and s["first_run_us"] > 0 for s in report), report
    g.compile_segments()
    assert all(s["state"] == "loaded" for s in g.segments)
    tol = dict(rtol=1e-3, atol=1e-5)
    for _ in range(2):
        torch.testing.assert_close(g.run(rec, mode="fused").outputs[0], eager_step(), **tol)
    report = g.segments
    assert all(s["state"] == "trusted" and not s["inlined"] for s in report), report
    assert all(s["interpreted_runs"] == 2 and s["compiled_runs"] == 1 for s in report), report


def test_a_segment_faster_than_the_floor_on_its_first_run_is_not_compiled(monkeypatch) -> None:
    # FusedExecutor::min_segment_us: a segment whose first run took less than the floor (here an
    # impossible 10 s) asks for no compile; it runs in place, bitwise like eager, and its reason
    # names its time.
    monkeypatch.setenv("TERRA_FUSED_MIN_SEGMENT_US", "1e7")
    model, rec, eager_model, eager_opt, x, y = _recorded_with_eager_twin()
    eager_step = _eager_stepper(eager_model, eager_opt, x, y)
    g = graph.build([rec])
    _runs_bitwise_like_eager(g, rec, model, eager_step, 3)
    report = g.segments
    assert report and all(s["state"] == "interpreted" and s["inlined"] for s in report), report
    assert all("TERRA_FUSED_MIN_SEGMENT_US" in s["reason"] and s["first_run_us"] > 0 for s in report), report
    assert all(s["interpreted_runs"] == 1 for s in report)
    from terra_torch import _fused

    assert not _fused.compile_one(g._graph.fused, 0.0)  # nothing was requested


def test_a_loaded_segment_whose_first_inputs_were_unlike_the_next_ones_is_planned_again() -> None:
    # The first run fed a contiguous copy of a strided view (as a replay from restored snapshots
    # does; gpt's batch is `tokens[:, :-1]`), so the compiled code is for the wrong strides: the
    # next run, fed the view, plans the segment again from it and asks for a compile for it,
    # running interpreted meanwhile; that code is then checked and trusted.
    data, w = torch.randn(8, 17), torch.randn(16, 16)
    x = data[:, :-1]

    def step() -> torch.Tensor:
        return ((x @ w) * 2 + 1).relu().sum()

    rec = graph.record(step)
    g = graph.build([rec])
    (k,) = [i for i, t in enumerate(rec.externals) if t is x]
    first = list(rec.externals)
    first[k] = x.contiguous()
    assert first[k].stride() != x.stride()
    g.run(rec, externals=first, mode="fused")
    (before,) = g.compile_segments()
    assert before["state"] == "loaded"
    out = g.run(rec, mode="fused")
    assert torch.equal(out.outputs[0], step())  # interpreted
    (replanned,) = g.segments
    assert replanned["state"] == "requested" and replanned["package"] == "", replanned
    (after,) = g.compile_segments()
    assert after["state"] == "loaded" and after["package"] != before["package"]
    for _ in range(2):
        torch.testing.assert_close(g.run(rec, mode="fused").outputs[0], step(), rtol=1e-3, atol=1e-5)
    (done,) = g.segments
    assert done["state"] == "trusted" and done["compiled_runs"] == 1, done


def test_compiled_segments_are_checked_then_run_within_tolerance() -> None:
    model, rec, eager_model, eager_opt, x, y = _recorded_with_eager_twin()

    eager_step = _eager_stepper(eager_model, eager_opt, x, y)
    g = graph.build([rec])
    g.run(rec, mode="fused")  # interpreted; requests compiling
    eager_step()
    report = g.compile_segments()
    assert all(s["state"] == "loaded" for s in report), report
    tol = dict(rtol=1e-3, atol=1e-5)
    for k in range(4):  # the first is the check, the others run compiled code
        out = g.run(rec, mode="fused")
        loss = eager_step()
        torch.testing.assert_close(out.outputs[0], loss, **tol)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p, q, **tol)
    report = g.segments
    assert all(s["state"] == "trusted" for s in report), report
    assert all(s["compiled_runs"] == 3 for s in report)
    assert 0.0 <= max(s["max_difference"] for s in report) < 1e-4

    # The packages are kept: another graph of the same program finds them in the cache instead
    # of compiling, and takes this process's verdicts on them: trusted at once, without loading
    # them again, a check or a trial (runtime/fused_executor.cpp, verdict_book).
    g2 = graph.build([rec])
    g2.run(rec, mode="fused")
    eager_step()
    t0 = time.perf_counter()
    g2.compile_segments()
    assert time.perf_counter() - t0 < 5.0
    assert all(s["state"] == "trusted" for s in g2.segments), g2.segments
    torch.testing.assert_close(g2.run(rec, mode="fused").outputs[0], eager_step(), **tol)
    assert all(s["compiled_runs"] == 1 and s["interpreted_runs"] == 1 for s in g2.segments), g2.segments
    # A program closed lets its verdicts go: a third graph loads the packages again and checks them.
    g._graph.fused.close()
    g2._graph.fused.close()
    g3 = graph.build([rec])
    g3.run(rec, mode="fused")
    g3.compile_segments()
    assert all(s["state"] == "loaded" for s in g3.segments), g3.segments


def test_python_numbers_keep_eagers_type_promotion_in_compiled_code() -> None:
    # `0.01 * <0-dim float32>` stays float32 in eager (a Python number ranks below every
    # tensor); the graph feeds the number as a 0-dim float64 tensor, which compiled code would
    # promote to float64: the check refused such segments ("a result has another shape or
    # type") after a wasted compile. The plan marks the input wrapped and build_module casts it.
    a = torch.randn(7, generator=torch.Generator().manual_seed(4))
    n = torch.tensor(3)

    def step():
        return a.sum() * 0.01 + a.mean(), n * 2.5  # float32 0-dim; int64 0-dim * float -> float32

    rec = graph.record(step)
    g = graph.build([rec])
    g.run(rec, mode="fused")
    g.compile_segments()
    for _ in range(2):  # the check, then a compiled run
        out = g.run(rec, mode="fused")
        for got, want in zip(out.outputs, step()):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    report = g.segments
    assert report and all(s["state"] == "trusted" for s in report), report


def test_an_input_that_is_a_strided_view_is_checked_on_its_own_strides() -> None:
    # The batch is every other column of a wider tensor: not dense, so a clone() of it is
    # contiguous. The compiled code assumes the strides of the call plan; the check's copies must
    # keep them (an LSTM's gate chunks failed every check on garbage reads before).
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    g0 = torch.Generator().manual_seed(2)
    x = torch.randn(5, 16, generator=g0)[:, ::2]
    y = torch.randint(0, 4, (5,), generator=g0)
    assert x.stride() == (16, 2) and not x.clone().stride() == x.stride()
    rec = _recorded_step(model, opt, x, y)
    F.cross_entropy(eager_model(x), y).backward()
    eager_opt.step()
    g = graph.build([rec])
    g.run(rec, mode="fused")
    eager_opt.zero_grad()
    F.cross_entropy(eager_model(x), y).backward()
    eager_opt.step()
    g.compile_segments()
    for _ in range(2):  # the check, then a compiled run
        out = g.run(rec, mode="fused")
        eager_opt.zero_grad()
        loss = F.cross_entropy(eager_model(x), y)
        loss.backward()
        eager_opt.step()
        torch.testing.assert_close(out.outputs[0], loss.detach(), rtol=1e-3, atol=1e-5)
    report = g.segments
    assert all(s["state"] == "trusted" for s in report), report
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)


def test_strided_views_written_in_place_are_compiled() -> None:
    # An LSTM cell's gates: one matrix product, cut into four chunks (views with gaps between
    # their rows, over one memory), each activated in place. The chunks are written inputs of
    # the segment after the cut; they do not overlap, so compiled code takes them (over their
    # shared memory, as a base and four views). Before, any written input that was not dense
    # counted as overlapping itself, and every LSTM step's cell stayed interpreted.
    g0 = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 8, generator=g0), torch.randn(8, 4 * 16, generator=g0)
    cx = torch.randn(6, 16, generator=g0)

    def cell() -> torch.Tensor:
        i, f, c, o = (x @ w).unsafe_chunk(4, 1)
        i.sigmoid_(), f.sigmoid_(), c.tanh_(), o.sigmoid_()
        return o * (f * cx + i * c).tanh()

    expected = cell()
    rec = graph.record(cell)
    g = graph.build([rec])
    g.run(rec, mode="fused")
    g.compile_segments()
    for _ in range(3):  # the check, then compiled runs
        torch.testing.assert_close(g.run(rec, mode="fused").outputs[0], expected, rtol=1e-3, atol=1e-5)
    report = g.segments
    assert not [s for s in report if "overlaps" in s["reason"]], report
    written = [s for s in report if s["ops"] >= 4]  # the activations and what follows them
    assert written and all(s["state"] == "trusted" and s["compiled_runs"] >= 2 for s in written), report


def test_compiled_code_not_fast_enough_goes_back_to_the_interpreter(monkeypatch) -> None:
    # The speed trial: a trusted segment's next runs alternate compiled and interpreted code,
    # timed; compiled code that is not TERRA_FUSED_MIN_SPEEDUP times as fast (here an
    # impossible million) is dropped, with both medians in the reason, and the runs after it
    # are the interpreter's, bitwise like eager.
    monkeypatch.setenv("TERRA_FUSED_MIN_SPEEDUP", "1000000")
    model, rec, eager_model, eager_opt, x, y = _recorded_with_eager_twin()

    eager_step = _eager_stepper(eager_model, eager_opt, x, y)
    g = graph.build([rec])
    g.run(rec, mode="fused")
    eager_step()
    g.compile_segments()
    trial = 1 + 2 * 8  # the check, then FusedExecutor::kTrialRuns runs of each kind
    for _ in range(trial):
        torch.testing.assert_close(g.run(rec, mode="fused").outputs[0], eager_step(), rtol=1e-3, atol=1e-5)
    report = g.segments
    assert all(s["state"] == "interpreted" for s in report), report
    assert all("not 1e+06 times as fast" in s["reason"] for s in report), report
    assert all(s["compiled_us"] > 0 and s["interpreted_us"] > 0 for s in report)
    assert all(s["compiled_runs"] == 8 for s in report)
    # From here on eager's numbers bit for bit, starting from where the compiled runs left off.
    with torch.no_grad():
        for p, q in zip(eager_model.parameters(), model.parameters()):
            p.copy_(q)
    for _ in range(2):
        out = g.run(rec, mode="fused")
        assert torch.equal(out.outputs[0], eager_step())
        for p, q in zip(model.parameters(), eager_model.parameters()):
            assert torch.equal(p, q)


def test_compiled_code_that_disagrees_is_rejected() -> None:
    # Hand the executor code compiled from a body whose SGD step size is doubled: the check on
    # its first run must refuse it, and the results must stay the interpreter's (eager's).
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model = copy.deepcopy(model)
    (x, y), = _data(1)
    rec = _recorded_step(model, opt, x, y)
    g = graph.build([rec])
    g.run(rec, mode="fused")
    executor = g._graph.fused
    segment, body, plan = max((r for r in iter(lambda: executor.next_request(0.0), None)),
                              key=lambda r: len(r[1]["nodes"]))
    wrong = copy.deepcopy(body)
    changed = 0
    for name, _, args, _ in wrong["nodes"]:
        for i, (kind, v) in enumerate(args):
            if name == "aten::add_" and kind == "c" and isinstance(v, float):
                args[i] = ("c", 2 * v)
                changed += 1
    assert changed >= 1
    wrong["text"] += "# changed"
    path, _ = _fused.compile_segment(wrong, plan)
    executor.compiled(segment, path)
    before = [p.detach().clone() for p in model.parameters()]
    out = g.run(rec, mode="fused")
    state = g.segments[segment]
    assert state["state"] == "interpreted"
    assert "differ" in state["reason"] and state["max_difference"] > 1e-4
    # What the run returned and wrote is the interpreter's: eager's step from `before`.
    with torch.no_grad():
        for p, b in zip(eager_model.parameters(), before):
            p.copy_(b)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    loss = F.cross_entropy(eager_model(x), y)
    loss.backward()
    eager_opt.step()
    assert torch.equal(out.outputs[0], loss.detach())
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)

    # Another graph of the program handed the same package takes this process's verdict on it
    # (runtime/fused_executor.cpp, verdict_book): refused at once, without a second check.
    g2 = graph.build([rec])
    g2.run(rec, mode="fused")
    e2 = g2._graph.fused
    assert segment in [r[0] for r in iter(lambda: e2.next_request(0.0), None)]
    e2.compiled(segment, path)
    again = g2.segments[segment]
    assert again["state"] == "interpreted" and again["inlined"] is False  # (cut again at the next run)
    assert again["reason"].startswith(state["reason"]) and "earlier in this process" in again["reason"]
    assert again["max_difference"] == state["max_difference"]
    assert again["interpreted_runs"] == 1 and again["compiled_runs"] == 0


def test_compiled_code_that_raises_once_trusted_gives_its_segment_back_to_the_interpreter() -> None:
    # Rows gathered by index: the compiled kernel checks the indices itself. Once the segment is
    # trusted, an index out of range makes its compiled code raise; the segment writes none of
    # its inputs, so the interpreter runs it instead and raises eager's error, and later runs are
    # interpreted, bitwise eager (before, the iteration failed with the compiled code's error and
    # the segment stayed trusted).
    torch.manual_seed(0)
    table = torch.randn(10, 4)
    index = torch.tensor([1, 2, 3])

    def gather() -> torch.Tensor:
        return (table.index_select(0, index) * 2.0).sum(0)

    rec = graph.record(gather)
    g = graph.build([rec])
    g.run(rec, mode="fused")
    report = g.compile_segments()
    assert report and all(s["state"] == "loaded" for s in report), report
    for _ in range(2):  # the check, then compiled code
        torch.testing.assert_close(g.run(rec, mode="fused").outputs[0], gather())
    assert all(s["state"] == "trusted" for s in g.segments), g.segments
    index.copy_(torch.tensor([1, 2, 30]))
    with pytest.raises(IndexError, match="index out of range"):
        gather()  # eager's error
    with pytest.raises((IndexError, RuntimeError), match="index out of range"):
        g.run(rec, mode="fused")
    raised = [s for s in g.segments if s["state"] == "interpreted"]
    assert len(raised) == 1, g.segments
    assert raised[0]["reason"].startswith("compiled code raised after it was trusted"), raised[0]
    index.copy_(torch.tensor([4, 0, 9]))
    assert torch.equal(g.run(rec, mode="fused").outputs[0], gather())


def _no_compiler(monkeypatch) -> None:
    def failing(body, plan, stop=None):
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(_fused, "compile_in_subprocess", failing)


def _coexecute_like_eager(make_optimizer: Callable[[list[torch.nn.Parameter]], tuple[Any, Any]],
                          steps: int = 60) -> torch.nn.Module:
    """Trains _mlp() eagerly and wrapped with optimize="fused" on the same batches
    (`make_optimizer(params)` -> (optimizer, LR scheduler or None)); asserts every loss and
    parameter bitwise equal; returns the wrapped module."""
    data = _data(4)

    def train(model: torch.nn.Module) -> list[float]:
        opt, sched = make_optimizer(list(model.parameters()))
        losses = []
        for i in range(steps):
            x, y = data[i % len(data)]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            losses.append(loss.item())
        return losses

    eager_model = _mlp()
    expected = train(eager_model)
    net = _mlp()
    wrapped = terra_torch.wrap(net, optimize="fused", speed_check=False)
    got = train(wrapped)
    terra_torch.synchronize()
    assert got == expected
    for p, q in zip(net.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)
    return wrapped


def test_coexecution_with_fused_segments_stays_exact_while_interpreted(monkeypatch) -> None:
    # Co-execution cuts a graph with publishes and gates; every segment's compile fails here, so
    # everything runs interpreted and must be eager's bit for bit, with the reason in explain().
    _no_compiler(monkeypatch)
    wrapped = _coexecute_like_eager(lambda ps: (torch.optim.SGD(ps, lr=0.05, momentum=0.9), None))
    deadline = time.monotonic() + 30  # the compiler thread gets to every request
    while True:
        explanation = terra_torch.explain(wrapped)
        segments = explanation.segments
        assert segments, "co-execution graph was cut into no segments"
        if all(s["state"] == "interpreted" for s in segments) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert explanation.phases["iterations"]["coexec"] >= 50
    assert all(s["state"] == "interpreted" and "no compiler in this test" in s["reason"] for s in segments), segments
    assert "stays interpreted: compiling failed" in str(explanation)


def _scalar_operand_arguments(op: torch._ops.OpOverload, operand: str) -> tuple[dict, float]:
    """Arguments for one scalar_operands() entry: a tensor for each Tensor argument (positive, so
    that divisions and powers are finite), 0.37 for the operand, defaults for the rest."""
    g = torch.Generator().manual_seed(7)
    number = 0.37
    arguments = {}
    for spec in op._schema.arguments:
        if spec.name == operand:
            arguments[spec.name] = number
        elif isinstance(spec.type, torch.TensorType):
            arguments[spec.name] = torch.rand(4, 5, generator=g) + 0.5
        elif spec.has_default_value():
            arguments[spec.name] = spec.default_value
        else:
            arguments[spec.name] = 2.0  # a constant Scalar (add.Scalar's other when alpha is the operand)
    return arguments, number


@pytest.mark.parametrize("entry", _C.emit.scalar_operands(), ids=lambda e: f"{e[0]}.{e[1] or 'default'}:{e[2]}")
def test_every_scalar_operand_has_a_tensor_form_that_agrees_with_the_op(entry) -> None:
    # segments.cpp lets a segment take these numbers at run time (emit/segments.h); _fused.py
    # must rewrite each op into tensor ops taking the number as a 0-dim float64 tensor, with the
    # op's dtype and values within the fused tolerance (and in place where the op is in place).
    name, overload, operand = entry
    op = _fused._overload(name, overload)
    arguments, number = _scalar_operand_arguments(op, operand)
    expected_inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in arguments.items()}
    expected = op(**expected_inputs)

    fx = torch.fx.Graph()
    nodes = {}
    for k, v in arguments.items():  # placeholders in argument order, called positionally
        if isinstance(v, torch.Tensor):
            nodes[k] = fx.placeholder(f"arg_{k}")
    nodes[operand] = _fused._ScalarOperand(fx.placeholder(f"arg_{operand}"))
    constants = {k: v for k, v in arguments.items() if k not in nodes}
    fx.output(_fused._rewrite_scalar_operands(fx, op, {**constants, **nodes}))
    module = torch.fx.GraphModule(torch.nn.Module(), fx)
    inputs = {k: v.clone() for k, v in arguments.items() if isinstance(v, torch.Tensor)}
    positional = [inputs[k] if k != operand else torch.tensor(number, dtype=torch.float64)
                  for k in arguments if k in nodes]
    got = module(*positional)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if name.endswith("_"):  # written in place into self, as the op writes
        torch.testing.assert_close(inputs["self"], expected_inputs["self"], rtol=1e-5, atol=1e-6)
        assert not torch.equal(inputs["self"], arguments["self"])


def _adam_program(seed: int):
    """An MLP with single-tensor Adam (foreach=False: one update per parameter, with step sizes
    Python computes each step) and its recorded step."""
    torch.manual_seed(seed)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)
    (x, y), = _data(1)
    return model, _recorded_step(model, opt, x, y)


def _same_fetches(a: graph.RunResult, b: graph.RunResult) -> bool:
    return len(a.fetched) == len(b.fetched) > 0 and all(
        s == t and torch.equal(u, v) for (s, u), (t, v) in zip(a.fetched, b.fetched))


def _outside_segments(text: str, op: str) -> int:
    """How many times `op` is called in the cut graph outside segment bodies."""
    return sum(1 for line in text.splitlines() if f"= {op}(" in line)


def test_a_per_parameter_optimizer_step_joins_segments_and_runs_bitwise_while_interpreted() -> None:
    # Adam's per-parameter updates take numbers computed each step (`addcdiv_(p, m, d,
    # value=-step_size)`, `div_(bias_correction2_sqrt)`) and read the step counter (`.item()`, a
    # fetch) between in-place writes: scalar operands, fetches moved after the call (reading a
    # copy) and `grad is None` Ifs staying in place let them join the segments. Interpreted,
    # the cut graph replays bit for bit what the uncut graph replays.
    model, rec = _adam_program(0)
    twin, twin_rec = _adam_program(0)
    g, twin_g = graph.build([rec]), graph.build([twin_rec])
    text = g._graph.fused.text
    for op in ("aten::addcdiv_", "aten::addcmul_", "aten::lerp_", "aten::sqrt"):
        assert _outside_segments(text, op) == 0, (op, text)
    assert len(g.segments) <= 3, g.segments  # forward/backward and the step, not one per parameter
    for _ in range(3):
        out = g.run(rec, mode="fused")
        expected = twin_g.run(twin_rec, mode="interpreter")
        assert torch.equal(out.outputs[0], expected.outputs[0])
        assert _same_fetches(out, expected)  # the step counters Python read, as they were
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)
    for group in twin.state_dict(), model.state_dict():
        assert all(torch.isfinite(v).all() for v in group.values())


def test_a_per_parameter_optimizer_step_runs_compiled_within_tolerance() -> None:
    model, rec = _adam_program(0)
    twin, twin_rec = _adam_program(0)
    g, twin_g = graph.build([rec]), graph.build([twin_rec])
    g.run(rec, mode="fused")
    twin_g.run(twin_rec, mode="interpreter")
    report = g.compile_segments()
    assert all(s["state"] == "loaded" for s in report), report
    tol = dict(rtol=1e-3, atol=1e-5)
    for _ in range(4):  # the check, then compiled code
        out = g.run(rec, mode="fused")
        expected = twin_g.run(twin_rec, mode="interpreter")
        torch.testing.assert_close(out.outputs[0], expected.outputs[0], **tol)
        # The step counters Python reads are counted by compiled code exactly (a write through
        # `lift_fresh` of the fresh counter once stayed in a copy: the counter never moved).
        assert len(out.reads) == len(expected.reads) == 4
        assert all(torch.equal(a, b) for a, b in zip(out.reads, expected.reads)), (out.reads, expected.reads)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, **tol)
    report = g.segments
    assert all(s["state"] == "trusted" and s["compiled_runs"] >= 1 for s in report), report


def test_coexecution_of_a_per_parameter_optimizer_with_segments_stays_exact_while_interpreted(monkeypatch) -> None:
    # In co-execution a feed waits for Python and still ends a stretch (a segment call waiting
    # for a number Python computes from a value the call publishes would never start); the rest
    # of the step's segments run interpreted and bit for bit eager's.
    _no_compiler(monkeypatch)

    def adam_with_steps(ps):
        opt = torch.optim.Adam(ps, lr=0.01, foreach=False)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)

    wrapped = _coexecute_like_eager(adam_with_steps)
    explanation = terra_torch.explain(wrapped)
    assert explanation.phases["iterations"]["coexec"] >= 40, str(explanation)
    assert explanation.segments, "co-execution graph was cut into no segments"


@pytest.mark.parametrize("setting, raised", [(None, 10), ("3", 3), ("0", 0)])
def test_the_compiler_process_runs_at_a_lower_priority(setting, raised) -> None:
    # The compiler child (python -m terra_torch._fused) lowers its own priority before compiling,
    # so that it takes the cores the training threads leave; TERRA_COMPILE_NICE sets by how much.
    env = {k: v for k, v in os.environ.items() if k != "TERRA_COMPILE_NICE"}
    if setting is not None:
        env["TERRA_COMPILE_NICE"] = setting
    code = ("import os; from terra_torch import _fused; before = os.getpriority(os.PRIO_PROCESS, 0); "
            "_fused._background_priority(); print(before, os.getpriority(os.PRIO_PROCESS, 0))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split())
    assert after == min(before + raised, 19), out.stdout


def test_optimize_must_be_a_known_value() -> None:
    with pytest.raises(ValueError, match="optimize must be False, True or 'fused'"):
        terra_torch.wrap(_mlp(), optimize="fast")


def test_coexecution_runs_compiled_segments_within_tolerance(tmp_path, monkeypatch) -> None:
    # The whole path: the background compiler (a child process per segment) compiles while the
    # program co-executes; once every segment is checked, steps run compiled code and stay
    # within the tolerance of eager's. Closing the program lets the packages go, and with them
    # the folders their loaders extracted them to (under $TMPDIR, read at each load).
    tempfile.gettempdir()  # (Python's own choice made before TMPDIR changes)
    extracted = tmp_path / "extracted"
    extracted.mkdir()
    monkeypatch.setenv("TMPDIR", str(extracted))
    monkeypatch.setenv("TERRA_FUSED_MIN_SPEEDUP", "1e-6")  # a speed trial, which keeps compiled code
    torch.manual_seed(0)
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    x = torch.randn(6, 8)
    y = torch.randint(0, 2, (6,))
    eager_model, net = make(), make()
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    wrapped = terra_torch.wrap(net, optimize="fused")
    program = wrapped._terra_program

    class Recorder(SpeedCheck):
        """Always co-executes; notes how many segments were settling at each measured iteration."""

        def __init__(self) -> None:
            super().__init__(True, probe=(0, 0))
            self.settling: list[int] = []

        def observe(self, mode: str, seconds: float, iteration: int, waited: float | None = None) -> str:
            self.settling.append(program._session.fused.settling())
            return COEXEC

    # The speed check measures no iteration in which loaded segments are checked or timed
    # (Program._speed_observe): those are slower than the steady ones.
    program._speed = check = Recorder()

    def step(model, optimizer) -> float:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    deadline = time.monotonic() + 600
    steps = 0
    while True:
        for _ in range(20):
            torch.testing.assert_close(step(wrapped, opt), step(eager_model, eager_opt), rtol=1e-3, atol=1e-5)
            steps += 1
        segments = terra_torch.explain(wrapped).segments or []
        if segments and all(s["state"] in ("trusted", "interpreted") for s in segments):
            break
        assert time.monotonic() < deadline, segments
    assert check.settling and not any(check.settling), check.settling
    held = steps - len(check.settling)  # (tracing iterations are not measured either)
    # (the check and 2 x 8 trial runs; Python runs at most two iterations ahead of the graph)
    assert held >= 12, (steps, len(check.settling))
    before = sum(s["compiled_runs"] for s in segments)
    for _ in range(30):
        torch.testing.assert_close(step(wrapped, opt), step(eager_model, eager_opt), rtol=1e-3, atol=1e-5)
    terra_torch.synchronize()
    for p, q in zip(net.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)
    segments = terra_torch.explain(wrapped).segments
    trusted = [s for s in segments if s["state"] == "trusted"]
    assert trusted, segments
    assert sum(s["compiled_runs"] for s in segments) >= before + 30
    # A folder per loader: segments with the same body and plan share one once a verdict on the
    # package is in (verdict_book); two handed it before that load it each.
    folders = len(list(extracted.glob("aotinductor_*")))
    assert len({s["package"] for s in trusted}) <= folders <= len(trusted)

    terra_torch.runtime.close_all()
    assert list(extracted.glob("aotinductor_*")) == []
    segments = terra_torch.explain(wrapped).segments
    assert sum(s["reason"] == "the program was closed" for s in segments) == len(trusted), segments


_HELD_AT_EXIT = '''
import glob, os, sys, tempfile
import torch
from terra_torch import graph
x, w = torch.randn(32, 32), torch.randn(32, 32)
def step():
    return ((x @ w) * 2 + 1).relu().sum()
rec = graph.record(step)
g = graph.build([rec])
g.run(rec, mode="fused")
g.compile_segments()
g.run(rec, mode="fused")  # the check: trusted from now on
held = [g]
held.append(held)  # a reference cycle: nothing frees the graph before the process ends
states = [s["state"] for s in g.segments]
print(states.count("trusted"), len(glob.glob(os.path.join(tempfile.gettempdir(), "aotinductor_*"))))
'''


def test_compiled_packages_of_a_graph_held_at_exit_leave_no_folder(tmp_path) -> None:
    # A graph Python still holds when the process ends is never destroyed, so its package
    # loaders would keep the folders they extracted the packages to (one per compiled segment,
    # ~1.5 MB). The exit hook closes every live FusedExecutor (FusedExecutor::close_every_live).
    extracted = tmp_path / "extracted"
    extracted.mkdir()
    env = dict(os.environ, TMPDIR=str(extracted), TERRA_CACHE_DIR=str(tmp_path / "cache"),
               TERRA_FUSED_MIN_SPEEDUP="0")
    out = subprocess.run([sys.executable, "-c", _HELD_AT_EXIT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    trusted, folders = map(int, out.stdout.split()[-2:])
    assert trusted >= 1 and folders == trusted, out.stdout  # one folder per loaded package while it ran
    assert list(extracted.glob("aotinductor_*")) == []
