"""Seeing what a running program did (issue 8): explain() of a wrapped model draws its branches
and merges, the timeline holds both runners, phase changes are logged, and a program that keeps
diverging is warned about once per site while one that converges is not."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch
from terra_torch import runtime
from terra_torch._log import TerraDivergenceWarning

_g = torch.Generator().manual_seed(7)
DATA = [(torch.randn(4, 8, generator=_g), torch.randn(4, 1, generator=_g)) for _ in range(5)]


@pytest.fixture(autouse=True)
def _isolated():
    yield
    runtime.close_all()


def train(model: nn.Module, steps: int, extra=None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(steps):
        x, y = DATA[i % len(DATA)]
        loss = F.mse_loss(model(x), y)
        if loss > 1.0:  # a branch on a tensor value
            loss = loss * 0.5
        if extra is not None:
            loss = loss + extra(i, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    terra_torch.synchronize()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_explain_draws_the_branch_of_a_running_program(tmp_path):
    m = terra_torch.wrap(mlp())
    train(m, 12)
    e = terra_torch.explain(m)
    assert e.switches >= 1 and e.nodes > 10
    assert "prim::If" in e.graph_text and "terra::case_select" in e.graph_text
    assert e.phases["iterations"]["coexec"] > 0
    dot = e.to_dot()
    assert "switch" in dot and "merge" in dot and "aten::mul.Tensor" in dot
    assert "test_observe_runtime.py" in dot  # nodes are labelled by the user's source lines
    terra_torch.unwrap(m)


def test_timeline_holds_both_runners(tmp_path):
    m = terra_torch.wrap(mlp())
    train(m, 10)
    path = tmp_path / "timeline.json"
    terra_torch.timeline(m).save(path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert {"PythonRunner", "GraphRunner"} <= names
    spans = [e for e in events if e.get("ph") == "X"]
    by_thread = {e["tid"] for e in spans}
    assert len(by_thread) == 2  # iterations on the Python side, graph runs on the worker
    assert any(e["name"].startswith("graph run") for e in spans)
    assert any(e.get("ph") == "i" and "coexec" in e["name"] for e in events)  # the phase change
    terra_torch.unwrap(m)


def test_the_session_logs_every_coexecuted_iteration():
    # The iteration boundary no longer reads clocks and counters in Python: the session keeps one
    # span per co-executed iteration. It must agree with the phase machine's own counts, in order,
    # and its sums are what stats() reports.
    m = terra_torch.wrap(mlp(), speed_check=False)
    train(m, 12)
    program = m._terra_program
    spans = program._session.iteration_spans()
    s = terra_torch.stats(m)
    assert len(spans) == s.iterations["coexec"] > 0
    iterations = [sp[0] for sp in spans]
    assert iterations == sorted(iterations) and len(set(iterations)) == len(iterations)
    assert iterations[-1] == program.iteration - 1  # (synchronize() ended the last one)
    for _it, start, end, stall, decisions, feeds, reads in spans:
        assert 0 < start < end and 0 <= stall <= end - start
        assert decisions > 0 and feeds > 0  # every iteration posts its path and its batch
    assert s.python_stall_s == pytest.approx(sum(sp[3] for sp in spans) / 1e9)
    assert s.python_exec_s == pytest.approx(sum(sp[2] - sp[1] - sp[3] for sp in spans) / 1e9)
    terra_torch.unwrap(m)


def test_phase_changes_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="terra_torch"):
        m = terra_torch.wrap(mlp())
        train(m, 6)
        terra_torch.unwrap(m)
    assert any("tracing -> coexec" in r.getMessage() for r in caplog.records)


def test_warns_once_for_a_program_that_keeps_diverging():
    # Odd iterations call an op no iteration called there before (a slice width would not do:
    # ints are fed, issue 16): each time the graph has just been generated from an even
    # iteration, the next odd one leaves it.
    ops = [torch.sin, torch.cos, torch.tanh, torch.exp, torch.sigmoid, torch.relu, torch.abs]

    def extra(i, x):
        return 0.0 * ops[(i // 2) % 7](x).sum() if i % 2 else 0.0 * x.sum()

    m = terra_torch.wrap(mlp())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(m, 24, extra)
    diverging = [w for w in caught if issubclass(w.category, TerraDivergenceWarning)]
    assert len(diverging) == 1, [str(w.message) for w in caught]
    assert "test_observe_runtime.py" in str(diverging[0].message)
    assert terra_torch.stats(m).fallbacks > 3
    terra_torch.unwrap(m)


def test_no_warning_for_a_program_that_converges():
    m = terra_torch.wrap(mlp())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(m, 24)
    assert not [w for w in caught if issubclass(w.category, TerraDivergenceWarning)]
    assert terra_torch.stats(m).fallbacks == 0
    terra_torch.unwrap(m)
