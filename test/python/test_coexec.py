"""Co-execution against eager (issue 5, item 7): each program trains 50 iterations eagerly and
under terra_torch.wrap from the same seed; the logged values and the final parameters must match
bitwise, the runtime must have reached the co-execution phase, and the fallbacks are counted."""

from __future__ import annotations

import io
import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch

STEPS = 50


@pytest.fixture(autouse=True)
def _isolated():
    """A failing test must not leave its iteration open for the next one."""
    yield
    from terra_torch import runtime
    runtime.close_all()


@dataclass
class Run:
    log: list[Any]
    params: list[torch.Tensor]
    printed: str
    stats: Any = None
    stats_fallbacks: list = None  # type: ignore[assignment]
    explanation: Any = None  # terra_torch.explain of the wrapped model


def run(make: Callable[[], tuple[nn.Module, torch.optim.Optimizer, dict]],
        step: Callable[[nn.Module, torch.optim.Optimizer, int, list, dict], None],
        terra: bool, steps: int = STEPS, mode: str = "coexec") -> Run:
    torch.manual_seed(0)
    model, opt, state = make()
    if terra:
        model = terra_torch.wrap(model, mode=mode)
    log: list[Any] = []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i in range(steps):
            step(model, opt, i, log, state)
    stats = None
    if terra:
        terra_torch.synchronize()
        stats = terra_torch.stats(model)
        fallbacks = list(model._terra_program.fallbacks)
        explanation = terra_torch.explain(model)
        terra_torch.unwrap(model)
    params = [p.detach().clone() for p in model.parameters()]
    return Run(log, params, out.getvalue(), stats, fallbacks if terra else [], explanation if terra else None)


def check(make, step, max_fallbacks: int, steps: int = STEPS, mode: str = "coexec") -> Run:
    eager = run(make, step, terra=False, steps=steps)
    terra = run(make, step, terra=True, steps=steps, mode=mode)
    assert terra.log == eager.log
    assert terra.printed == eager.printed
    for a, b in zip(eager.params, terra.params):
        assert torch.equal(a, b)
    st = terra.stats
    assert st.iterations["coexec"] > 0, st
    assert st.fallbacks <= max_fallbacks, (st.fallbacks, [(f.iteration, f.reason, f.source_line) for f in terra.stats_fallbacks])
    return terra


def mlp(d_in: int = 8, hidden: int = 16, d_out: int = 1) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


_g = torch.Generator().manual_seed(1000)
DATASET = [(torch.randn(4, 8, generator=_g), torch.randn(4, 1, generator=_g)) for _ in range(7)]


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return DATASET[i % len(DATASET)]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)


def seeded_mlp(terra: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """mlp() and its sgd() from seed 0, the model wrapped when `terra`."""
    torch.manual_seed(0)
    m = mlp()
    opt = sgd(m)
    return (terra_torch.wrap(m) if terra else m), opt


def plain_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


# (a) a numpy call on a fetched value whose result feeds back in
def test_a_numpy_feedback():
    def make():
        m = mlp()
        return m, sgd(m), {"scale": torch.tensor(1.0)}

    def step(model, opt, i, log, state):
        x, y = data(i)
        loss = plain_step(model, opt, x * state["scale"], y)
        scale = 0.5 + 0.25 * np.tanh(loss.detach().numpy())  # third-party code on the value
        state["scale"] = torch.from_numpy(np.asarray(scale, dtype=np.float32))
        log.append(float(scale))

    check(make, step, max_fallbacks=0)


# (b) print(loss.item()) every k steps
def test_b_print_every_k():
    def make():
        m = mlp()
        return m, torch.optim.Adam(m.parameters(), lr=1e-2), {}

    def step(model, opt, i, log, state):
        loss = plain_step(model, opt, *data(i))
        if i % 5 == 0:
            print(f"step {i} loss {loss.item():.6f}")

    r = check(make, step, max_fallbacks=2)
    assert r.printed.count("loss") == STEPS // 5


# (c) a generator that yields which sub-network to run
def test_c_generator_schedule():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = mlp()
            self.b = mlp()

        def forward(self, x, which):
            return (self.a if which == "a" else self.b)(x)

    def schedule():
        while True:
            yield "a"
            yield "b"
            yield "b"

    def make():
        m = Two()
        return m, sgd(m), {"gen": schedule()}

    def step(model, opt, i, log, state):
        x, y = data(i)
        which = next(state["gen"])
        loss = F.mse_loss(model(x, which), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.append(which)

    check(make, step, max_fallbacks=3)


# (c) continued: a generator picks which experts run, so the optimizer's loop over the parameters
# with a gradient sees a different parameter at each position from one iteration to the next. Both
# experts' gradients exist when the update at a position reads one of them: "the producer that
# ran last" is the wrong one, and the graph must pick the producer Python read (a selected read).
def test_c_rotating_experts_optimizer_reads_the_gradient_python_read():
    class Routed(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(8, 12)
            self.experts = nn.ModuleList(nn.Linear(12, 12) for _ in range(4))
            self.head = nn.Linear(12, 1)
            self.calls = 0

        def route(self):
            first = self.calls % 4
            yield self.experts[first]
            yield self.experts[(first + 1) % 4]

        def forward(self, x):
            self.calls += 1
            h = torch.relu(self.stem(x))
            for expert in self.route():
                h = h + torch.relu(expert(h))
            return self.head(h)

    def make():
        m = Routed()
        return m, sgd(m), {}

    def step(model, opt, i, log, state):
        log.append(float(plain_step(model, opt, *data(i))))

    r = check(make, step, max_fallbacks=3)
    assert r.stats.iterations["coexec"] >= STEPS - 12, r.stats
    assert r.stats.runner["selected_reads"] >= 1, r.stats.runner


# (d) try/except around a tensor op that raises on some iterations
def test_d_try_except():
    def make():
        m = mlp()
        return m, sgd(m), {"proj": torch.randn(8, 8)}

    def step(model, opt, i, log, state):
        x, y = data(i)
        out = model(x)
        try:
            feats = x[:, :3] if i % 4 == 0 else x  # a shape the projection refuses
            extra = (feats @ state["proj"]).pow(2).mean()
        except RuntimeError as e:
            log.append(("raised", str(e)))
            extra = torch.zeros(())
        loss = F.mse_loss(out, y) + 0.01 * extra
        opt.zero_grad()
        loss.backward()
        opt.step()

    r = check(make, step, max_fallbacks=3)
    assert sum(1 for entry in r.log if entry[0] == "raised") == (STEPS + 3) // 4


# (d) continued: the error comes from a kernel's check of the data (an index out of range), which
# no placeholder shape can foresee. Co-execution checks such an op first wherever an except clause
# of the program covers it, so the exception is raised at the op, with eager's type and message.
class Bag(nn.Module):
    VOCAB = 20

    def __init__(self, catch: bool = True):
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, 8)
        self.head = nn.Linear(8, 1)
        self.catch = catch
        self.bad = 0
        self.last_error: tuple[str, str] | None = None

    def forward(self, ids):
        if not self.catch:
            return self.head(self.emb(ids).mean(dim=1))
        try:
            e = self.emb(ids)
        except IndexError as err:
            self.bad += 1
            self.last_error = (type(err).__name__, str(err))
            e = self.emb(ids.clamp(0, self.VOCAB - 1))
        return self.head(e.mean(dim=1))


_gi = torch.Generator().manual_seed(7)
IDS = [torch.randint(0, Bag.VOCAB, (4, 5), generator=_gi) for _ in range(6)]
for _k in (2, 5):
    IDS[_k][1, 2] = Bag.VOCAB + _k  # a corrupt id in every third batch


def bag_step(model, opt, i):
    return plain_step(model, opt, IDS[i % 6], torch.full((4, 1), float(i % 2)))


def test_d_kernel_error_caught_in_forward():
    def make():
        m = Bag()
        return m, sgd(m), {}

    def step(model, opt, i, log, state):
        bag_step(model, opt, i)
        log.append((model.bad, model.last_error))

    r = check(make, step, max_fallbacks=1)  # the first bad batch in co-execution finds no except path yet
    assert r.log[-1][0] == len([i for i in range(STEPS) if i % 3 == 2])
    assert r.log[-1][1][0] == "IndexError"
    assert r.stats.iterations["coexec"] >= STEPS - 5


def test_d_kernel_error_caught_around_the_step_call():
    """The except clause is in the loop that calls the step, above the frames of the iteration."""
    def train(terra: bool):
        torch.manual_seed(0)
        net = Bag(catch=False)
        opt = sgd(net)
        model = terra_torch.wrap(net) if terra else net
        caught = []
        for i in range(40):
            try:
                bag_step(model, opt, i)
            except IndexError as err:
                caught.append((i, str(err)))
        stats = None
        if terra:
            terra_torch.synchronize()
            stats = terra_torch.stats(model)
            terra_torch.unwrap(model)
        return caught, [p.detach().clone() for p in net.parameters()], stats

    eager_caught, eager_params, _ = train(False)
    caught, params, stats = train(True)
    assert caught == eager_caught and len(caught) == 13
    for a, b in zip(eager_params, params):
        assert torch.equal(a, b)
    assert stats.iterations["coexec"] >= 30, stats
    assert stats.fallbacks <= 2, stats


def test_kernel_error_nobody_catches_is_reported_then_checked_first():
    """No except clause covers the op: the graph meets the error after Python went on, so it
    surfaces late, naming the op and its line; from then on the op is checked first."""
    torch.manual_seed(0)
    net = Bag(catch=False)
    opt = sgd(net)
    model = terra_torch.wrap(net)

    def steps(batches):  # no try anywhere around the iteration
        for i in batches:
            bag_step(model, opt, i)

    with pytest.raises(RuntimeError) as late:  # at a later step, or at the latest when Python waits
        steps([0, 1, 3, 4] * 5 + [2, 0, 1])
        terra_torch.synchronize()
    message = str(late.value)
    assert "raised in the graph after Python had gone past it" in message, message
    assert "index out of range" in message and "test_coexec.py" in message, message
    # Learned: the same data now raises at the op, as in eager.
    with pytest.raises(IndexError, match="index out of range in self"):
        steps([0, 1, 3, 4] * 3 + [5])
    assert model._terra_program.phase == "coexec"
    before = terra_torch.stats(model).iterations["coexec"]
    steps([0, 1, 3, 4] * 3)
    terra_torch.synchronize()
    assert terra_torch.stats(model).iterations["coexec"] > before
    for p in net.parameters():
        assert torch.isfinite(p).all()


def test_graph_error_the_program_catches_leaves_earlier_values_readable():
    """A random op (never run ahead on the Python side) raises in the graph inside a try: the
    program catches the error and goes on with tensors of that iteration the graph computed
    before it (the model's output). They had lost their values with the graph (a segfault at
    y.pow(2)); now they keep them, and the run stays bitwise."""

    def train(terra: bool):
        torch.manual_seed(0)
        net = nn.Linear(8, 4)
        opt = sgd(net)
        model = terra_torch.wrap(net) if terra else net
        log = []
        for step in range(14):
            y = model(torch.randn(6, 8))
            sign = torch.tensor(-1.0 if step in (6, 10) else 1.0)  # negative probabilities
            try:
                drawn = torch.multinomial(y.softmax(-1) * sign, 1).sum().item()
            except RuntimeError as e:
                drawn = "invalid" if "probability tensor" in str(e) else str(e)
            loss = plain_step_on(y, opt)
            log.append((drawn, loss))
        if terra:
            terra_torch.synchronize()
            terra_torch.unwrap(model)
        return log, [p.detach().clone() for p in net.parameters()]

    def plain_step_on(y, opt):
        loss = y.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    (la, pa), (lb, pb) = train(False), train(True)
    assert [d for d, _ in la].count("invalid") == 2
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))


# (e) Python object mutation: counters, list appends, attributes changed in forward
def test_e_object_mutation():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.calls = 0
            self.history: list[int] = []
            self.gain = 1.0

        def forward(self, x):
            self.calls += 1
            self.history.append(self.calls)
            if self.calls % 10 == 0:
                self.gain = self.gain * 0.5  # the attribute changes what runs next
            return self.net(x)

    def make():
        m = Counting()
        return m, sgd(m), {}

    def step(model, opt, i, log, state):
        loss = plain_step(model, opt, *data(i))
        log.append((model.calls, len(model.history), model.gain))

    check(make, step, max_fallbacks=0)


# (f) an if on a tensor value
def test_f_if_on_tensor():
    def make():
        m = mlp()
        return m, sgd(m), {}

    def step(model, opt, i, log, state):
        x, y = data(i)
        loss = F.mse_loss(model(x), y)
        if loss > 1.0:
            loss = loss * 0.5
        opt.zero_grad()
        loss.backward()
        opt.step()

    check(make, step, max_fallbacks=4)


# (g) a Python loop with a data-dependent trip count
def test_g_data_dependent_loop():
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.layer = nn.Linear(8, 8)
            self.out = nn.Linear(8, 1)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            n = int(x.abs().sum().item() * 10) % 3 + 1
            for _ in range(n):
                h = torch.tanh(self.layer(h))
            return self.out(h)

    def make():
        m = Deep()
        return m, sgd(m), {}

    def step(model, opt, i, log, state):
        plain_step(model, opt, *data(i))

    # Backward reads every iteration's activations, so the loop is flattened (one copy of the
    # body per iteration, a switch where the trip count varies): each new trip count falls back
    # once and is merged; the three counts n = 1, 2, 3 then co-execute.
    r = check(make, step, max_fallbacks=6)
    assert r.stats.iterations["coexec"] >= STEPS // 2, r.stats
    e = r.explanation
    assert e.loops - e.unrolled_loops == 0 and e.switches >= 2, (e.loops, e.unrolled_loops, e.switches)


# (g') the same loop under no_grad: only the last iteration's value leaves the loop, so the graph
# keeps a prim::Loop driven by loop_cond
def test_g_data_dependent_loop_without_backward_keeps_prim_loop():
    class Refine(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp(8, 16, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            with torch.no_grad():
                h = x
                for _ in range(6):  # data-dependent: 2 to 4 rounds on this data
                    h = h * 0.5 + 0.05 * torch.tanh(self.net(h))
                    if h.abs().mean() < 0.12:
                        break
            return self.head(x + h)

    def make():
        m = Refine()
        return m, sgd(m), {}

    def step(model, opt, i, log, state):
        x, y = data(i)
        log.append(plain_step(model, opt, x * (1 + i % 3), y))

    r = check(make, step, max_fallbacks=6)
    assert r.stats.iterations["coexec"] >= STEPS // 2, r.stats
    e = r.explanation
    assert e.loops - e.unrolled_loops == 1, (e.loops, e.unrolled_loops)  # loops counts unrolled ones too


# (h) dropout and other RNG
def test_h_dropout_rng():
    def make():
        m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
        return m, sgd(m), {}

    def step(model, opt, i, log, state):
        x, y = data(i)
        x = x + 0.1 * torch.randn_like(x)  # noise drawn between iterations' ops
        plain_step(model, opt, x, y)

    check(make, step, max_fallbacks=0)


# (i) divergence after the optimizer updated the parameters in the same iteration
def test_i_divergence_after_update():
    def make():
        m = mlp()
        return m, torch.optim.Adam(m.parameters(), lr=1e-2), {}

    def step(model, opt, i, log, state):
        loss = plain_step(model, opt, *data(i))
        if i in (20, 33):  # a path no traced iteration took, after opt.step()
            log.append(float(model[0].weight.sum() + loss))

    r = check(make, step, max_fallbacks=2)
    # Iteration 20 diverges after opt.step() already ran in the graph; the path is learned,
    # so iteration 33 takes it in co-execution.
    assert r.stats.fallbacks == 1 and r.stats_fallbacks[0].iteration == 20


# (j) an RNN carrying its hidden state across iterations
def test_j_rnn_hidden_state():
    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.RNNCell(8, 16)
            self.head = nn.Linear(16, 1)

        def forward(self, x, h):
            h = self.cell(x, h)
            return self.head(h), h

    def make():
        m = Cell()
        return m, sgd(m), {"h": torch.zeros(4, 16), "running": torch.zeros(())}

    def step(model, opt, i, log, state):
        x, y = data(i)
        out, h = model(x, state["h"])
        loss = F.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["h"] = h.detach()  # a placeholder kept for the next iteration
        state["running"] = 0.9 * state["running"] + loss.detach()  # running loss, never read
        if i == STEPS - 1:  # a read no traced iteration made: one fallback, at the very end
            log.append(state["running"].item())

    r = check(make, step, max_fallbacks=1)
    assert r.stats.fallbacks == 1


# ---- lazy mode and errors ----------------------------------------------------------------------

def test_lazy_mode_matches_eager():
    def make():
        m = mlp()
        return m, sgd(m), {}

    def step(model, opt, i, log, state):
        loss = plain_step(model, opt, *data(i))
        log.append(loss.item())

    r = check(make, step, max_fallbacks=0, mode="lazy")
    assert r.stats.iterations["coexec"] > 0


def test_user_exception_propagates_and_training_continues():
    def make():
        m = mlp()
        return m, sgd(m), {}

    def train(terra: bool):
        torch.manual_seed(0)
        m, opt, _ = make()
        if terra:
            m = terra_torch.wrap(m)
        errors = []
        for i in range(30):
            try:
                loss = plain_step(m, opt, *data(i))
                if i == 15:
                    raise ValueError(f"user error at {loss.item():.5f}")
            except ValueError as e:
                errors.append((type(e), str(e)))
        if terra:
            terra_torch.synchronize()
            st = terra_torch.stats(m)
            terra_torch.unwrap(m)
            assert st.iterations["coexec"] > 0
        return errors, [p.detach().clone() for p in m.parameters()]

    e_err, e_params = train(False)
    t_err, t_params = train(True)
    assert e_err == t_err and len(e_err) == 1
    assert all(torch.equal(a, b) for a, b in zip(e_params, t_params))


def test_state_dict_synchronizes():
    torch.manual_seed(0)
    m = mlp()
    opt = sgd(m)
    m = terra_torch.wrap(m)
    for i in range(10):
        plain_step(m, opt, *data(i))
    sd = m.state_dict()  # ends the iteration and waits for the graph
    buf = io.BytesIO()
    torch.save(sd, buf)
    torch.save(opt.state_dict(), buf)  # momentum buffers were placeholders: now values
    st = terra_torch.stats(m)
    terra_torch.unwrap(m)
    assert st.iterations["coexec"] > 0

    torch.manual_seed(0)
    ref = mlp()
    ref_opt = sgd(ref)
    for i in range(10):
        plain_step(ref, ref_opt, *data(i))
    for k, v in ref.state_dict().items():
        assert torch.equal(v, sd[k])


def test_stats_report_phases():
    torch.manual_seed(0)
    m = mlp()
    opt = sgd(m)
    m = terra_torch.wrap(m)
    for i in range(12):
        loss = plain_step(m, opt, *data(i))
    loss.item()  # after the loop: a read the traced iterations never made (one fallback)
    terra_torch.synchronize()
    st = terra_torch.stats(m)
    terra_torch.unwrap(m)
    # Iteration 0's optimizer step creates the momentum buffers, so iteration 1 is new too;
    # iteration 2 repeats it and the graph is generated.
    assert st.iterations["tracing"] == 3 and st.iterations["coexec"] == 9
    assert st.transitions == [(2, "tracing", "coexec"), (11, "coexec", "tracing")]
    assert st.fallbacks == 1
    assert st.graph_exec_s > 0 and st.python_exec_s > 0
    assert st.runner["python_placeholders"] > 0


def test_h_explicit_generator_object_is_drawn_from_in_program_order():
    # One torch.Generator object for the whole run, passed to the RNG ops: the graph draws from
    # that very object, in the program's order (RNG ops are gated), so the numbers and the
    # generator's state afterwards are eager's.
    def make():
        m = mlp()
        return m, sgd(m), {"gen": torch.Generator().manual_seed(5)}

    def step(model, opt, i, log, state):
        x, y = data(i)
        noise = torch.randn(x.shape, generator=state["gen"]) * 0.1
        keep = torch.bernoulli(torch.full((4, 1), 0.8), generator=state["gen"])
        loss = plain_step(model, opt, x + noise, y * keep)
        if i % 10 == 9:
            log.append((float(loss), float(torch.rand((), generator=state["gen"]))))

    r = check(make, step, max_fallbacks=1)
    assert r.stats.iterations["coexec"] >= STEPS - 5, r.stats


def test_h_another_generator_object_is_a_divergence():
    # A generator the graph draws from (bernoulli takes a tensor, so it is recorded and the graph
    # draws for it) is baked into the graph; an op passed another one must not run there (it
    # would draw from the wrong stream): a fallback, and the numbers stay eager's.
    def train(terra: bool):
        m, opt = seeded_mlp(terra)
        gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
        losses = []
        for i in range(24):
            x, _ = data(i)
            keep = torch.bernoulli(torch.full((4, 1), 0.7), generator=gens[0 if i < 12 else 1])
            losses.append(plain_step(m, opt, x, keep).detach())
        reasons = []
        if terra:
            terra_torch.synchronize()
            st = terra_torch.stats(m)
            reasons = [f.reason for f in m._terra_program.fallbacks]
            terra_torch.unwrap(m)
            assert st.iterations["coexec"] >= 8, st
        return [float(v) for v in losses], [p.detach().clone() for p in m.parameters()], reasons

    (la, pa, _), (lb, pb, reasons) = train(False), train(True)
    assert la == lb
    assert all(torch.equal(u, v) for u, v in zip(pa, pb))
    assert any("another torch.Generator" in r for r in reasons), reasons


def _generator_per_iteration(terra: bool, draw):
    """Trains 12 steps whose data or mask `draw(g, i)` draws from a new torch.Generator every
    iteration, seeded from Python; (parameters, stats, fallback reasons or None)."""
    m, opt = seeded_mlp(terra)
    for i in range(12):
        g = torch.Generator().manual_seed(i)
        x, y = draw(g, i)
        plain_step(m, opt, x, y)
    if not terra:
        return [p.detach().clone() for p in m.parameters()], None, None
    terra_torch.synchronize()
    params = [p.detach().clone() for p in m.parameters()]
    st, fb = terra_torch.stats(m), [f.reason for f in m._terra_program.fallbacks]
    terra_torch.unwrap(m)
    return params, st, fb


def test_factories_draw_from_a_new_generator_every_iteration_on_python():
    # torch.utils.data.RandomSampler's idiom (a new generator per epoch, seeded with
    # manual_seed, then randperm) and per-step data synthesis: a factory that draws from an
    # explicit generator runs where Python calls it (capture/draw_side.h), so a new
    # object every iteration is no new path, and the program co-executes without a fallback.
    def draw(g, i):
        order = torch.randperm(8, generator=g)
        x = torch.randn(8, 8, generator=g)[order[:4]]
        return x, torch.rand(4, 1, generator=g)

    (pa, _, _), (pb, st, fb) = _generator_per_iteration(False, draw), _generator_per_iteration(True, draw)
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert fb == [] and st.iterations["eager"] == 0 and st.iterations["coexec"] >= 8, (st.iterations, fb)


def test_dataloader_shuffle_epochs_stay_in_co_execution():
    # The loop most programs have: DataLoader(shuffle=True) over a TensorDataset whose size is
    # no multiple of the batch, several epochs. Each epoch's RandomSampler seeds a new generator
    # (from the default one, through the graph) and permutes with it; that used to be two
    # fallbacks per epoch (the new generator object, then the short last batch's path).
    from torch.utils.data import DataLoader, TensorDataset

    def train(terra: bool):
        m, opt = seeded_mlp(terra)
        loader = DataLoader(TensorDataset(torch.randn(60, 8), torch.randn(60, 1)), batch_size=8, shuffle=True)
        losses = []
        for _ in range(6):
            for x, y in loader:
                losses.append(plain_step(m, opt, x, y).detach())
        if not terra:
            return losses, [p.detach().clone() for p in m.parameters()], None
        terra_torch.synchronize()
        params, st = [p.detach().clone() for p in m.parameters()], terra_torch.stats(m)
        terra_torch.unwrap(m)
        return losses, params, st

    (la, pa, _), (lb, pb, st) = train(False), train(True)
    assert all(torch.equal(a, b) for a, b in zip(la, lb)) and len(la) == len(lb) == 48
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert st.iterations["eager"] == 0 and st.fallbacks <= 2 and st.iterations["coexec"] >= 40, st


def test_graph_drawn_generator_new_every_iteration_runs_eagerly_and_correctly():
    # An op with a tensor argument draws from the new generator in the graph, which cannot bake
    # in another object every iteration: the op is unsupported in the graph (issue 16, item 5),
    # so every iteration falls back there with the reason, and the program is not turned eager
    # for good by one op.
    def draw(g, i):
        x, _ = data(i)
        return x, torch.bernoulli(torch.full((4, 1), 0.5), generator=g)

    (pa, _, _), (pb, st, fb) = _generator_per_iteration(False, draw), _generator_per_iteration(True, draw)
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert st.iterations["eager"] == 0 and st.iterations["coexec"] > 0, st.iterations
    assert fb and all("torch.Generator" in r for r in fb), fb
    assert st.graph_builds == 1
    assert st.build_s > 0 and st.merge_s > 0, st  # (the boundary's own work, timed)


def test_wrap_rejects_bad_input():
    with pytest.raises(TypeError, match="nn.Module"):
        terra_torch.wrap(lambda x: x)
    with pytest.raises(ValueError, match="mode"):
        terra_torch.wrap(mlp(), mode="fast")
    with pytest.raises(ValueError, match="not wrapped"):
        terra_torch.stats(mlp())


def test_keyboard_interrupt_stops_cleanly():
    # Ctrl-C lands between two ops of an iteration: the loop stops, the graph finishes what
    # Python validated, and the parameters are exactly eager's after the same ops.
    def train(terra: bool):
        m, opt = seeded_mlp(terra)
        try:
            for i in range(40):
                x, y = data(i)
                loss = F.mse_loss(m(x), y)
                opt.zero_grad()
                loss.backward()
                if i == 25:
                    raise KeyboardInterrupt
                opt.step()
        except KeyboardInterrupt:
            pass
        if terra:
            terra_torch.synchronize()
            assert terra_torch.stats(m).iterations["coexec"] > 0
            terra_torch.unwrap(m)
        return [p.detach().clone() for p in m.parameters()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


def test_interpreter_exit_in_the_middle_of_an_iteration(tmp_path):
    # No synchronize(), no unwrap(): the process must still exit, promptly and without error.
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "exit_mid_iteration.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn.functional as F, terra_torch
        torch.manual_seed(0)
        m = terra_torch.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(20):
            loss = F.mse_loss(m(torch.ones(2, 4)), torch.zeros(2, 1))
            opt.zero_grad(); loss.backward(); opt.step()
        print("phase", m._terra_program.phase)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "phase coexec" in out.stdout
    assert "Traceback" not in out.stderr


def test_placeholder_read_from_another_thread_gets_the_value():
    import threading

    torch.manual_seed(0)
    m = terra_torch.wrap(mlp())
    opt = sgd(m)
    for i in range(6):
        loss = plain_step(m, opt, *data(i))
    assert terra_torch._C.is_placeholder(loss)
    result = {}

    def other():
        try:
            result["value"] = (loss.detach() * 2).item()
        except Exception as e:  # noqa: BLE001 - the test reports it
            result["error"] = e

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert not t.is_alive()
    terra_torch.synchronize()
    expected = loss.detach().item() * 2
    terra_torch.unwrap(m)
    assert "error" not in result, result
    assert result["value"] == expected


def test_rotating_experts_match_eager():
    # Which expert runs at which position changes every step: inside the optimizer's unrolled
    # loop, copy i of an update reads one of several gradients, not always the one that ran
    # last, so the graph picks the one Python read (a selected read) instead of falling back.
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.calls = 0

        def forward(self, h):
            self.calls += 1
            for j in range(2):
                h = self.experts[(self.calls + j) % 3](h)
            return h

    def train(terra: bool):
        torch.manual_seed(0)
        net = Pair()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        if terra:
            net = terra_torch.wrap(net)
        losses = []
        for _ in range(40):
            loss = F.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if terra:
            terra_torch.synchronize()
            stats = terra_torch.stats(net)
            assert stats.iterations["coexec"] >= 30 and stats.fallbacks <= 3, stats
            terra_torch.unwrap(net)
        return losses, [p.detach().clone() for p in net.parameters()]

    (a, pa), (b, pb) = train(False), train(True)
    assert a == b
    assert all(torch.equal(u, v) for u, v in zip(pa, pb))


def test_two_wrapped_models_taking_turns():
    # A GAN step with both networks wrapped: values cross between the two programs.
    def train(terra: bool):
        torch.manual_seed(0)
        G = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        D = nn.Linear(8, 1)
        og = torch.optim.SGD(G.parameters(), lr=0.05)
        od = torch.optim.SGD(D.parameters(), lr=0.05)
        if terra:
            G, D = terra_torch.wrap(G), terra_torch.wrap(D)
        real = torch.randn(8, 8)
        zs = [torch.randn(8, 4) for _ in range(5)]
        losses = []
        for i in range(20):
            fake = G(zs[i % 5])
            loss_d = F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()
            od.zero_grad()
            loss_d.backward()
            od.step()
            loss_g = F.softplus(-D(fake)).mean()
            og.zero_grad()
            loss_g.backward()
            og.step()
            losses.append((loss_d.item(), loss_g.item()))
        if terra:
            terra_torch.synchronize()
            assert terra_torch.stats(D).iterations["coexec"] > 0
            terra_torch.unwrap(G)
            terra_torch.unwrap(D)
        return losses, [p.detach().clone() for p in list(G.parameters()) + list(D.parameters())]

    (a, pa), (b, pb) = train(False), train(True)
    assert a == b
    assert all(torch.equal(u, v) for u, v in zip(pa, pb))


def test_python_runs_at_most_two_iterations_ahead_of_a_slower_graph():
    """A graph-bound program (large matmuls, a tiny Python side): Python may start an iteration
    only while at most two earlier ones still run on the graph. Unbounded, Python ran the whole
    loop ahead and every iteration's batch and values stayed alive until the graph got there."""
    torch.manual_seed(0)
    layer = nn.Linear(384, 384)
    model = terra_torch.wrap(nn.Sequential(layer, nn.Tanh(), nn.Linear(384, 384), nn.Tanh()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(3)
    ahead = []
    try:
        for i in range(40):
            x = torch.randn(512, 384, generator=g)  # a batch made each step, as a data loader does
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            st = terra_torch.stats(model)
            # (iterations counts the ones that ended, the open one is not counted yet)
            if st.iterations["coexec"] > 0:
                ahead.append(st.iterations["coexec"] + 1 - st.runner["graph_iterations_run"])
        terra_torch.synchronize()
        st = terra_torch.stats(model)
    finally:
        terra_torch.unwrap(model)
    assert st.iterations["coexec"] >= 30, st
    coexec = ahead[-25:]
    assert max(coexec) <= 3, coexec  # two running or queued, plus the one Python is in
    assert max(coexec) >= 2, coexec  # (the graph is the slower side here: Python does run ahead)


def test_eager_writes_after_synchronize_are_what_the_next_iteration_reads():
    """terra_torch.synchronize() where an iteration ends, then gradients scaled by hand before the
    next forward (outside any iteration, so eagerly): the next iteration accumulates into the
    scaled memory. The runner used to keep the gradients linked to the values its table held
    for them, and fed those: the hand-made scaling was lost."""
    def make():
        return mlp(), None, {}

    def step(model, opt, i, log, state):
        if "opt" not in state:
            state["opt"] = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = state["opt"]
        if i % 7 == 3:
            terra_torch.synchronize()  # (a no-op eagerly)
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
        x, y = data(i)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # accumulates: zero_grad only every third step
        if i % 3 == 2:
            opt.step()
            opt.zero_grad()
        log.append(loss.item())

    terra = check(make, step, max_fallbacks=2, steps=60)
    assert terra.stats.iterations["coexec"] >= 40, terra.stats.iterations


def test_the_boundary_wraps_forward_and_unwrap_gives_back_the_modules_own():
    """The iteration boundary is a wrapper around forward (api.wrap): user hooks still run once
    per call and may change the inputs, forward keeps its signature, and unwrap restores exactly
    what the module had, the class's forward or an instance attribute the user had set."""
    import inspect
    import types

    def scaled_forward(self, x, scale: float = 1.0):
        return self.fc2(torch.relu(self.fc1(x * scale)))

    def make() -> tuple[nn.Module, torch.optim.Optimizer, dict]:
        m = nn.Sequential()
        m.fc1, m.fc2 = nn.Linear(6, 12), nn.Linear(12, 2)
        m.forward = types.MethodType(scaled_forward, m)  # the user's own instance forward
        calls = {"pre": 0, "post": 0}

        def pre(module, args):
            calls["pre"] += 1
            return (args[0] + 0.25,)  # a pre-hook that changes the input

        def post(module, args, out):
            calls["post"] += 1

        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
        return m, torch.optim.SGD(m.parameters(), lr=0.05), {"calls": calls, "forward": m.forward}

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(4, 6, generator=g) for _ in range(4)]

    def step(model, opt, i, log, state):
        loss = model(xs[i % 4], scale=0.5 + 0.5 * (i % 2 == 0)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.append(loss.detach())

    runs = []
    for terra in (False, True):
        torch.manual_seed(0)
        model, opt, state = make()
        own = state["forward"]
        if terra:
            model = terra_torch.wrap(model)
            assert inspect.signature(model.forward) == inspect.signature(own)
        log: list = []
        for i in range(STEPS):
            step(model, opt, i, log, state)
        if terra:
            terra_torch.synchronize()
            st = terra_torch.stats(model)
            terra_torch.unwrap(model)
            assert st.iterations["coexec"] >= STEPS - 5, st.iterations
            assert model.__dict__["forward"] is own  # the user's attribute, not a terra wrapper
        assert state["calls"] == {"pre": STEPS, "post": STEPS}
        runs.append((log, [p.detach().clone() for p in model.parameters()]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))

    plain = nn.Linear(3, 3)
    terra_torch.wrap(plain)
    assert "forward" in plain.__dict__
    import copy
    import pickle
    copied = copy.deepcopy(plain)  # an ordinary module (an EMA copy): the program is not copied
    assert "forward" not in copied.__dict__ and getattr(copied, "_terra_program", None) is None
    assert not copied._state_dict_pre_hooks and not copied._load_state_dict_pre_hooks
    assert all(torch.equal(a, b) for a, b in zip(copied.parameters(), plain.parameters()))
    assert plain._terra_program is not None  # the original stays wrapped
    loaded = pickle.loads(pickle.dumps(plain))  # torch.save(model): what eager would write
    assert "forward" not in loaded.__dict__ and getattr(loaded, "_terra_program", None) is None
    assert not loaded._state_dict_pre_hooks and not loaded._load_state_dict_pre_hooks
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), plain.parameters()))
    assert plain._terra_program is not None and "__reduce_ex__" in plain.__dict__  # still wrapped
    terra_torch.unwrap(plain)
    assert "forward" not in plain.__dict__ and plain.forward.__func__ is nn.Linear.forward
    assert "__reduce_ex__" not in plain.__dict__ and "__deepcopy__" not in plain.__dict__
    twin = copy.deepcopy(plain)  # unwrapped, it is a plain module again
    x = torch.randn(2, 3)
    assert torch.equal(twin(x), plain(x))


def test_torch_save_of_a_wrapped_model_mid_training():
    """`torch.save(model, f)` of a wrapped module raised "Can't pickle local object
    'wrap.<locals>.sync_all'" (session 31 hunt). It now writes what eager writes, after the graph
    has finished the updates it owed: the loaded module equals eager's at that step, and the
    wrapped one trains on, co-executing, bit for bit with eager."""
    import io

    def run(terra: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if terra:
            model = terra_torch.wrap(model, speed_check=False)
        g = torch.Generator().manual_seed(1)
        losses, saved = [], None
        for i in range(40):
            loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if i == 25:
                buf = io.BytesIO()
                torch.save(model, buf)
                buf.seek(0)
                saved = torch.load(buf, weights_only=False)
        if terra:
            terra_torch.synchronize()
            assert terra_torch.stats(model).iterations["coexec"] >= 30
        return losses, [p.detach().clone() for p in model.parameters()], saved

    e_losses, e_params, e_saved = run(False)
    t_losses, t_params, t_saved = run(True)
    assert all(torch.equal(a, b) for a, b in zip(e_losses, t_losses))
    assert all(torch.equal(a, b) for a, b in zip(e_params, t_params))
    assert all(torch.equal(a, b) for a, b in zip(e_saved.parameters(), t_saved.parameters()))
    assert "forward" not in t_saved.__dict__ and getattr(t_saved, "_terra_program", None) is None
    x = torch.randn(3, 6)
    assert torch.equal(e_saved(x), t_saved(x))
