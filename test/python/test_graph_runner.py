"""The GraphRunner thread and the concurrent channel, driven from Python, against eager PyTorch.

Programs are recorded eagerly (terra_torch.graph.record); the generated graph runs on the
GraphRunner's C++ thread while this test's thread plays the PythonRunner: it posts each
iteration's decisions and external tensors (from the recording), often only after the worker
has blocked waiting for them, and waits for the fetched values, which must equal eager results
bit for bit. Every wait has a timeout so that a bug fails a test instead of hanging it.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from terra_torch import _C, _runtime, graph

TIMEOUT = 60.0  # seconds; generous for a loaded 2-core machine


@pytest.fixture
def runners():
    """Runners made by a test, shut down even when it fails."""
    made = []
    yield made
    for r in made:
        r.shutdown()


def wait_until_blocked(channel, timeout: float = TIMEOUT):
    """Poll until the graph thread is blocked on the channel; returns what it waits for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waiting = channel.graph_waiting_for()
        if waiting is not None:
            return waiting
        time.sleep(0.001)
    pytest.fail("the graph thread never blocked on the channel")


def run_after_block(runner, script):
    """Start the iteration first, let the worker block on the channel, then post: the worker must
    resume and produce the same values as when everything was posted up front."""
    runner.start_iteration()
    wait_until_blocked(runner.channel)
    _runtime.post(runner.channel, script)
    out = _runtime.collect(runner.channel, script, TIMEOUT)
    runner.wait_iteration(TIMEOUT)
    assert runner.channel.leftovers() == ""
    return out


def in_thread(fn, timeout: float = TIMEOUT):
    """Run fn in a Python thread; returns (finished in time, its result or exception)."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), box


# ---- an if on a tensor value ------------------------------------------------------------------


def branchy(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:
        y = x * 2
    else:
        y = x - 1
    return y.exp()


def branch_recordings():
    pos = graph.record(branchy, torch.linspace(-1.0, 2.0, 5))
    neg = graph.record(branchy, torch.linspace(-2.0, 1.0, 5))
    return pos, neg


@pytest.mark.parametrize("mode", ["interpreter", "graph_executor"])
def test_if_on_tensor_value_over_iterations(runners, mode):
    pos, neg = branch_recordings()
    plan = _runtime.Plan([pos, neg])
    assert plan.text == graph.build([pos, neg]).text  # the graph terra_torch.graph makes
    assert plan.sites == ["case"]
    runner = plan.runner(mode)
    runners.append(runner)
    for rec in (pos, neg, neg, pos, pos, neg):
        out = run_after_block(runner, plan.script(rec))
        assert torch.equal(out.outputs[0], rec.outputs[0])
        assert [bool(r) for r in out.reads] == [rec is pos]  # the value Python branched on
    stats = runner.stats
    assert stats["iterations_run"] == 6 and stats["iterations_failed"] == 0
    assert stats["graph_stall_ns"] > 0  # it did block: each iteration waited for its first feed


def test_python_waiter_releases_the_gil(runners):
    """A thread blocked in wait_fetch must not hold the GIL, or the poster could never post."""
    pos, neg = branch_recordings()
    plan = _runtime.Plan([pos, neg])
    runner = plan.runner()
    runners.append(runner)
    script = plan.script(neg)
    runner.start_iteration()
    finished = {}
    calling = threading.Event()

    def waiter():
        calling.set()
        finished["out"] = _runtime.collect(runner.channel, script)  # no timeout: blocks

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    wait_until_blocked(runner.channel)
    # The stall counter below needs the waiter inside wait_fetch before the post; the channel
    # cannot say when it is, so give it the GIL for a while after it announced the call (under
    # load it once posted first and the counter stayed 0).
    assert calling.wait(TIMEOUT)
    time.sleep(0.05)
    _runtime.post(runner.channel, script)
    t.join(TIMEOUT)
    assert not t.is_alive(), "the waiting thread never woke"
    runner.wait_iteration(TIMEOUT)
    assert torch.equal(finished["out"].outputs[0], neg.outputs[0])
    assert runner.channel.stats["python_stall_ns"] > 0


def test_runner_accepts_a_torch_graph(runners):
    pos, neg = branch_recordings()
    plan = _runtime.Plan([pos, neg])
    assert isinstance(plan.graph, torch._C.Graph)
    runner = _C.runtime.GraphRunner(plan.graph)
    runners.append(runner)
    out = _runtime.run_iteration(runner, plan.script(pos), TIMEOUT)
    assert torch.equal(out.outputs[0], pos.outputs[0])


# ---- a loop with a varying trip count -----------------------------------------------------------


def python_loop(x: torch.Tensor, n: int) -> torch.Tensor:
    y = x
    for _ in range(n):
        y = y * 1.5 + 1
    return y


def test_loop_with_varying_trip_count(runners):
    recs = {n: graph.record(python_loop, torch.arange(4.0) - n, n) for n in (2, 3, 5)}
    plan = _runtime.Plan(list(recs.values()))
    assert plan.sites == ["loop"]
    assert "prim::Loop" in plan.text
    runner = plan.runner()
    runners.append(runner)
    for n in (3, 2, 5, 5, 2, 3):
        script = plan.script(recs[n])
        assert [v for _, v in script.decisions] == [1] * (n - 1) + [0]
        out = run_after_block(runner, script)
        assert torch.equal(out.outputs[0], recs[n].outputs[0])


def test_iterations_queue_and_python_posts_ahead(runners):
    """Per-site and per-slot FIFOs let Python post several iterations ahead of the graph."""
    recs = {n: graph.record(python_loop, torch.arange(4.0) * n, n) for n in (1, 4)}
    plan = _runtime.Plan(list(recs.values()))
    runner = plan.runner()
    runners.append(runner)
    order = [4, 1, 1, 4, 1]
    scripts = [plan.script(recs[n]) for n in order]
    for s in scripts:
        runner.start_iteration()
        _runtime.post(runner.channel, s)
    for n, s in zip(order, scripts):
        out = _runtime.collect(runner.channel, s, TIMEOUT)
        assert torch.equal(out.outputs[0], recs[n].outputs[0])
    runner.synchronize(TIMEOUT)
    assert runner.in_flight == 0 and runner.channel.leftovers() == ""
    assert runner.stats["iterations_run"] == len(order)


def test_poster_and_collector_threads_stream_many_iterations(runners):
    """Python posting from one thread and reading from another while the graph runs."""
    recs = {n: graph.record(python_loop, torch.arange(3.0) + n, n) for n in (1, 2, 6)}
    plan = _runtime.Plan(list(recs.values()))
    runner = plan.runner()
    runners.append(runner)
    order = [(1, 2, 6)[(7 * i) % 3] for i in range(60)]
    scripts = [plan.script(recs[n]) for n in order]
    results = []

    def poster():
        for s in scripts:
            runner.start_iteration()
            _runtime.post(runner.channel, s)

    def collector():
        for s in scripts:
            results.append(_runtime.collect(runner.channel, s, TIMEOUT))

    threads = [threading.Thread(target=f, daemon=True) for f in (collector, poster)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    runner.synchronize(TIMEOUT)
    assert len(results) == len(order)
    for n, out in zip(order, results):
        assert torch.equal(out.outputs[0], recs[n].outputs[0])
    assert runner.stats["iterations_run"] == len(order) and runner.channel.leftovers() == ""


def test_cancel_at_an_arbitrary_point_leaves_a_usable_runner(runners):
    recs = {n: graph.record(python_loop, torch.arange(3.0), n) for n in (2, 5)}
    plan = _runtime.Plan(list(recs.values()))
    runner = plan.runner()
    runners.append(runner)
    for _ in range(20):
        runner.start_iteration()
        _runtime.post(runner.channel, plan.script(recs[5]))
    runner.cancel("enough")
    try:
        runner.synchronize(TIMEOUT)
    except RuntimeError as e:
        assert "enough" in str(e)
    assert runner.in_flight == 0
    stats = runner.stats
    assert stats["iterations_run"] + stats["iterations_failed"] == 20
    runner.reset()
    out = run_after_block(runner, plan.script(recs[2]))
    assert torch.equal(out.outputs[0], recs[2].outputs[0])


# ---- an MLP training step -------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _recorded_sgd_steps(seed: int, lrs: list[float]):
    """One recorded SGD step of an MLP per learning rate: (parameters, a copy of each for the
    runner to train keyed by id, [(recording, the parameters after eager's step)])."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=lrs[0])
    params = list(model.parameters())
    ours = {id(p): p.detach().clone() for p in params}
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for lr in lrs:
        opt.param_groups[0]["lr"] = lr
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        rec = graph.record(train_step, model, opt, x, y)
        steps.append((rec, [p.detach().clone() for p in params]))
    return params, ours, steps


@pytest.mark.parametrize("mode", ["interpreter", "graph_executor"])
def test_mlp_sgd_training_matches_eager(runners, mode):
    """The runner trains its own copy of the parameters: each step's graph updates the fed
    tensors in place, and after every iteration they equal eager's parameters bitwise."""
    params, ours, steps = _recorded_sgd_steps(seed=3, lrs=[0.1] * 4)
    plan = _runtime.Plan([rec for rec, _ in steps])
    assert "aten::threshold_backward" in plan.text
    runner = plan.runner(mode)
    runners.append(runner)
    for rec, after in steps:
        externals = [ours.get(id(t), t) for t in rec.externals]
        assert sum(id(t) in ours for t in rec.externals) == len(params)
        out = run_after_block(runner, plan.script(rec, externals))
        assert torch.equal(out.outputs[0], rec.outputs[0])
        for p, want in zip(params, after):
            assert torch.equal(ours[id(p)], want), "a parameter update differs from eager"


def test_a_learning_rate_schedule_replays_through_scalar_feeds(runners):
    """A learning rate that changes every step is a Python number fed per iteration
    (terra::feed_scalar): the recorded scripts carry it (Script.scalars), and the replayed steps
    update the parameters exactly as eager did, each with its own learning rate."""
    params, ours, steps = _recorded_sgd_steps(seed=5, lrs=[0.1 / (k + 1) for k in range(4)])
    plan = _runtime.Plan([rec for rec, _ in steps])
    assert "terra::feed_scalar" in plan.text
    runner = plan.runner()
    runners.append(runner)
    for rec, after in steps:
        script = plan.script(rec, [ours.get(id(t), t) for t in rec.externals])
        assert script.scalars  # the learning rate, once per parameter update
        out = run_after_block(runner, script)
        assert torch.equal(out.outputs[0], rec.outputs[0])
        for p, want in zip(params, after):
            assert torch.equal(ours[id(p)], want), "a parameter update differs from eager"


# ---- cancellation, errors, shutdown -----------------------------------------------------------


def test_cancel_while_blocked_on_a_feed(runners):
    pos, neg = branch_recordings()
    plan = _runtime.Plan([pos, neg])
    runner = plan.runner()
    runners.append(runner)
    channel = runner.channel
    script = plan.script(pos)

    runner.start_iteration()
    assert wait_until_blocked(channel)[0] == "feed"
    fetch_slot = script.fetches[0][0]
    box = {}

    def waiter():  # a Python thread waiting for a value the cancelled graph will never publish
        try:
            channel.wait_fetch(fetch_slot)
        except RuntimeError as e:
            box["error"] = e

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.05)  # most likely blocked by now; if not, it meets the cancel on arrival
    runner.cancel("stopped by the test")
    t.join(TIMEOUT)
    assert not t.is_alive(), "cancel did not wake the Python waiter"
    assert "stopped by the test" in str(box.get("error"))
    with pytest.raises(RuntimeError, match="graph iteration 0 was cancelled: stopped by the test"):
        runner.wait_iteration(TIMEOUT)
    with pytest.raises(RuntimeError, match="cancelled"):
        channel.post_feed(0, torch.zeros(1))  # refused until reset

    runner.reset()
    assert not channel.cancelled and channel.leftovers() == ""
    out = run_after_block(runner, plan.script(neg))
    assert torch.equal(out.outputs[0], neg.outputs[0])
    assert runner.stats["iterations_failed"] == 1 and runner.stats["iterations_run"] == 1


def matmul_relu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).relu()


def test_error_inside_the_graph_propagates_with_its_message(runners):
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    rec = graph.record(matmul_relu, x, w)
    plan = _runtime.Plan([rec])
    runner = plan.runner()
    runners.append(runner)
    bad = plan.script(rec, [torch.randn(3, 5) if t is x else t for t in rec.externals])

    runner.start_iteration()
    _runtime.post(runner.channel, bad)
    # a Python waiter for a value the failed graph will never produce is woken with an error
    with pytest.raises(RuntimeError, match="graph iteration 0 failed"):
        _runtime.collect(runner.channel, bad, TIMEOUT)
    with pytest.raises(RuntimeError, match="terra_torch: graph iteration 0 failed") as failure:
        runner.wait_iteration(TIMEOUT)
    assert "mat1 and mat2 shapes cannot be multiplied (3x5 and 4x2)" in str(failure.value)
    assert runner.stats["iterations_failed"] == 1

    runner.reset()
    out = _runtime.run_iteration(runner, plan.script(rec), TIMEOUT)
    assert torch.equal(out.outputs[0], rec.outputs[0])


def test_protocol_misuse_is_reported(runners):
    pos, neg = branch_recordings()
    plan = _runtime.Plan([pos, neg])
    runner = plan.runner()
    runners.append(runner)
    with pytest.raises(RuntimeError, match="no iteration started"):
        runner.wait_iteration(TIMEOUT)
    with pytest.raises(TimeoutError):
        runner.channel.wait_fetch(0, timeout=0.05)
    runner.start_iteration()
    wait_until_blocked(runner.channel)
    with pytest.raises(TimeoutError):
        runner.wait_iteration(timeout=0.05)
    with pytest.raises(RuntimeError, match="in flight"):
        runner.reset()
    out = _runtime.collect(runner.channel, _post(runner, plan.script(pos)), TIMEOUT)
    runner.wait_iteration(TIMEOUT)
    assert torch.equal(out.outputs[0], pos.outputs[0])


def _post(runner, script):
    _runtime.post(runner.channel, script)
    return script


def test_shutdown_with_an_iteration_blocked():
    pos, neg = branch_recordings()
    plan = _runtime.Plan([pos, neg])
    runner = plan.runner()
    runner.start_iteration()
    runner.start_iteration()  # queued behind the blocked one: must not run
    wait_until_blocked(runner.channel)
    finished, box = in_thread(runner.shutdown)
    assert finished, "shutdown() hung on a blocked iteration"
    assert "error" not in box
    assert runner.is_shut_down and runner.in_flight == 0
    with pytest.raises(RuntimeError, match="graph iteration 0 was cancelled: the GraphRunner was shut down"):
        runner.wait_iteration(TIMEOUT)
    with pytest.raises(RuntimeError, match="graph iteration 1 did not run"):
        runner.wait_iteration(TIMEOUT)
    with pytest.raises(RuntimeError, match="after the GraphRunner was shut down"):
        runner.start_iteration()
    runner.shutdown()  # idempotent


def test_destroying_a_runner_with_an_iteration_blocked_does_not_hang():
    pos, neg = branch_recordings()
    plan = _runtime.Plan([pos, neg])

    def make_and_drop():
        runner = plan.runner()
        runner.start_iteration()
        wait_until_blocked(runner.channel)
        del runner  # the destructor cancels and joins, with the GIL released
        gc.collect()

    finished, box = in_thread(make_and_drop)
    assert finished, "destroying the runner hung"
    assert "error" not in box, box.get("error")


EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit
    state = {}

    def report():  # registered before terra_torch's hook, so it runs after it (LIFO)
        print("shut down" if state["runner"].is_shut_down else "still running", flush=True)

    atexit.register(report)

    import torch
    from terra_torch import _runtime, graph

    def branchy(x):
        if x.sum() > 0:
            return x * 2
        return x - 1

    recs = [graph.record(branchy, torch.full((3,), v)) for v in (1.0, -1.0)]
    runner = state["runner"] = _runtime.Plan(recs).runner()
    runner.start_iteration()
    runner.channel.post_feed(0, torch.ones(3))  # consumed; the worker then blocks again
    while runner.channel.graph_waiting_for() is None or runner.channel.stats["feeds"] == 0:
        pass
    print("blocked", flush=True)
    # exit with the worker blocked and the runner alive: the atexit hook must shut it down
    """
)


def test_interpreter_exit_with_an_iteration_blocked(tmp_path):
    script = tmp_path / "exit_blocked.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["blocked", "shut", "down"], proc.stdout
