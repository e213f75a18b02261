"""The observability pieces of issue 8, checked without the co-execution runtime.

* `_C.emit.Graph.to_dot` / `.graph` / `.structure` on recordings of a function with a branch on
  a Python bool and a Python for loop: the picture shows both cases, the merge and the loop;
* `terra_torch.explanation`: the Explanation summary, DOT and PNG (Graphviz permitting);
* `terra_torch.chrome_trace`: Chrome trace JSON from two threads;
* `terra_torch._log`: TERRA_LOG levels, the phase-transition line, the divergence warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from terra_torch import _log, graph
from terra_torch.explanation import Fallback, explanation_from
from terra_torch.chrome_trace import Timeline

HERE = os.path.basename(__file__)
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")


def step(x: torch.Tensor, flag: bool, n: int) -> torch.Tensor:
    y = x * 2
    if flag:
        y = y + 1
    else:
        y = y - 1
    for _ in range(n):
        y = y * 1.5 + 1  # two ops per iteration: the body's position goes back each iteration
    return y.sum()


LINE_ADD = step.__code__.co_firstlineno + 3  # y = y + 1
LINE_LOOP_BODY = step.__code__.co_firstlineno + 7


@pytest.fixture(scope="module")
def built() -> graph.Graph:
    a = graph.record(step, torch.arange(4.0), True, 2)
    b = graph.record(step, torch.arange(4.0), False, 3)
    return graph.build([a, b])


# ---- the binding -----------------------------------------------------------------------------


def test_to_dot_shows_both_cases_the_merge_and_the_loop(built: graph.Graph):
    dot = built._graph.to_dot("two iterations")
    assert dot.startswith("digraph terra {") and dot.rstrip().endswith("}")
    # one switch (the if on flag), its two cases, and the merge where both paths meet the loop
    assert len(re.findall(r"shape=diamond", dot)) == 1
    assert 'label="case 0"' in dot and 'label="case 1"' in dot
    assert len(re.findall(r"\[shape=invtriangle[^\]]*label=\"merge\"", dot)) == 1
    # the loop: a cluster; trip counts differ (2, 3), so it is a while loop with a loop-cond site
    assert len(re.findall(r"subgraph cluster_loop_\d+ \{", dot)) == 1
    assert re.search(r"while, loop_cond s\d+\\ntrips 2, 3", dot)
    assert "next iteration (s" in dot
    # op names from the operator, source lines from the capture's locations
    assert "aten::add.Tensor" in dot and "aten::sub.Tensor" in dot and "aten::mul.Tensor" in dot
    assert f"{HERE}:{LINE_ADD}" in dot
    assert f"{HERE}:{LINE_LOOP_BODY}" in dot
    assert f"body starts at {HERE}:{LINE_LOOP_BODY}" in dot
    assert 'label="two iterations"' in dot
    assert dot == built._graph.to_dot("two iterations")  # deterministic


def test_structure_counts(built: graph.Graph):
    s = built._graph.structure
    assert s["traces"] == 2
    assert s["loops"] == 1 and s["while_loops"] == 1 and s["unrolled_loops"] == 0
    assert s["switches"] == 1
    assert s["branch_points"] == 1
    assert s["merge_points"] >= 1
    assert s["ops"] > 0 and s["nodes"] > s["ops"]


def test_graph_property_is_the_torchscript_graph(built: graph.Graph):
    g = built._graph.graph
    assert isinstance(g, torch._C.Graph)
    assert str(g) == built.text
    assert any(n.kind() == "prim::Loop" for n in g.nodes())


def test_backward_ops_are_placed_at_their_forward_line():
    w = torch.ones(3, requires_grad=True)

    def train(x: torch.Tensor) -> torch.Tensor:
        loss = (x * w).relu().sum()
        loss.backward()
        return loss.detach()

    line = train.__code__.co_firstlineno + 1
    g = graph.build([graph.record(train, torch.arange(3.0))])
    dot = g._graph.to_dot()
    assert f"aten::threshold_backward\\n{HERE}:{line} (backward)" in dot
    # a backward node with no forward op of the user's is named by the node itself
    assert "AccumulateGrad op 0 (backward)" in dot and "backward: " not in dot


@needs_dot
def test_dot_output_is_valid_graphviz(built: graph.Graph):
    done = subprocess.run(["dot", "-Tsvg"], input=built._graph.to_dot(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "<svg" in done.stdout


# ---- Explanation -----------------------------------------------------------------------------


def test_explanation_from_graph(built: graph.Graph):
    fallbacks = [Fallback(3, "branch took a new path", f"{HERE}:{LINE_ADD}"),
                 (4, "branch took a new path", f"{HERE}:{LINE_ADD}"),
                 (7, "shape changed", None)]
    ex = explanation_from(built, {"tracing": 2, "coexecuting": 10}, fallbacks)
    assert ex.nodes == built._graph.structure["nodes"]
    assert ex.switches == 1 and ex.loops == 1 and ex.unrolled_loops == 0
    assert ex.graph_text == built.text
    assert ex.fallbacks[1] == Fallback(4, "branch took a new path", f"{HERE}:{LINE_ADD}")
    text = str(ex)
    assert "1 switch," in text and "1 loop" in text
    assert "phases: tracing=2, coexecuting=10" in text
    assert "fallbacks: 3" in text
    assert f"{HERE}:{LINE_ADD}: 2 times (iteration 3, 4): branch took a new path" in text
    assert "unknown line: 1 time (iteration 7): shape changed" in text
    dot = ex.to_dot()
    assert "case 1" in dot and "cluster_loop_" in dot
    assert "1 switch, 1 loop, 3 fallbacks" in dot  # the title
    # graph_text given explicitly wins (the runtime may run a different graph)
    assert explanation_from(built, {}, [], graph_text="graph()").graph_text == "graph()"


def test_explanation_without_graph():
    ex = explanation_from(None, {"tracing": 1}, [])
    assert not ex.has_graph and ex.nodes == 0 and ex.graph_text is None
    assert "no graph built yet" in str(ex)
    assert "no graph built yet" in ex.to_dot()


@needs_dot
def test_save_png_writes_a_png(built: graph.Graph, tmp_path):
    path = tmp_path / "graph.png"
    explanation_from(built, {}, []).save_png(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_png_without_graphviz_says_what_to_install(built: graph.Graph, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` there
    with pytest.raises(RuntimeError, match="install Graphviz"):
        explanation_from(built, {}, []).save_png(tmp_path / "x.png")


# ---- Timeline --------------------------------------------------------------------------------


def test_timeline_from_two_threads_is_chrome_trace_json(tmp_path):
    tl = Timeline(origin_ns=1_000_000)
    per_thread = 200

    def python_runner() -> None:
        for i in range(per_thread):
            tl.complete(f"validate {i}", "exec", "PythonRunner", 1_000_000 + i * 10_000, 2_500)
            tl.instant("decision", "decision", "PythonRunner", 1_000_000 + i * 10_000, {"site": 0})

    def graph_runner() -> None:
        for i in range(per_thread):
            tl.complete(f"iteration {i}", "exec", "GraphRunner", 1_000_000 + i * 10_000, 7_000, {"i": i})
            tl.complete("wait feed", "stall", "GraphRunner", 1_007_000 + i * 10_000, 1_000)

    threads = [threading.Thread(target=python_runner), threading.Thread(target=graph_runner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tl.counter("queue", {"decisions": 3}, 1_500_000)
    assert len(tl) == 4 * per_thread + 1 and tl.dropped == 0

    path = tmp_path / "timeline.json"
    tl.save(path)
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"PythonRunner": 1, "GraphRunner": 2}
    assert all(e["pid"] == 1 for e in events)
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 3 * per_thread
    first = next(e for e in complete if e["name"] == "iteration 0")
    assert first["tid"] == 2 and first["ts"] == 0.0 and first["dur"] == 7.0  # microseconds
    assert first["args"] == {"i": 0} and first["cat"] == "exec"
    assert next(e for e in complete if e["name"] == "validate 1")["ts"] == 10.0
    assert {e["dur"] for e in complete if e["tid"] == 1} == {2.5}
    instants = [e for e in events if e["ph"] == "i"]
    assert len(instants) == per_thread and all(e["s"] == "t" and e["cat"] == "decision" for e in instants)
    (counter,) = [e for e in events if e["ph"] == "C"]
    assert counter["args"] == {"decisions": 3} and counter["ts"] == 500.0


def test_timeline_categories_span_new_threads_and_bound():
    tl = Timeline(max_events=3)
    with pytest.raises(ValueError, match="unknown category"):
        tl.instant("x", "exce", "PythonRunner")
    for cat in ("exec", "stall", "feed", "fetch", "decision", "fallback"):
        tl.instant(cat, cat, "PythonRunner")
    assert len(tl) == 3 and tl.dropped == 3  # the oldest go first
    with tl.span("materialize", "fetch", "Materializer"):
        time.sleep(0.001)
    events = json.loads(tl.to_json())["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert names["Materializer"] == 3
    (span,) = [e for e in events if e["ph"] == "X"]
    assert span["tid"] == 3 and span["dur"] >= 1000.0


# ---- logging and the divergence warning ------------------------------------------------------


def test_divergence_warning_for_a_site_diverging_every_iteration():
    mon = _log.DivergenceMonitor(n=3, m=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        issued = [mon.record(i, "train.py:12", "branch on loss value") for i in range(20)]
    assert issued == [False, False, False, True] + [False] * 16  # the 4th within 10: once
    assert len(caught) == 1
    w = caught[0]
    assert issubclass(w.category, _log.TerraDivergenceWarning)
    message = str(w.message)
    assert "train.py:12" in message and "branch on loss value" in message
    assert "fixed per run" in message and "eager" in message


def test_no_warning_for_a_site_that_converged_and_once_per_site():
    mon = _log.DivergenceMonitor(n=3, m=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in (0, 1, 2):  # tracing learns three paths, then the site is covered
            mon.record(i, "model.py:40", "new path")
        for i in (12, 25, 40, 41, 60):  # rare later fallbacks: never more than 3 in 10
            mon.record(i, "model.py:40", "new path")
        assert caught == []
        # another site, named by a key plus its line, diverging every other iteration
        for i in range(0, 30, 2):
            mon.record(i, ("node", 17), "trip count changed", source_line="model.py:55")
    assert len(caught) == 1 and "model.py:55" in str(caught[0].message)
    assert mon.warned(("node", 17)) and not mon.warned("model.py:40")
    with pytest.raises(ValueError):
        _log.DivergenceMonitor(n=3, m=0)


@pytest.fixture
def restore_log_config():
    yield
    _log.configure()


def test_terra_log_levels(restore_log_config):
    assert _log.configure("debug").level == logging.DEBUG
    assert _log.configure("INFO").level == logging.INFO
    assert _log.configure("warning").level == logging.WARNING
    assert _log.configure("").level == logging.WARNING  # unset: the default
    assert not any(isinstance(h, _log._StderrUnlessConfigured) for h in _log.logger.handlers)
    assert _log.configure("chatty").level == logging.WARNING


def test_phase_transition_is_one_info_line(restore_log_config, caplog):
    _log.configure("info")
    with caplog.at_level(logging.INFO, logger="terra_torch"):
        _log.phase_transition("Net", "tracing", "coexecuting", 3, "iteration covered by the graph")
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.name == "terra_torch"
    assert record.getMessage() == "Net: tracing -> coexecuting at iteration 3 (iteration covered by the graph)"


def test_terra_log_env_var_in_a_fresh_process():
    code = (
        "import logging; from terra_torch import _log; "
        "print(logging.getLevelName(_log.logger.getEffectiveLevel())); "
        "_log.logger.debug('hello from terra')"
    )
    env = dict(os.environ, TERRA_LOG="debug")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DEBUG"
    # no application handlers in that process: terra_torch's own handler prints to stderr
    assert "terra_torch DEBUG: hello from terra" in done.stderr
    env.pop("TERRA_LOG")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "WARNING" and "hello" not in done.stderr


def test_the_summary_counts_waiting_and_too_small_segments_on_one_line_each() -> None:
    # optimize="fused": a long loop body has dozens of segments too small to compile; they are
    # one line, with the largest first run, and the ones waiting for the compiler another.
    def seg(state: str, reason: str = "", ops: int = 3, first_run_us: float = 0.0) -> dict:
        return {"ops": ops, "state": state, "reason": reason, "inlined": state != "trusted",
                "first_run_us": first_run_us}

    small = "its first run took {} us, under the 10 us (TERRA_FUSED_MIN_SEGMENT_US) that a call ..."
    segments = ([seg("trusted", ops=20)] + [seg("requested")] * 2 +
                [seg("interpreted", small.format(u), ops=2, first_run_us=u) for u in (4.5, 8.25, 6.0)] +
                [seg("interpreted", "compiled code was slower than the interpreter: 13 us against 9 us", ops=5)])
    text = str(explanation_from(None, {}, [], segments=segments))
    assert "compiled segments: 1 of 7 run compiled (20 of 37 ops)" in text
    assert "2 segments waiting for the compiler" in text
    assert "3 segments (6 ops) not compiled: each ran in under 8.25 us" in text
    assert text.count("stays interpreted") == 1 and "segment 6 (5 ops, in place) stays interpreted" in text
