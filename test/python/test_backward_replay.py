"""backward() in co-execution without the autograd engine (issue 15, items 1 and 6;
csrc/runtime/backward_replay.h): every program trains 60 iterations eagerly and under
terra_torch.wrap from the same seeds and must match bitwise (losses, what the program read,
parameters); programs whose backward runs no Python replay it, the others (hooks, retain_grad, a
Python autograd.Function, create_graph) run the engine op by op and their hooks run as in eager."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch

STEPS = 60


@dataclass
class Run:
    log: list[Any]
    params: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    runner: dict = field(default_factory=dict)
    iterations: dict = field(default_factory=dict)
    fallbacks: int = 0
    reasons: list = field(default_factory=list)  # (iteration, reason, line) of each fallback


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(7)]


BATCHES = _batches()  # made outside every iteration: the data is not part of the program


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return BATCHES[i % len(BATCHES)]


def run(make: Callable[[], tuple[nn.Module, torch.optim.Optimizer]], step: Callable[..., None], terra: bool,
        steps: int = STEPS) -> Run:
    torch.manual_seed(0)
    model, opt = make()
    if terra:
        model = terra_torch.wrap(model)
    log: list[Any] = []
    for i in range(steps):
        step(model, opt, i, log)
    out = Run([], [], [])
    if terra:
        terra_torch.synchronize()
        st = terra_torch.stats(model)
        out.runner, out.iterations, out.fallbacks = dict(st.runner), dict(st.iterations), st.fallbacks
        out.reasons = [(f.iteration, f.reason, f.source_line) for f in model._terra_program.fallbacks]
        terra_torch.unwrap(model)
    out.log = [v.item() if isinstance(v, torch.Tensor) else v for v in log]
    out.params = [p.detach().clone() for p in model.parameters()]
    out.grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return out


def optimize(opt: torch.optim.Optimizer, loss: torch.Tensor, log: list[Any]) -> None:
    """The usual end of a step: zero_grad, backward, step; the loss goes to the log."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    log.append(loss.detach())


def check(make, step, steps: int = STEPS, max_fallbacks: int = 2) -> Run:
    eager = run(make, step, False, steps)
    terra = run(make, step, True, steps)
    assert terra.log == eager.log
    for a, b in zip(eager.params, terra.params):
        assert torch.equal(a, b)
    for a, b in zip(eager.grads, terra.grads):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert terra.iterations["coexec"] >= steps * 0.8, (terra.iterations, terra.reasons)
    assert terra.fallbacks <= max_fallbacks, terra.reasons
    return terra


def mlp_sgd() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def mlp_adam() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def replayed_most(r: Run, steps: int = STEPS, untraced: int = 8) -> None:
    """All but `untraced` backward() calls were replayed (tracing and the recorded ones)."""
    assert r.runner["backward_replayed"] >= steps - untraced, (r.runner, r.reasons)
    assert r.runner["backward_recorded"] >= 1


# ---- the fast path ------------------------------------------------------------------------------


def test_replayed_backward_intercepts_no_op():
    """Steady iterations: loss.backward() brings no op to the interceptor at all."""
    handled_in_backward: list[int] = []

    def step(model, opt, i, log):
        x, y = batch(i)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        region = getattr(getattr(model, "_terra_program", None), "_region", None)
        before = region.handled if region is not None and hasattr(region, "handled") else None
        loss.backward()
        if before is not None and model._terra_program.phase == "coexec":
            handled_in_backward.append(region.handled - before)
        opt.step()
        log.append(loss.detach())

    r = check(mlp_sgd, step)
    replayed_most(r)
    # The first co-executed backward ran op by op (it was recorded, 20 ops and more); a replay
    # brings one op: the gradient seed (ones_like), which torch.autograd.backward makes before it
    # calls the engine. None of the engine's.
    assert handled_in_backward and handled_in_backward[0] > 10
    assert handled_in_backward.count(1) >= r.runner["backward_replayed"] - 1, handled_in_backward


def test_adam_and_reading_grads_between_backward_and_step():
    def step(model, opt, i, log):
        x, y = batch(i)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if i % 5 == 0:
            log.append(model[0].weight.grad.abs().sum())  # read after backward, before step
            log.append(model[2].bias.grad[1].item())
        opt.step()
        log.append(loss.detach())

    replayed_most(check(mlp_adam, step))


def test_gradient_accumulation_over_micro_batches_without_zero_grad():
    """Four micro-batches per optimizer step: the first backward finds every .grad None, the next
    three accumulate in place (two memos, one per gradient state)."""

    def step(model, opt, i, log):
        x, y = batch(i)
        loss = F.cross_entropy(model(x), y) / 4
        loss.backward()
        log.append(loss.detach())
        if i % 4 == 3:
            opt.step()
            opt.zero_grad()

    # Paths: backward alone, backward + the first momentum step (clones the buffer), + a later
    # step; each is traced once when it first comes.
    r = check(mlp_sgd, step, max_fallbacks=3)
    replayed_most(r, untraced=12)
    assert r.runner["backward_recorded"] >= 2


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_set_to_none_both_ways(set_to_none: bool):
    def step(model, opt, i, log):
        x, y = batch(i)
        opt.zero_grad(set_to_none=set_to_none)
        g = model[0].weight.grad
        # The same gradient object every iteration (set_to_none=False), or None, as in eager.
        log.append(None if g is None else g is getattr(model, "seen_grad", None))
        model.seen_grad = g
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log.append(loss.detach())
        log.append(model[0].weight.grad is None)

    replayed_most(check(mlp_sgd, step))


def test_replayed_backward_frees_the_graph_like_eager():
    """Without retain_graph a second backward through the same graph raises eager's error; with
    retain_graph=True the first call keeps it and the second accumulates."""

    def step(model, opt, i, log):
        x, y = batch(i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if i % 2 == 0:
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            loss.backward()
            try:
                loss.backward()
            except RuntimeError as e:
                log.append("second time" in str(e))
        opt.step()
        log.append(loss.detach())

    r = check(mlp_sgd, step, max_fallbacks=4)
    assert r.runner["backward_replayed"] > STEPS


# ---- the per-op path: Python runs in the backward -----------------------------------------------


class Hooked(nn.Module):
    """A small net whose forward registers what the parametrized test asks for."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 3)
        self.calls = 0
        self.h: torch.Tensor | None = None
        if kind == "module_hook":
            self.a.register_full_backward_hook(self._module_hook)

    def _module_hook(self, module, grad_in, grad_out):
        self.calls += 1

    def _tensor_hook(self, g):
        self.calls += 1
        return g * 0.5

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.kind == "retain_grad":
            h.retain_grad()
            self.h = h
        elif self.kind == "tensor_hook":
            h.register_hook(self._tensor_hook)
        elif self.kind == "function":
            h = Scale.apply(h)
        return self.b(h)


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


@pytest.mark.parametrize("kind", ["retain_grad", "tensor_hook", "module_hook", "function"])
def test_python_in_the_backward_takes_the_per_op_path(kind: str):
    def make():
        model = Hooked(kind)
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    def step(model, opt, i, log):
        x, y = batch(i)
        loss = F.cross_entropy(model(x), y)
        optimize(opt, loss, log)
        log.append(model.calls)
        if kind == "retain_grad" and i % 3 == 0:
            log.append(model.h.grad.sum())

    r = check(make, step, max_fallbacks=3)
    assert r.runner["backward_replayed"] == 0, r.runner
    assert r.runner["backward_per_op"] > 0
    assert r.runner["backward_reason"], r.runner


def test_gradient_penalty_with_create_graph_takes_the_per_op_path():
    def step(model, opt, i, log):
        x, y = batch(i)
        x = x.detach().requires_grad_()  # (a leaf of its own: BATCHES, shared by every test, stay as they are)
        loss = F.cross_entropy(model(x), y)
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        total = loss + 0.1 * gx.pow(2).sum()
        opt.zero_grad()
        total.backward()
        opt.step()
        log.append(total.detach())

    r = check(mlp_adam, step, max_fallbacks=3)
    # Every co-executed iteration's autograd.grad(create_graph=True) runs op by op, with its reason.
    assert r.runner["backward_per_op"] >= STEPS - 8, r.runner
    assert "create_graph" in r.runner["backward_reason"], r.runner


def test_disabled_replay_is_the_per_op_path(monkeypatch):
    from terra_torch import _backward

    monkeypatch.setattr(_backward, "enabled", False)

    def step(model, opt, i, log):
        x, y = batch(i)
        loss = F.cross_entropy(model(x), y)
        optimize(opt, loss, log)

    r = check(mlp_sgd, step)
    assert r.runner["backward_replayed"] == 0 and r.runner["backward_recorded"] == 0



def test_backward_with_fed_numbers_replays_per_sequence_length():
    """Three sequence lengths: the backward's view sizes are fed numbers. A memo per length (the
    sizes are part of its key) replays them as recorded, while the forward ops they come from
    received the same arguments."""
    lengths = (4, 6, 8)
    seqs = [torch.randn(3, L, 8, generator=torch.Generator().manual_seed(L)) for L in lengths]

    def make():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    def step(model, opt, i, log):
        x = seqs[i % 3]
        B, T, D = x.shape
        out = model(x.reshape(B * T, D)).view(B, T, 3).mean(1)
        loss = out.pow(2).mean()
        optimize(opt, loss, log)

    r = check(make, step, max_fallbacks=3)
    replayed_most(r, untraced=12)
    assert r.runner["backward_recorded"] >= 3, r.runner  # one memo per length


def test_backward_inside_a_loop_with_a_data_dependent_trip_count_replays():
    """The step repeats forward/backward/step on a batch while its loss stays above a running
    average (1 to 3 times, decided by the data): the loop is a graph loop (prim::Loop), and each
    backward() in it is replayed once its path (the trips before it) has been recorded. The
    forward's own refinement loop, whose every round backward reads, is flattened inside it: each
    round is a copy with its own graph value, so the backward's read of an earlier round is no
    stale read (before, that divergence recurred in every iteration and the program never left
    tracing)."""
    torch.manual_seed(0)
    data = [(torch.randn(16, 8) * (0.3 + 0.4 * k), torch.randint(0, 3, (16,))) for k in range(5)]

    class Refine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.f, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.inp(x))
            for _ in range(4):
                update = torch.tanh(self.f(h)) - h
                h = h + 0.5 * update
                if update.abs().mean() < 0.05:
                    break
            return self.out(h)

    def train(terra: bool, steps: int = 90):
        torch.manual_seed(1)
        net = Refine()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.5)
        state = {"avg": torch.tensor(1.1)}

        def step(i: int) -> tuple[torch.Tensor, int]:
            x, y = data[i % len(data)]
            first = None
            for inner in range(3):
                loss = F.cross_entropy(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                first = loss.detach() if first is None else first
                if loss < state["avg"]:
                    break
            state["avg"] = 0.8 * state["avg"] + 0.2 * first
            return first, inner + 1

        f = terra_torch.function(step, speed_check=False) if terra else step
        out = [f(i) for i in range(steps)]
        log = [(loss.item(), n) for loss, n in out]
        runner = None
        if terra:
            terra_torch.synchronize()
            runner = dict(terra_torch.stats(f).runner)
        return log, [p.detach().clone() for p in net.parameters()], runner

    e_log, e_params, _ = train(False)
    t_log, t_params, runner = train(True)
    assert t_log == e_log
    assert all(torch.equal(a, b) for a, b in zip(e_params, t_params))
    assert len({n for _, n in e_log}) >= 2, "the program must take more than one trip count"
    assert runner["traces"] <= 8, runner
    assert runner["backward_replayed"] >= 20, runner
    assert "loop" not in runner["backward_reason"], runner
