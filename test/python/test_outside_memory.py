"""Tensors whose memory comes from outside the program: unpickled ones (torch.load, and every batch
a DataLoader's worker processes send), and processes forked while an iteration is open.

Unpickling builds a tensor as `torch.empty((0,)).set_(storage, ...)`; the set_ is not an op the
graph can hold, so such loops never co-executed (capture/region.cpp, adopt_outside_memory). A
DataLoader forks its workers at iter(loader), inside the training loop when a step function
spans an epoch: the workers inherited the open region and hung the program
(runtime.py, _after_fork_in_child). Every program is compared bit for bit with eager."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import terra_torch
from bitwise_runs import check_bitwise

STEPS = 50


def _saved_batches(n: int = 4) -> list[bytes]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        x = torch.randn(8, 6, generator=g)
        torch.save((x, (x.sum(1) > 0).long()), buf)
        out.append(buf.getvalue())
    return out


def _mlp():
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_torch_load_per_step_co_executes():
    batches = _saved_batches()

    def step(model, opt, i):
        x, y = torch.load(io.BytesIO(batches[i % len(batches)]))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(_mlp, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 5, stats.iterations
    assert not fallbacks, [f.reason for f in fallbacks]


def test_torch_load_in_a_loop_of_the_iteration():
    """One iteration loads several batches (a step function spanning them): each load's
    empty() is an op nothing reads, and the graph is fed the loaded tensor, never that value
    (materializing it at the end bound the empty() value into the loaded tensor and raised)."""
    batches = _saved_batches()

    def run(terra: bool):
        torch.manual_seed(0)
        model, opt = _mlp()

        def epoch(e: int) -> torch.Tensor:
            losses = []
            for b in batches:
                x, y = torch.load(io.BytesIO(b))
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            return torch.stack(losses)

        if terra:
            epoch = terra_torch.function(epoch)
        out = torch.stack([epoch(e) for e in range(12)])
        terra_torch.synchronize()
        info = terra_torch.stats(epoch) if terra else None
        return out, [p.detach().clone() for p in model.parameters()], info

    la, pa, _ = run(False)
    lb, pb, stats = run(True)
    assert torch.equal(la, lb)
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert stats.iterations["coexec"] >= 8, stats.iterations


def test_dataloader_with_worker_processes_co_executes():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 6, generator=g)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    loader = DataLoader(data, batch_size=32, num_workers=2, persistent_workers=True)
    batches: list = []

    def step(model, opt, i):
        if i % 16 == 0:
            batches[:] = [iter(loader)]
        xb, yb = next(batches[0])
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), tuple(xb.shape)

    stats, fallbacks = check_bitwise(_mlp, step, 48)
    assert stats.iterations["coexec"] >= 40, stats.iterations
    assert not [f for f in fallbacks if "set_" in f.reason or "Storage" in f.reason], [f.reason for f in fallbacks]


LIMIT_S = 180


def test_workers_forked_inside_an_open_iteration_do_not_hang():
    """Each call of the step function iterates a fresh DataLoader, whose workers are forked while
    the iteration is open; they must collate eagerly (and the parent's results stay exact)."""
    source = textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F
        from torch.utils.data import DataLoader, TensorDataset
        import terra_torch
        g = torch.Generator().manual_seed(1)
        X = torch.randn(128, 16, generator=g)
        data = TensorDataset(X, (X.sum(1) > 0).long())

        def run(terra):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
            opt = torch.optim.SGD(net.parameters(), lr=0.1)

            def epoch(e):
                out = []
                for x, y in DataLoader(data, batch_size=32, num_workers=2):
                    loss = F.cross_entropy(net(x), y)
                    opt.zero_grad(); loss.backward(); opt.step()
                    out.append(loss.detach())
                return torch.stack(out)

            if terra:
                epoch = terra_torch.function(epoch)
            losses = torch.stack([epoch(e) for e in range(5)])
            terra_torch.synchronize()
            coexec = terra_torch.stats(epoch).iterations["coexec"] if terra else 0
            return losses, [p.detach().clone() for p in net.parameters()], coexec

        la, pa, _ = run(False)
        lb, pb, coexec = run(True)
        print("SAME", torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(pa, pb)), "COEXEC", coexec)
    """)
    try:
        out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the program hung (no exit within {LIMIT_S} s): {e.stdout}\n{e.stderr}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SAME True" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "COEXEC 0" not in out.stdout, out.stdout


# ---- memory Python writes without an op (runtime/feed_snapshot.h) ---------------------------------


def _numpy_buffer_run(terra: bool, how: str, steps: int = STEPS):
    """A loop that refills one numpy buffer every step (`buf[:] = batch`) and feeds it through
    torch.from_numpy: once before the loop, each step, or each step through a view. The graph
    must read each step's batch, not a later one Python wrote before the graph got there."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model, opt = _mlp()
    if terra:
        model = terra_torch.wrap(model)
    rng = np.random.default_rng(0)
    buf = np.empty((8, 6), dtype=np.float32)
    once = torch.from_numpy(buf)
    losses = []
    for _ in range(steps):
        buf[:] = rng.standard_normal((8, 6))  # no op: torch does not see this write
        x = once if how == "once" else torch.from_numpy(buf)
        if how == "view":
            x = x[1:]
        loss = F.cross_entropy(model(x), (x.sum(1) > 0).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())  # not read: Python runs ahead of the graph
    terra_torch.synchronize()
    stats = terra_torch.stats(model) if terra else None
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], stats


@pytest.mark.parametrize("how", ["once", "each", "view"])
def test_numpy_buffer_refilled_each_step(how):
    la, pa, _ = _numpy_buffer_run(False, how)
    lb, pb, stats = _numpy_buffer_run(True, how)
    assert stats.iterations["coexec"] >= STEPS - 10, stats.iterations
    assert torch.equal(la, lb), (la - lb).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))


def test_feeds_the_graph_writes_are_told_apart():
    """emit/written_feeds.h: a feed written in place, or through a view, is fed as it is (a copy
    would hide the write from the numpy array); one only read may be a copy."""
    from terra_torch import graph as tgraph

    def fn(read, written, through_view):
        y = read * 2
        written.add_(1)
        through_view[0].mul_(3)
        return y + written.sum() + through_view.sum()

    g = tgraph.build([tgraph.record(fn, *[torch.ones(3, 2) for _ in range(3)])])
    # Feed slots in program order, each Python number its own: `read` (mul), 2, `written`
    # (add_), 1, `through_view` (select), 3, `through_view` again (sum).
    assert [written for *_, written in g.feeds] == [False, False, True, False, True, False, False], g.feeds


def test_numpy_memory_the_graph_writes_is_fed_as_it_is():
    """A tensor over numpy memory, made once, that each step scales in place through a view and
    then reads whole: that read must see the graph's write, so once the graph writes the memory
    its feeds are never copies (FeedValues). (A tensor made by torch.from_numpy inside the
    iteration is read through its lift_fresh, one feed, and does not show this.)"""
    np = pytest.importorskip("numpy")

    def run(terra: bool):
        torch.manual_seed(0)
        model, opt = _mlp()
        x = torch.from_numpy(np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32))
        big = torch.randn(384, 384, generator=torch.Generator().manual_seed(1)) / 20

        def step() -> torch.Tensor:
            busy = (big @ big).tanh().mean()  # keeps the graph behind Python
            x[0].mul_(busy * 0.01 + 0.99)
            loss = F.cross_entropy(model(x), (x.sum(1) > 0).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        if terra:
            step = terra_torch.function(step)
        losses = torch.stack([step() for _ in range(40)])
        terra_torch.synchronize()
        stats = terra_torch.stats(step) if terra else None
        return losses, [p.detach().clone() for p in model.parameters()] + [x.clone()], stats

    la, pa, _ = run(False)
    lb, pb, stats = run(True)
    assert stats.iterations["coexec"] >= 30, stats.iterations
    assert torch.equal(la, lb), (la - lb).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))


@pytest.mark.parametrize("how", ["tolist", "numpy_param_write"])
def test_views_over_numpy_memory_stay_that_memory(how):
    """An environment's observation buffer updated in place after each step (`obs += 1`), fed as
    `torch.from_numpy(obs)`. Reading `x` afterwards (`x.tolist()`) gave it the graph's value, a
    copy of the old batch (FeedValues), written into `obs` itself: the old observation came back
    and every later step trained on it. A parameter's row zeroed through
    `weight.detach().numpy()` was lost the same way. Views over the memory of tensors that were
    no placeholders are adopted, never given the graph's value (PlaceholderImpl::over_memory)."""
    np = pytest.importorskip("numpy")

    def run(terra: bool):
        torch.manual_seed(0)
        model = nn.Linear(2, 2)
        if terra:
            model = terra_torch.wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        obs = np.zeros(2, np.float32)
        log = []
        for step in range(12):
            x = torch.from_numpy(obs)
            loss = (model(x.unsqueeze(0)) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            obs += 1.0
            if how == "numpy_param_write" and step == 5:
                model.weight.detach().numpy()[0, :] = 0.0
            log.append(loss.item())
            if how == "tolist":
                log.append(x.tolist())
        terra_torch.synchronize()
        stats = terra_torch.stats(model) if terra else None
        return log, model.weight.detach().clone(), obs.copy(), stats

    la, wa, oa, _ = run(False)
    lb, wb, ob, stats = run(True)
    assert la == lb
    assert torch.equal(wa, wb) and (oa == ob).all()
    assert stats.iterations["coexec"] >= 6, stats.iterations


@pytest.mark.parametrize("memory", ["from_numpy", "torch_numpy_view"])
def test_a_small_result_read_after_python_rewrote_its_input(memory):
    """`m = obs.max()`, then the environment writes the next observation into `obs` through numpy
    (no op, no version bump), then `m.item()`. The read was answered on the Python side by running
    max on `obs` as it was then (a recipe over a real tensor, runtime/known_values.h): the next
    observation's maximum, one step ahead of eager. Both numpy memory (torch.from_numpy) and
    memory torch allocated that Python writes through `.numpy()`. The reads are still answered
    on the Python side, from a copy of `obs` taken when the op was issued (no wait for the
    graph)."""
    np = pytest.importorskip("numpy")

    def run(terra: bool):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        net = terra_torch.wrap(model, speed_check=False) if terra else model
        if memory == "from_numpy":
            obs_np = np.zeros((16, 4), np.float32)
            obs = torch.from_numpy(obs_np)
        else:
            obs = torch.zeros(16, 4)
            obs_np = obs.numpy()
        rng = np.random.default_rng(0)
        x = torch.ones(8, 4)
        log = []
        for _ in range(STEPS):
            loss = F.mse_loss(net(x), x[:, :1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            m, s = obs.max(), obs.abs().sum()  # statistics of this step's observation
            obs_np[:] = rng.standard_normal((16, 4)).astype(np.float32)  # the next one, in place
            log += [m.item(), s.item()]
        terra_torch.synchronize()
        return log, [p.detach().clone() for p in model.parameters()], terra_torch.stats(net) if terra else None

    la, pa, _ = run(False)
    lb, pb, stats = run(True)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert stats.iterations["coexec"] >= STEPS - 10, stats.iterations
    assert stats.runner["known_reads"] >= 2 * (STEPS - 10), stats.runner


def test_a_torch_buffer_refilled_through_its_numpy_view():
    """A replay buffer torch allocated (`torch.zeros`) that the environment refills through
    `buf.numpy()` after each step's ops were issued. In eager `buf[idx]` copies the rows at that
    line; the graph ran the indexing later and read rows Python had already overwritten (memory
    torch allocated was fed as it is). Memory handed to Python as an array is fed as a copy taken
    when Python issued the read, as memory torch did not allocate is (runtime/feed_snapshot.h)."""
    np = pytest.importorskip("numpy")

    def run(terra: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        net = terra_torch.wrap(model, speed_check=False) if terra else model
        buf = torch.zeros(1024, 16)
        buf_np = buf.numpy()
        rng = np.random.default_rng(0)
        buf_np[:] = rng.standard_normal((1024, 16)).astype(np.float32)
        losses = []
        for it in range(30):
            xb = buf[torch.arange(it % 4 * 64, it % 4 * 64 + 64)]
            loss = F.mse_loss(net(xb), xb[:, :1].sin())
            opt.zero_grad()
            loss.backward()
            opt.step()
            buf_np[:] = rng.standard_normal((1024, 16)).astype(np.float32)  # new transitions, in place
            losses.append(loss.detach())
        terra_torch.synchronize()
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()], \
            terra_torch.stats(net) if terra else None

    la, pa, _ = run(False)
    lb, pb, stats = run(True)
    assert torch.equal(la, lb), (la - lb).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert stats.iterations["coexec"] >= 20, stats.iterations


# ---- arrays Python keeps over tensor memory (runtime/feed_snapshot.h, PythonRunner::outputs) --------


def _kept_array_run(terra: bool, body, steps: int = 24):
    """A Linear(4, 4) + BatchNorm1d model trained with SGD; `body(model, net, opt, x, i, state)`
    runs one step and returns the values to log."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = terra_torch.wrap(model, speed_check=False) if terra else model
    g = torch.Generator().manual_seed(1)
    state: dict = {}
    log = []
    for i in range(steps):
        log.append(body(model, net, opt, torch.randn(8, 4, generator=g), i, state))
    terra_torch.synchronize()
    stats = terra_torch.stats(net) if terra else None
    return log, [p.detach().clone() for p in model.parameters()], stats


def _check_kept_array(body):
    la, pa, _ = _kept_array_run(False, body)
    lb, pb, stats = _kept_array_run(True, body)
    assert la == lb, next((i, a, b) for i, (a, b) in enumerate(zip(la, lb)) if a != b)
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert stats.iterations["coexec"] >= 16, stats.iterations


@pytest.mark.parametrize("what", ["weight", "running_mean", "buffer"])
def test_an_array_kept_over_memory_the_graph_writes_reads_the_write(what):
    """`w_np = layer.weight.detach().numpy()` taken once and read by numpy after `opt.step()` (no
    op announces that read): it gave the value from before the step. An op that writes memory
    handed to Python as an array now runs on the graph before Python goes on."""
    np = pytest.importorskip("numpy")

    def body(model, net, opt, x, i, state):
        if "arr" not in state:
            state["buf"] = torch.zeros(8, 4)
            state["arr"] = {"weight": model[0].weight.detach().numpy(), "running_mean": model[1].running_mean.numpy(),
                            "buffer": state["buf"].numpy()}[what]
        out = net(x)
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["buf"].copy_(out.detach())
        return float(np.sum(state["arr"]))

    _check_kept_array(body)


def test_a_gradient_masked_through_a_kept_array():
    """`gw = weight.grad.numpy()` kept across steps and masked after backward (`gw *= mask`), then
    `opt.step()`: the replayed backward wrote the gradient after Python's mask, so the step used
    the unmasked gradient (final weights 0.31 off eager)."""
    np = pytest.importorskip("numpy")

    def body(model, net, opt, x, i, state):
        if "gw" not in state:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            state["gw"] = model[0].weight.grad.numpy()
        loss = net(x).pow(2).mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        state["gw"] *= np.float32(0.5 if i % 2 else 0.0)
        opt.step()
        return model[0].weight.sum().item()

    _check_kept_array(body)


def test_a_tensor_the_graph_computes_edited_through_its_array():
    """Label smoothing in place through numpy: `t = one_hot(y).float(); t.numpy()[...] *= 0.5`, then
    the loss reads `t`. The graph read its own value of `t` and the edit was lost (loss twice
    eager's). A tensor handed to Python as an array is read from its memory from then on."""

    def body(model, net, opt, x, i, state):
        t = F.one_hot(x.argmax(1), 4).float()
        tn = t.numpy()
        tn *= 0.5
        tn += 0.125
        loss = (t * net(x)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    _check_kept_array(body)


@pytest.mark.parametrize("how", ["from_dlpack", "as_tensor_of_numpy"])
def test_a_second_tensor_over_the_same_memory(how):
    """`alias = torch.from_dlpack(buf)` or `torch.as_tensor(buf.numpy())`: another storage over
    `buf`'s memory. The loop writes the alias with a torch op and reads `buf`: the read took a
    copy of `buf` made before the graph wrote the alias (one step behind eager). Writes the graph
    makes are tracked by address range (FeedValues, KnownValues::ever_written)."""
    np = pytest.importorskip("numpy")

    def body(model, net, opt, x, i, state):
        if "alias" not in state:
            state["buf"] = torch.zeros(8, 4)
            buf = state["buf"]
            state["alias"] = torch.from_dlpack(buf) if how == "from_dlpack" else torch.as_tensor(buf.numpy())
        state["alias"].fill_(float(i))
        s = state["buf"].sum()
        loss = net(state["buf"] + x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return [s.item(), loss.item()]

    _check_kept_array(body)
