"""optimizer.step() in co-execution without its Python (issue 15; csrc/runtime/call_replay.h,
terra_torch/_optimizer/): every program trains 60 iterations eagerly and under
terra_torch.wrap from the same seeds and must match bitwise (losses, parameters, gradients, and
the parameters' version counters); SGD's steps are replayed once their key repeats, and what
changes the key (hyperparameters, a momentum buffer made, a gradient gone) runs the body again."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch
from terra_torch import _optimizer
from test_backward_replay import STEPS, batch, check, optimize, run


def sgd(**kw: Any) -> Callable[[], tuple[nn.Module, torch.optim.Optimizer]]:
    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        return model, torch.optim.SGD(model.parameters(), **kw)
    return make


def plain_step(model, opt, i, log):
    x, y = batch(i)
    optimize(opt, F.cross_entropy(model(x), y), log)


def loss_and_backward(model, opt, i) -> torch.Tensor:
    """The start of a step that does more between backward() and step()."""
    x, y = batch(i)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    return loss


def steps_replayed(r, steps: int = STEPS, untraced: int = 10) -> None:
    """All but `untraced` step() calls were replayed (tracing, the first co-executed ones)."""
    assert r.runner["calls_replayed"] >= steps - untraced, (r.runner, r.reasons)
    assert r.runner["calls_recorded"] >= 1


@pytest.mark.parametrize("kw", [
    dict(lr=0.05),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    dict(lr=0.05, momentum=0.5, dampening=0.1, maximize=True),
], ids=["plain", "momentum", "nesterov-decay", "dampening-maximize"])
def test_sgd_steps_are_replayed_bitwise(kw):
    steps_replayed(check(sgd(**kw), plain_step, max_fallbacks=0))


def test_a_replayed_step_intercepts_no_op_and_bumps_versions_as_eager():
    """Steady iterations: opt.step() brings no op of the optimizer to the interceptor; the
    parameters and momentum buffers end with eager's version counters."""
    handled: list[int] = []

    def step(model, opt, i, log):
        loss = loss_and_backward(model, opt, i)
        program = getattr(model, "_terra_program", None)
        region = getattr(program, "_region", None)
        before = region.handled if region is not None else None
        opt.step()
        if before is not None and program.phase == "coexec":
            handled.append(region.handled - before)
        log.append(loss.detach())

    versions = {}
    for terra in (False, True):
        torch.manual_seed(0)
        model, opt = sgd(lr=0.05, momentum=0.9)()
        if terra:
            model = terra_torch.wrap(model)
        log: list[Any] = []
        for i in range(STEPS):
            step(model, opt, i, log)
        if terra:
            terra_torch.synchronize()
            runner = dict(terra_torch.stats(model).runner)
            terra_torch.unwrap(model)
        versions[terra] = ([p._version for p in model.parameters()],
                           [opt.state[p]["momentum_buffer"]._version for p in model.parameters()],
                           [v.item() for v in log], [p.detach().clone() for p in model.parameters()])
    assert versions[True][0] == versions[False][0]
    assert versions[True][1] == versions[False][1]
    assert versions[True][2] == versions[False][2]
    assert all(torch.equal(a, b) for a, b in zip(versions[True][3], versions[False][3]))
    assert runner["calls_replayed"] >= STEPS - 10, runner
    # Recorded steps ran their 12 ops (mul_ and add_ on 4 buffers, add_ on 4 parameters); a
    # replay brings none of them (what is left is the profiler's record_function pair, if any).
    assert max(handled) >= 12, handled
    assert handled.count(min(handled)) >= runner["calls_replayed"] and min(handled) <= 2, handled


def test_step_hooks_run_every_step_while_the_body_is_replayed():
    calls: dict[bool, list[str]] = {}

    def make_with_hooks(terra: bool):
        def make():
            model, opt = sgd(lr=0.05, momentum=0.9)()
            seen = calls.setdefault(terra, [])
            opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
            opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
            return model, opt
        return make

    eager = run(make_with_hooks(False), plain_step, False)
    terra = run(make_with_hooks(True), plain_step, True)
    assert terra.log == eager.log
    assert all(torch.equal(a, b) for a, b in zip(eager.params, terra.params))
    assert calls[True] == calls[False] == ["pre", "post"] * STEPS
    steps_replayed(terra)


def scheduled(make_model: Callable[[], tuple[nn.Module, torch.optim.Optimizer]], scheduler: Callable[..., Any]):
    """`make_model`'s optimizer under a learning-rate scheduler stepped after every step: (make, step)."""
    schedulers = []

    def make():
        model, opt = make_model()
        schedulers.append(scheduler(opt))
        return model, opt

    def step(model, opt, i, log):
        plain_step(model, opt, i, log)
        schedulers[-1].step()

    return make, step


def test_a_learning_rate_that_changes_now_and_then_records_again_and_replays():
    r = check(*scheduled(sgd(lr=0.1, momentum=0.9),
                         lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.5)))
    # The learning rate is a number of the key (`alpha=-lr`), not part of it. While the graph has
    # it as a constant (traced with one value) the memo holds it by value (pinned); the first new
    # one is a new constant for the graph (the program traces again), and the new graph feeds it:
    # its memo, confirmed with lr pinned, learns lr's place at the next change (step 30) and
    # replays every value from then on. Two memos of two recordings each, and the traced steps.
    assert r.runner["calls_recorded"] <= 5, r.runner
    assert r.runner["calls_replayed"] >= STEPS - 22, r.runner


def test_a_learning_rate_scheduled_every_step_is_a_number_and_replays():
    """Every step has a new learning rate: the traced iterations saw several, so the graph feeds
    it, and the replay feeds each step's value. Two recordings, the second confirming the first:
    the first co-executed step (after a recorded backward) has the key of the later ones (after
    replayed backwards), so its memo is the one replayed."""
    r = check(*scheduled(sgd(lr=0.1), lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)))
    steps_replayed(r)
    assert r.runner["calls_recorded"] <= 2, str((r.runner, r.iterations, r.reasons))


@pytest.mark.parametrize("kw", [
    dict(lr=0.1, momentum=0.9, foreach=True),
    dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3, foreach=True),
    dict(lr=0.1, weight_decay=1e-3, maximize=True, foreach=True),
    dict(lr=0.1, momentum=0.9, fused=True),
    dict(lr=0.1, fused=True),
], ids=["foreach-momentum", "foreach-nesterov-decay", "foreach-maximize", "fused-momentum", "fused"])
def test_foreach_and_fused_sgd_under_a_schedule_are_replayed_bitwise(kw):
    """The foreach and fused paths give the learning rate to one op per group of tensors
    (`_foreach_add_(..., alpha=-lr)`, `_fused_sgd_(..., lr=lr)`): a number of the key there too."""
    r = check(*scheduled(sgd(**kw), lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)))
    steps_replayed(r)
    assert r.runner["calls_recorded"] <= 3, str((r.runner, r.iterations, r.reasons))


def two_dtypes_two_groups(**kw: Any) -> Callable[[], tuple[nn.Module, torch.optim.Optimizer]]:
    """Two param groups with their own learning rates; the second's parameters in two dtypes
    (torch's foreach and fused paths make one op per dtype: two ops that receive its rate)."""
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 16).double()
            self.c = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(torch.relu(self.b(torch.relu(self.a(x)).double())).float())

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Mixed()
        groups = [{"params": model.a.parameters(), "lr": 0.05},
                  {"params": [*model.b.parameters(), *model.c.parameters()], "lr": 0.1}]
        return model, torch.optim.SGD(groups, **kw)
    return make


@pytest.mark.parametrize("kw", [dict(momentum=0.9, foreach=True), dict(momentum=0.9, fused=True),
                                dict(momentum=0.9)], ids=["foreach", "fused", "single"])
def test_sgd_over_two_groups_and_two_dtypes_under_a_schedule_replays_bitwise(kw):
    r = check(*scheduled(two_dtypes_two_groups(**kw),
                         lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, [lambda i: 0.97 ** i, lambda i: 1 / (1 + i)])))
    steps_replayed(r)
    assert r.runner["calls_recorded"] <= 3, str((r.runner, r.iterations, r.reasons))


def test_a_tensor_learning_rate_stays_in_the_key():
    """A learning rate given as a tensor (which a scheduler writes in place) is no plain
    hyperparameter: the stand-in keys no call, the step runs per op, and stays exact."""
    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        return model, torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9, foreach=True)

    r = check(*scheduled(make, lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)))
    assert r.runner["calls_replayed"] == 0, r.runner


class TwoBranches(nn.Module):
    """Parameters of the branch not taken get no gradient: None after zero_grad()."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.a = nn.Linear(16, 3)
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, i: int) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.a(h) if i % 2 == 0 else self.b(h)


def test_parameters_without_a_gradient_are_part_of_the_key():
    def make():
        model = TwoBranches()
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(model, opt, i, log):
        x, y = batch(i)
        optimize(opt, F.cross_entropy(model(x, i), y), log)

    r = check(make, step)
    steps_replayed(r, untraced=14)


def test_disabled_replay_runs_every_step_op_by_op(monkeypatch):
    monkeypatch.setattr(_optimizer, "enabled", False)
    r = check(sgd(lr=0.05, momentum=0.9), plain_step)
    assert r.runner["calls_replayed"] == 0 and r.runner["calls_recorded"] == 0, r.runner


def test_a_subclass_that_adds_ops_around_the_step_stays_exact():
    class ClampedSGD(torch.optim.SGD):
        def step(self, closure=None):
            out = super().step(closure)
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.clamp_(-0.3, 0.3)
            return out

    def make():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        return model, ClampedSGD(model.parameters(), lr=0.2, momentum=0.9)

    steps_replayed(check(make, plain_step))


def test_a_tensor_learning_rate_keeps_the_step_on_the_per_op_path():
    lr = torch.tensor(0.05)
    r = check(sgd(lr=lr), plain_step)
    assert r.runner["calls_replayed"] == 0 and r.runner["calls_recorded"] == 0, r.runner


# ---- clip_grad_norm_ ----------------------------------------------------------------------------


def clipped_step(max_norm: float, **kw: Any):
    def step(model, opt, i, log):
        loss = loss_and_backward(model, opt, i)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, **kw)
        opt.step()
        log.append(loss.detach())
        log.append(total)  # (read at the end: the replayed call returned a placeholder of it)
    return step


@pytest.mark.parametrize("kw", [dict(), dict(norm_type=float("inf")), dict(norm_type=1, foreach=False)],
                         ids=["l2", "inf", "l1-loop"])
def test_clip_grad_norm_is_replayed_and_returns_the_norm(kw):
    r = check(sgd(lr=0.3), clipped_step(0.2, **kw), max_fallbacks=0)
    # (two calls per step: clip_grad_norm_ and step())
    assert r.runner["calls_replayed"] >= 2 * (STEPS - 10), r.runner


def test_clip_grad_norm_reading_the_norm_in_the_step_stays_exact():
    def step(model, opt, i, log):
        loss = loss_and_backward(model, opt, i)
        if torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3) > 0.5:  # a read of the replayed norm
            log.append("hard")
        opt.step()
        log.append(loss.detach())

    r = check(sgd(lr=0.3, momentum=0.9), step)
    assert r.runner["calls_replayed"] >= 2 * (STEPS - 12), r.runner


def test_clip_grad_norm_with_error_if_nonfinite_takes_the_per_op_path():
    r = check(sgd(lr=0.3), clipped_step(0.2, error_if_nonfinite=True))
    assert r.runner["calls_replayed"] >= STEPS - 10, r.runner  # (the steps)
    assert r.runner["calls_replayed"] < 2 * (STEPS - 10), r.runner


def test_explain_tells_how_many_calls_ran_without_python():
    torch.manual_seed(0)
    model, opt = sgd(lr=0.05, momentum=0.9)()
    wrapped = terra_torch.wrap(model)
    log: list[Any] = []
    for i in range(30):
        plain_step(wrapped, opt, i, log)
    terra_torch.synchronize()
    text = str(terra_torch.explain(wrapped))
    runner = terra_torch.stats(wrapped).runner
    terra_torch.unwrap(wrapped)
    assert runner["calls_replayed"] >= 20, runner
    assert f"optimizer steps and clip_grad_norm_ without Python: {runner['calls_replayed']} replayed" in text, text
    assert f"backward() without Python: {runner['backward_replayed']} replayed" in text, text


def test_a_fallback_inside_a_stand_in_is_not_blamed_on_terra_torch():
    """clip_grad_norm_ is first called at iteration 20: that iteration falls back, at a line of
    the function the program called (torch's clip_grad.py: the program's own frame is the
    iteration's stop frame, which locations start below), not at the stand-in's."""
    def step(model, opt, i, log):
        loss = loss_and_backward(model, opt, i)
        if i >= 20:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
        opt.step()
        log.append(loss.detach())

    r = check(sgd(lr=0.3), step)
    lines = [line for _, _, line in r.reasons]
    assert lines and all("clip_grad.py" in line and "terra_torch" not in line for line in lines), r.reasons


# ---- Adam and AdamW -----------------------------------------------------------------------------


def tanh_mlp(cls=torch.optim.Adam, **kw: Any) -> Callable[[], tuple[nn.Module, torch.optim.Optimizer]]:
    """The MLP with tanh, stepped by `cls` (Adam unless told) with `kw`."""
    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        return model, cls(model.parameters(), **kw)
    return make


def check_counted(make: Callable[[], tuple[nn.Module, torch.optim.Optimizer]], step: Callable[..., None]):
    """`check`, with the optimizer's step counters read after the last step: where eager's are."""
    states = []

    def counted(model, opt, i, log):
        step(model, opt, i, log)
        if i == STEPS - 1:
            states.append([float(opt.state[p]["step"]) for p in model.parameters()])

    r = check(make, counted, max_fallbacks=1)  # (the last iteration reads the counters: a new path)
    assert states[0] == states[1] == [float(STEPS)] * len(states[0])
    return r


@pytest.mark.parametrize("make", [
    tanh_mlp(lr=1e-2),
    tanh_mlp(lr=1e-2, weight_decay=1e-2, amsgrad=True),
    tanh_mlp(torch.optim.AdamW, lr=1e-2, betas=(0.8, 0.95)),
    tanh_mlp(lr=3e-3, maximize=True, eps=1e-6),
], ids=["adam", "decay-amsgrad", "adamw", "maximize-eps"])
def test_adam_steps_are_replayed_bitwise_with_the_step_counters_known(make):
    """Adam's step sizes change every step (bias corrections of the step count): the stand-in
    computes them from the step counters Python knows, the replay feeds them."""
    r = check_counted(make, plain_step)
    # The first co-executed steps are recorded twice (a memo with numbers is trusted once a
    # second recording agrees), the rest replayed.
    steps_replayed(r, untraced=12)


@pytest.mark.parametrize("make", [tanh_mlp(lr=1e-2), tanh_mlp(lr=1e-2, foreach=True)], ids=["single", "foreach"])
def test_adam_with_step_counters_that_differ_between_parameters_replays_bitwise(make):
    """A gradient dropped every other step (`p.grad = None` after backward) leaves that parameter's
    step counter behind the others': the stand-in computes the bias corrections per count, not
    once for the group (terra_torch/_optimizer/, the uniform shortcut must not apply)."""
    counts = []

    def step(model, opt, i, log):
        loss = loss_and_backward(model, opt, i)
        if i % 2:
            model[2].bias.grad = None
        opt.step()
        log.append(loss.detach())
        if i == STEPS - 1:
            counts.append([float(opt.state[p]["step"]) for p in model.parameters()])

    # (the last iteration reads the counters: a new path; foreach's first co-executed step meets
    # a list of step sizes the traced graph held as a constant: one more)
    r = check(make, step, max_fallbacks=2)
    assert counts[0] == counts[1] and counts[0][3] == STEPS // 2 < counts[0][0] == STEPS, counts
    steps_replayed(r, untraced=16)


def test_adam_with_a_learning_rate_changed_by_a_scheduler_stays_exact():
    r = check(*scheduled(tanh_mlp(lr=1e-2), lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.3)))
    assert r.runner["calls_replayed"] >= STEPS // 2, r.runner


def warmup_then_cosine(opt: torch.optim.Optimizer) -> Any:
    """A transformer's schedule: linear warm-up for 10 steps, then cosine decay (LambdaLR)."""
    import math
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: (k + 1) / 10 if k < 10 else 0.5 * (1 + math.cos(math.pi * (k - 10) / STEPS)))


@pytest.mark.parametrize("make,scheduler", [
    (tanh_mlp(lr=1e-2), lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)),
    (tanh_mlp(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), warmup_then_cosine),
    (tanh_mlp(torch.optim.AdamW, lr=1e-2), lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)),
    (tanh_mlp(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1000)),
], ids=["adam-exponential", "adamw-warmup-cosine", "adamw-onecycle", "adamw-constant-decay-equals-beta2"])
def test_adam_steps_under_a_learning_rate_schedule_are_replayed_bitwise(make, scheduler):
    """Adam's step size carries the learning rate (-lr / bias_correction1), and AdamW's decay
    factor `1 - lr * weight_decay` does too: numbers the stand-in computes, fed where the graph
    feeds them (a scheduled learning rate) and keyed by value where it has them as constants
    (`adamw-constant...`, where `1 - lr * weight_decay` is 0.999, beta2's value: a constant and a
    number equal by chance are told apart by two recordings, not one). OneCycleLR cycles beta1
    too, a number of `exp_avg.lerp_(grad, 1 - beta1)`."""
    r = check(*scheduled(make, scheduler))
    steps_replayed(r, untraced=12)
    assert r.runner["calls_recorded"] <= 4, r.runner


@pytest.mark.parametrize("make,scheduler", [
    (tanh_mlp(lr=1e-2, fused=True), None),
    (tanh_mlp(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True), warmup_then_cosine),
    (tanh_mlp(lr=1e-2, foreach=True), None),
    (tanh_mlp(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True), None),
    (tanh_mlp(torch.optim.AdamW, lr=1e-2, amsgrad=True, foreach=True), warmup_then_cosine),
    (tanh_mlp(lr=3e-3, maximize=True, foreach=True), lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)),
], ids=["fused", "adamw-fused-scheduled", "foreach", "adamw-foreach", "adamw-amsgrad-foreach-scheduled",
        "maximize-foreach-onecycle"])
def test_foreach_and_fused_adam_steps_are_replayed_bitwise(make, scheduler):
    """The foreach path's numbers are lists (`_foreach_div_` by each bias correction, `_foreach_addcdiv_`
    by each step size) and it adds a `torch.tensor(1.0)` it makes to the step counters (a constant
    of the call, made again in a replay); the fused path's are the learning rate and beta1 the
    fused op receives. GPUs default to foreach Adam."""
    r = check(*scheduled(make, scheduler)) if scheduler else check(make, plain_step)
    steps_replayed(r, untraced=12)
    assert r.runner["calls_recorded"] <= 4, r.runner


def test_a_fused_adam_over_two_dtypes_and_two_groups_replays_bitwise():
    """Fused Adam steps each (device, dtype) bucket of a group with its own fused op: the group's
    learning rate reaches two ops (one number, two places). Two groups with their own schedules."""
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.out = nn.Linear(16, 3).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.inp(x)).double())

    def make():
        model = Mixed()
        opt = torch.optim.Adam([{"params": list(model.inp.parameters()) + [model.out.bias]},
                                {"params": [model.out.weight], "lr": 3e-3}], lr=1e-2, fused=True)
        return model, opt

    def step(model, opt, i, log):
        plain_step(model, opt, i, log)
        for group, gamma in zip(opt.param_groups, (0.97, 0.9)):
            group["lr"] *= gamma

    r = check(make, step)
    steps_replayed(r, untraced=12)


def test_numbers_the_stand_in_gets_wrong_are_never_replayed(monkeypatch):
    """A stand-in whose numbers differ from what the ops receive (here each step count is off by
    a little, as another torch version's formula might be): the changing fed floats match no
    number that changes the same way, so no memo is confirmed and every step runs its body."""
    monkeypatch.setattr(_optimizer.keys, "float32", lambda x: x + 0.25)
    r = check(tanh_mlp(lr=1e-2), plain_step)
    assert r.runner["calls_replayed"] == 0, r.runner
    assert r.runner["calls_recorded"] >= STEPS - 10, r.runner


def test_a_subclass_step_that_clips_then_calls_super_replays_both():
    """A subclass whose own step calls clip_grad_norm_ per group, then SGD's step: both stand-ins
    run in turn inside it, and both replay."""
    class ClippingSGD(torch.optim.SGD):
        def step(self, closure=None):
            for group in self.param_groups:
                torch.nn.utils.clip_grad_norm_(group["params"], 0.2)
            return super().step(closure)

    def make():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        return model, ClippingSGD(model.parameters(), lr=0.3, momentum=0.9)

    r = check(make, plain_step)
    assert r.runner["calls_replayed"] >= 2 * (STEPS - 10), r.runner


def test_adam_under_a_float64_default_dtype_keeps_float64_step_counters_exact():
    def step(model, opt, i, log):
        x, y = batch(i)
        optimize(opt, F.cross_entropy(model(x.double()), y), log)

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # (Adam's counters follow it: _get_scalar_dtype)
    try:
        r = check(tanh_mlp(lr=1e-2), step)
    finally:
        torch.set_default_dtype(before)
    # (Bitwise above. In the full suite this program traced 8 iterations before co-executing, 4
    # alone; a third of the steps replayed is the claim.)
    assert r.runner["calls_replayed"] >= STEPS // 3, r.runner


# ---- RMSprop, Adagrad and Adadelta -----------------------------------------------------------


@pytest.mark.parametrize("kw", [
    dict(lr=1e-2),
    dict(lr=1e-2, momentum=0.9, centered=True, weight_decay=1e-3),
    dict(lr=1e-2, momentum=0.5, maximize=True),
    dict(lr=1e-2, momentum=0.9, foreach=True),
    dict(lr=1e-2, centered=True, foreach=True),
], ids=["plain", "momentum-centered-decay", "momentum-maximize", "foreach-momentum", "foreach-centered"])
def test_rmsprop_steps_under_a_schedule_are_replayed_bitwise(kw):
    """RMSprop's learning rate reaches one op per parameter (or per foreach group) as `-lr`; its
    step counters are written, never read."""
    r = check(*scheduled(tanh_mlp(torch.optim.RMSprop, **kw), lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)))
    steps_replayed(r)
    assert r.runner["calls_recorded"] <= 4, str((r.runner, r.iterations, r.reasons))


@pytest.mark.parametrize("kw,scheduled_lr", [
    (dict(lr=5e-2), False),
    (dict(lr=5e-2, lr_decay=1e-2, weight_decay=1e-3), False),
    (dict(lr=5e-2, lr_decay=1e-3, initial_accumulator_value=0.1, maximize=True), True),
], ids=["plain", "lr-decay-weight-decay", "lr-decay-scheduled-maximize"])
def test_adagrad_steps_are_replayed_bitwise(kw, scheduled_lr):
    """Adagrad's step size `lr / (1 + (step - 1) * lr_decay)` changes every step with the counter
    Python knows: a number the stand-in computes, as Adam's bias corrections. The counters end
    where eager's do."""
    make, step = tanh_mlp(torch.optim.Adagrad, **kw), plain_step
    if scheduled_lr:
        make, step = scheduled(make, lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97))
    steps_replayed(check_counted(make, step), untraced=12)


@pytest.mark.parametrize("kw", [dict(lr=5e-2, lr_decay=1e-2, foreach=True),
                                dict(lr=5e-2, lr_decay=1e-3, weight_decay=1e-3, maximize=True, foreach=True)],
                         ids=["foreach", "foreach-decay-maximize"])
def test_foreach_adagrad_steps_are_replayed_bitwise(kw):
    """Its step sizes reach `_foreach_mul_` as a list, one element per parameter (fed floats)."""
    r = check(*scheduled(tanh_mlp(torch.optim.Adagrad, **kw), lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)))
    steps_replayed(r, untraced=12)


def test_fused_adagrad_steps_under_a_schedule_are_replayed_bitwise():
    """`_fused_adagrad_` computes its step sizes from the counters itself; it receives `lr`."""
    r = check(*scheduled(tanh_mlp(torch.optim.Adagrad, lr=5e-2, lr_decay=1e-2, fused=True),
                         lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)))
    steps_replayed(r)


@pytest.mark.parametrize("kw", [dict(lr=1.0), dict(lr=0.5, rho=0.8, weight_decay=1e-3, maximize=True),
                                dict(lr=1.0, foreach=True)], ids=["plain", "rho-decay-maximize", "foreach"])
def test_adadelta_steps_under_a_schedule_are_replayed_bitwise(kw):
    """Adadelta, like RMSprop: `-lr` per parameter (or per foreach group); counters never read."""
    r = check(*scheduled(tanh_mlp(torch.optim.Adadelta, **kw), lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)))
    steps_replayed(r)


@pytest.mark.parametrize("kw", [dict(lr=2e-2), dict(lr=2e-2, betas=(0.8, 0.99), weight_decay=1e-3, maximize=True),
                                dict(lr=2e-2, foreach=True), dict(lr=2e-2, weight_decay=1e-3, foreach=True)],
                         ids=["plain", "betas-decay-maximize", "foreach", "foreach-decay"])
def test_adamax_steps_are_replayed_bitwise_with_the_step_counters_known(kw):
    """Adamax's step size `lr / (1 - beta1 ** step)` changes every step with the counter Python
    knows, as Adam's bias corrections; a scheduled learning rate too. The counters end where
    eager's do."""
    make, step = scheduled(tanh_mlp(torch.optim.Adamax, **kw), lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97))
    steps_replayed(check_counted(make, step), untraced=12)


def test_adamax_under_one_cycle_keeps_beta1_a_number_and_replays_bitwise():
    """OneCycleLR cycles beta1 with the learning rate: `1 - beta1` reaches `exp_avg.lerp_` as a
    number of the replay, not a new key every step."""
    r = check(*scheduled(tanh_mlp(torch.optim.Adamax, lr=2e-2),
                         lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)))
    steps_replayed(r, untraced=12)


# ---- NAdam, RAdam and Rprop ----------------------------------------------------------------------


def check_state(make: Callable[[], tuple[nn.Module, torch.optim.Optimizer]], step: Callable[..., None],
                names: tuple[str, ...], max_fallbacks: int = 1):
    """`check`, with the optimizer's state tensors `names` of every parameter read after the last
    step: bitwise where eager's are (a replay teaches Python the new values of the small ones it
    writes, the step counters and NAdam's momentum products, without running the body)."""
    states: list[list[torch.Tensor]] = []

    def stepped(model, opt, i, log):
        step(model, opt, i, log)
        if i == STEPS - 1:
            states.append([opt.state[p][name].clone() for p in model.parameters() for name in names])

    r = check(make, stepped, max_fallbacks=max_fallbacks)  # (the last iteration reads the state: a new path)
    assert len(states[0]) == len(states[1]) > 0
    for a, b in zip(*states):
        assert torch.equal(a, b), (a, b)
    return r


def exponential(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)


@pytest.mark.parametrize("kw", [
    dict(lr=2e-2),
    # (mu near beta1 = 0.99 soon: the products stay large enough that an ulp of theirs shows in
    # the step sizes, `1 - mu_product`; with the defaults they fall below 1e-14 in 40 steps)
    dict(lr=2e-2, betas=(0.99, 0.999), momentum_decay=5.0),
    dict(lr=2e-2, betas=(0.8, 0.99), weight_decay=1e-2, momentum_decay=8e-3, maximize=True),
    dict(lr=2e-2, weight_decay=1e-2, decoupled_weight_decay=True),
    dict(lr=2e-2, foreach=True),
    dict(lr=2e-2, betas=(0.99, 0.999), momentum_decay=5.0, weight_decay=1e-2, decoupled_weight_decay=True,
         foreach=True),
], ids=["plain", "slow-products", "betas-decay-maximize", "decoupled", "foreach", "foreach-slow-decoupled"])
def test_nadam_steps_are_replayed_bitwise_with_the_momentum_products_known(kw):
    """NAdam's step sizes follow from the step count and from `mu_product`, a float32 tensor it
    multiplies by `mu` every step and reads back: the stand-in computes both as torch does, the
    replay feeds the numbers and teaches the new values. Counters and products end where eager's
    do."""
    make, step = scheduled(tanh_mlp(torch.optim.NAdam, **kw), exponential)
    r = check_state(make, step, ("step", "mu_product"))
    steps_replayed(r, untraced=12)


def test_nadam_under_one_cycle_keeps_beta1_a_number_and_replays_bitwise():
    r = check(*scheduled(tanh_mlp(torch.optim.NAdam, lr=2e-2),
                         lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)))
    steps_replayed(r, untraced=12)


@pytest.mark.parametrize("kw", [
    dict(lr=1e-2),
    dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2, maximize=True),
    dict(lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True),
    dict(lr=1e-2, foreach=True),
    dict(lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True, foreach=True),
], ids=["plain", "betas-decay-maximize", "decoupled", "foreach", "foreach-decoupled"])
def test_radam_steps_are_replayed_bitwise_across_the_switch_to_rectified_updates(kw):
    """RAdam's single-tensor step runs other ops once `rho_t > 5` (after five or six steps, while
    this program co-executes): that flag is part of the key, so the plain update's memo is never
    replayed for a rectified step. The foreach step runs the same ops every step."""
    make, step = scheduled(tanh_mlp(torch.optim.RAdam, **kw), exponential)
    # (the switch is a path the traced iterations did not take: one fallback, as per op)
    r = check_state(make, step, ("step",), max_fallbacks=2)
    steps_replayed(r, untraced=14)


@pytest.mark.parametrize("kw", [
    dict(lr=1e-2),
    dict(lr=1e-2, etas=(0.4, 1.3), step_sizes=(1e-5, 0.5), maximize=True),
    dict(lr=1e-2, foreach=True),
], ids=["plain", "etas-sizes-maximize", "foreach"])
def test_rprop_steps_are_replayed_bitwise(kw):
    """Rprop issues the same ops every step (signs, masked writes, a clamp); its learning rate
    reaches no op (it only sets the first step sizes), so a scheduler does not change the key."""
    make, step = scheduled(tanh_mlp(torch.optim.Rprop, **kw), exponential)
    r = check_state(make, step, ("step", "step_size", "prev"))
    steps_replayed(r)
    assert r.runner["calls_recorded"] <= 3, r.runner


def test_asgd_steps_stay_per_op_and_exact():
    """ASGD reads tensors it refills from Python every step (`eta`, `mu`): no stand-in; its step runs
    per op, bitwise as eager."""
    r = check(tanh_mlp(torch.optim.ASGD, lr=1e-2), plain_step)
    assert r.runner["calls_replayed"] == 0, r.runner


class ComplexHead(nn.Module):
    """An MLP whose last layer has a complex weight."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.head = nn.Parameter(torch.randn(3, 16, dtype=torch.cfloat) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.relu(self.inp(x)).to(torch.cfloat) @ self.head.t()).abs()


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adadelta])
def test_complex_parameters_keep_the_step_per_op_and_exact(cls):
    """A complex parameter is stepped through `view_as_real` views (RMSprop, Adadelta): the
    stand-in keys no call with one, and the step runs per op, bitwise as eager."""
    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = ComplexHead()
        return model, cls(model.parameters(), lr=1e-2)

    r = check(make, plain_step)
    assert r.runner["calls_replayed"] == 0, r.runner
