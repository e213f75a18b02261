"""The graph worker's threads (csrc/runtime/worker_threads.h), in child processes whose intra-op
thread count the test sets: torch's default on a multi-core machine is all cores, and that is
where co-execution's worker and Python compete for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import terra_torch

LIMIT_S = 240

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not torch.backends.openmp.is_available(),
                                     reason="needs 2 cores and an OpenMP build of torch")


def run_child(source: str, **env_vars: str) -> dict:
    # TERRA_SPEED_CHECK=0: every iteration co-executes, the comparison is of results.
    env = dict(os.environ, TERRA_SPEED_CHECK="0", **env_vars)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True,
                          timeout=LIMIT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# A training loop whose results depend on the team: a full reduction over 2**20 floats (ATen
# splits the sum among the intra-op threads) and GEMMs of 6 rows (MKL computes those differently
# with 1 and 2 threads).
PROGRAM = """
    import json, os, torch, torch.nn as nn, torch.nn.functional as F
    import terra_torch
    torch.set_num_threads(2)

    def build():
        torch.manual_seed(0)
        model = nn.ModuleDict({"big": nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256)),
                               "small": nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32))})
        return model, torch.optim.SGD(model.parameters(), lr=1e-4)

    class Both(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x, s):
            out = self.model["big"](x)
            return (out * out).sum() / out.numel(), self.model["small"](s)

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4096, 64, generator=gen), torch.randn(6, 8, generator=gen)) for _ in range(3)]

    def step(model, opt, i):
        big, small = model(*batches[i % 3])
        loss = big + (small * small).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        return loss.detach()

    def run(threads, wrap, steps):
        torch.set_num_threads(threads)
        net, opt = build()
        model = terra_torch.wrap(Both(net)) if wrap else Both(net)
        losses = [step(model, opt, i) for i in range(steps)]
        if wrap:
            terra_torch.synchronize()
        return net, model, [l.item() for l in losses], [p.detach().clone() for p in net.parameters()]

    def team_changes(f):
        torch.set_num_threads(1); one = f()
        torch.set_num_threads(2); two = f()
        return not torch.equal(one, two)

    torch.manual_seed(3)
    a, w, v = torch.randn(6, 32), torch.randn(32, 32), torch.randn(2 ** 20)
    preconditions = {"gemm": team_changes(lambda: a @ w), "reduction": team_changes(lambda: v.sum())}
"""


@needs_two_cores
def test_coexecution_with_every_core_as_intra_op_threads_is_bitwise_eager():
    """torch's default team (2 threads on 2 cores): the worker keeps it, MKL's included, so the
    GEMMs and the full reduction give eager's bits. The guard of the worker's matrix products
    (csrc/runtime/team_guard.h) finds whether the 6-row GEMMs differ with one MKL thread (on
    most hosts they do: it keeps torch's team for them), and leaves the 4096-row ones
    uncalibrated (too large)."""
    out = run_child(PROGRAM + """
    _, _, eager, p_eager = run(2, False, 30)
    net, model, terra, p_terra = run(2, True, 30)
    s = terra_torch.stats(model)
    print(json.dumps({"pre": preconditions, "losses": eager == terra,
                      "params": all(torch.equal(a, b) for a, b in zip(p_eager, p_terra)),
                      "coexec": s.iterations["coexec"], "intra": s.runner["graph_intra_op_threads"],
                      "blas": s.runner["graph_blas_threads"], "team": s.worker_team}))
    """)
    # Otherwise the comparison below could not tell a worker with a smaller team. Whether MKL's
    # 6-row GEMM gives other bits with 2 threads depends on the host's CPU (it did on the hosts of
    # sessions 19-33; on an AMX host of session 34 no GEMM shape did): where it does not, the
    # guard must find no difference instead.
    gemm_differs = out["pre"].pop("gemm") and torch.backends.mkl.is_available()
    assert all(out["pre"].values()), f"1 and 2 threads gave the same bits here: the program proves nothing ({out})"
    assert out["coexec"] >= 25
    assert out["losses"] and out["params"], out
    assert out["intra"] == 2 and out["blas"] == 2
    if out["team"] is not None:  # (None: this torch has no MKL per-thread team)
        team = out["team"]
        assert team["large"] >= 1 and team["team_calls"] >= 30 * 2, team
        if gemm_differs:
            assert team["differ"] >= 1, team
            assert "other bits with one thread" in team["why"] and "[6, " in team["why"], team
        else:
            assert team["differ"] == 0 and team["same"] >= 1, team


# An MLP whose GEMMs (batch 32: rows of 32 and 64) MKL computes alike with 1 and 2 threads here.
MLP = """
    import json, torch, torch.nn as nn, torch.nn.functional as F
    import terra_torch
    torch.set_num_threads(2)

    def run(wrap, steps=60):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        model = terra_torch.wrap(net) if wrap else net
        gen = torch.Generator().manual_seed(1)
        batches = [(torch.randn(32, 32, generator=gen), torch.randint(0, 4, (32,), generator=gen)) for _ in range(4)]
        losses = []
        for i in range(steps):
            x, y = batches[i % 4]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            losses.append(loss.detach())
        if wrap:
            terra_torch.synchronize()
        return model, [l.item() for l in losses], [p.detach().clone() for p in net.parameters()]

    def same_with_one_thread(f):
        torch.set_num_threads(1); one = f()
        torch.set_num_threads(2); two = f()
        return torch.equal(one, two)

    torch.manual_seed(3)
    x, w1, w2, g = torch.randn(32, 32), torch.randn(64, 32), torch.randn(64, 64), torch.randn(32, 64)
    alike = all(same_with_one_thread(f) for f in (lambda: x @ w1.t(), lambda: g @ w2, lambda: g.t() @ x,
                                                  lambda: g.t() @ g))
"""


@needs_two_cores
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's team is what the guard sets")
def test_the_worker_runs_matrix_products_on_one_mkl_thread_where_their_layout_keeps_eagers_bits():
    """Every GEMM layout of the MLP gives the same bits with one MKL thread, so the worker runs
    them all on one thread (co-execution then beats eager at torch's default team, where it was
    3-5x slower), and 60 co-executed iterations stay bitwise equal to eager."""
    out = run_child(MLP + """
    _, eager, p_eager = run(False)
    model, terra, p_terra = run(True)
    s = terra_torch.stats(model)
    print(json.dumps({"alike": alike, "losses": eager == terra,
                      "params": all(torch.equal(a, b) for a, b in zip(p_eager, p_terra)),
                      "coexec": s.iterations["coexec"], "blas": s.runner["graph_blas_threads"],
                      "team": s.worker_team}))
    """)
    assert out["coexec"] >= 55
    assert out["losses"] and out["params"], out
    if not out["alike"]:
        pytest.skip(f"this machine's MKL computes the MLP's GEMMs differently with one thread: {out}")
    team = out["team"]
    # (Forward 3 GEMMs, backward 5 at least, per co-executed iteration.)
    assert team["one_thread_calls"] >= 8 * 55 and team["team_calls"] == 0, team
    assert team["same"] >= 5 and team["differ"] == 0 and team["why"] == "", team
    assert out["blas"] == 2  # (the worker's team itself stays torch's: only calibrated calls take one)


@needs_two_cores
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's team is what the guard sets")
def test_a_batch_of_a_new_size_keeps_eagers_bits():
    """32-row batches calibrate to one MKL thread; a 6-row batch (whose GEMM MKL computes
    differently with one thread here) reaches the worker's GEMMs before any op diverges (sizes are
    fed), and must still give eager's bits: its new layouts are calibrated when they come."""
    out = run_child("""
    import json, torch, torch.nn as nn
    import terra_torch
    torch.set_num_threads(2)

    def run(wrap):
        torch.manual_seed(0)
        w = torch.randn(32, 16, requires_grad=True)

        class M(nn.Module):
            def forward(self, x):
                return torch.tanh(x @ w)

        model = terra_torch.wrap(M()) if wrap else M()
        opt = torch.optim.SGD([w], lr=0.01)
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(32 if i < 20 else 6, 32, generator=gen) for i in range(30)]
        losses = []
        for x in xs:
            loss = model(x).sum()
            opt.zero_grad(); loss.backward(); opt.step()
            losses.append(loss.item())
        if wrap:
            terra_torch.synchronize()
        return losses, w.detach().clone(), terra_torch.stats(model).worker_team if wrap else None

    torch.manual_seed(3)
    a, b = torch.randn(6, 32), torch.randn(32, 16)
    torch.set_num_threads(1); one = a @ b
    torch.set_num_threads(2); differs = not torch.equal(one, a @ b)
    (eager, w_eager, _), (terra, w_terra, team) = run(False), run(True)
    print(json.dumps({"losses": eager == terra, "params": torch.equal(w_eager, w_terra), "differs": differs,
                      "team": team}))
    """)
    assert out["losses"] and out["params"], out
    team = out["team"]
    assert team["one_thread_calls"] > 0, team  # (the 32-row GEMMs)
    if out["differs"]:  # the 6-row forward GEMM kept torch's team, and the reason says which
        assert team["differ"] >= 1 and team["team_calls"] >= 1 and "[6, 32] [32, 16]" in team["why"], team


@needs_two_cores
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's team is what the switch sets")
def test_a_smaller_mkl_team_for_the_worker_is_opt_in():
    """TERRA_WORKER_BLAS_THREADS=1: the worker's MKL runs with one thread, its ATen team stays."""
    out = run_child(PROGRAM.replace("import terra_torch", "os.environ['TERRA_WORKER_BLAS_THREADS'] = '1'; import terra_torch")
                    + """
    net, model, terra, _ = run(2, True, 8)
    s = terra_torch.stats(model)
    print(json.dumps({"intra": s.runner["graph_intra_op_threads"], "blas": s.runner["graph_blas_threads"]}))
    """)
    assert out == {"intra": 2, "blas": 1}


@needs_two_cores
def test_the_worker_gives_its_openmp_pool_back_when_the_program_leaves_coexecution():
    """The worker's parallel regions give it an OpenMP pool (a second thread named terra_graph).
    When the program goes back to tracing (a batch of another size diverges), the Python thread's
    kernels must not share the cores with that idle pool: its thread exits."""
    out = run_child(PROGRAM + """
    import time

    def graph_threads():
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                pass
        return names.count("terra_graph")

    torch.set_num_threads(2)
    net, opt = build()
    model = terra_torch.wrap(Both(net))
    most = 0
    for i in range(12):
        step(model, opt, i)
        most = max(most, graph_threads())
    phases_before = dict(terra_torch.stats(model).iterations)
    # Another batch size: the co-executed iteration diverges, the next one traces.
    x, s = batches[0][0][:1000], batches[0][1]
    for i in range(2):
        big, small = model(x, s)
        loss = big + small.mean(); opt.zero_grad(); loss.backward(); opt.step()
    deadline = time.monotonic() + 10
    while graph_threads() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"most": most, "after": graph_threads(), "before": phases_before,
                      "phases": dict(terra_torch.stats(model).iterations)}))
    """)
    assert out["before"]["coexec"] >= 8, out
    assert out["most"] >= 2, f"the worker never had an OpenMP pool: nothing to give back ({out})"
    assert out["phases"]["tracing"] > out["before"]["tracing"], out
    assert out["after"] == 1, out


def test_a_speed_check_lost_to_eager_on_every_core_says_how_to_leave_python_one(monkeypatch):
    """The first verdict for eager names the cause when torch's team takes every core: the hint
    names the thread count that leaves Python a core, and says nothing where one is left."""
    from terra_torch import runtime

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    hint = runtime.every_core_hint()
    assert "all 4 cores" in hint and "torch.set_num_threads(3)" in hint
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert runtime.every_core_hint() == ""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert runtime.every_core_hint() == ""


# The child side of the guard's bitwise tests: `compare(make, inputs, steps, optimizer)` trains
# make() eagerly and under terra_torch.wrap at 2 threads from the same seed, inputs(i) giving
# the model's arguments of step i, and prints whether losses, parameters and buffers matched bit
# for bit, the co-executed iterations and the worker's team stats.
GUARD_LOOP = """
    import json, torch, torch.nn as nn, torch.nn.functional as F
    import terra_torch
    torch.set_num_threads(2)

    def compare(make, inputs, steps, optimizer=lambda params: torch.optim.SGD(params, lr=0.01)):
        def run(wrap):
            torch.manual_seed(0)
            m = make()
            model = terra_torch.wrap(m) if wrap else m
            opt = optimizer(m.parameters())
            losses = []
            for i in range(steps):
                loss = model(*inputs(i))
                opt.zero_grad(); loss.backward(); opt.step()
                losses.append(loss.detach())
            if wrap:
                terra_torch.synchronize()
            state = [t.detach().clone() for t in list(m.parameters()) + list(m.buffers())]
            return [l.item() for l in losses], state, terra_torch.stats(model) if wrap else None

        (eager, s_eager, _), (terra, s_terra, stats) = run(False), run(True)
        print(json.dumps({"losses": eager == terra, "params": all(torch.equal(a, b) for a, b in zip(s_eager, s_terra)),
                          "coexec": stats.iterations["coexec"], "team": stats.worker_team}))
"""


@needs_two_cores
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's team is what the guard sets")
def test_matrix_products_nested_in_another_ops_kernel_are_guarded_too():
    """addbmm's CPU kernel loops over addmm_: the outer call and the nested ones each have a
    layout of their own (a calibration of the outer runs the nested ones), and a loop of
    addbmm, baddbmm and addmv over batches of two sizes stays bitwise equal to eager."""
    out = run_child(GUARD_LOOP + """
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 16, 8) * 0.1)
            self.v = nn.Parameter(torch.randn(8) * 0.1)

        def forward(self, x):
            acc = torch.zeros(x.shape[1], 8)
            h = torch.addbmm(acc, x, self.w)                        # (4, n, 16) x (4, 16, 8)
            b = torch.baddbmm(h.expand(4, -1, -1), x, self.w)       # (4, n, 8)
            return torch.addmv(torch.zeros(x.shape[1]), h, self.v).sum() + b.square().mean()

    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 6 if i % 10 == 9 else 32, 16, generator=gen) for i in range(40)]
    compare(M, lambda i: (xs[i],), 40)
    """)
    assert out["losses"] and out["params"], out
    assert out["coexec"] >= 20, out
    team = out["team"]
    assert team["one_thread_calls"] + team["team_calls"] >= 20 * 3 and team["same"] + team["differ"] >= 4, team


@needs_two_cores
def test_norms_softmax_and_vml_calls_run_on_one_thread_with_eagers_bits():
    """ATen's own parallel regions: layer norm and batch norm (per row or channel), log-softmax
    and its backward, nll_loss, Adam's `sqrt` of a 4096-element state (VML above 2048 elements).
    Their layouts are calibrated to one thread, and 40 co-executed iterations at 2 threads stay
    bitwise equal to eager; a full reduction over 2**18 floats (not a guarded op) keeps the team."""
    out = run_child(GUARD_LOOP + """
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.ln = nn.LayerNorm(64)
            self.bn = nn.BatchNorm1d(64)
            self.b = nn.Linear(64, 10)

        def forward(self, x, y, big):
            h = self.bn(torch.tanh(self.ln(self.a(x))))
            return F.cross_entropy(self.b(h), y) + big.sum() * 1e-6

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(48, 64, generator=gen), torch.randint(0, 10, (48,), generator=gen),
             torch.randn(2 ** 18, generator=gen)) for _ in range(4)]
    compare(M, lambda i: data[i % 4], 40, lambda params: torch.optim.Adam(params, lr=1e-3))
    """)
    assert out["losses"] and out["params"], out
    assert out["coexec"] >= 30, out
    team = out["team"]
    if team is None:
        pytest.skip("the guard is not installed here (no MKL per-thread team)")
    # (Per iteration at least: 3 GEMMs forward, 4 backward, layer norm, batch norm, their
    # backwards, log-softmax, nll_loss and their backwards, and the 4096-element sqrt.)
    assert team["one_thread_calls"] >= 30 * 12, team
    assert team["same"] >= 12, team


@needs_two_cores
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's team is what the guard sets")
def test_a_verdict_holds_for_the_team_it_was_calibrated_with():
    """A layout calibrated against a team of 2 is calibrated again for a team of 3 (one thread
    may agree with 2 threads and not with 3): the second program's layouts are new verdicts, and
    both stay bitwise equal to eager."""
    out = run_child(MLP + """
    def verdicts():
        return terra_torch._C.runtime.team_guard()["same"] + terra_torch._C.runtime.team_guard()["differ"]

    results = {}
    for threads in (2, 3):
        torch.set_num_threads(threads)
        before = verdicts()
        _, eager, p_eager = run(False, steps=30)
        model, terra, p_terra = run(True, steps=30)
        results[threads] = {"same": eager == terra and all(torch.equal(a, b) for a, b in zip(p_eager, p_terra)),
                            "new": verdicts() - before, "coexec": terra_torch.stats(model).iterations["coexec"]}
    print(json.dumps(results))
    """)
    for threads in ("2", "3"):
        assert out[threads]["same"] and out[threads]["coexec"] >= 25, out
        assert out[threads]["new"] >= 5, out  # (3 forward GEMMs, 5 backward ones, per team)


@needs_two_cores
def test_guarded_calls_of_other_dtypes_views_and_out_arguments_keep_eagers_bits():
    """Layouts the guard keys and calibrates beyond the float GEMM: float64 and complex64
    products, a transposed (strided) factor, an out= tensor written in place, `exp` on a
    non-contiguous view, log-softmax over a middle dimension; 30 co-executed iterations at 2
    threads equal eager bit for bit."""
    out = run_child(GUARD_LOOP + """
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(24, 16, dtype=torch.float64) * 0.1)
            self.c = nn.Parameter(torch.randn(16, 16, dtype=torch.complex64) * 0.1)
            self.register_buffer("buf", torch.zeros(24, 24, dtype=torch.float64))

        def forward(self, x):
            h = x @ self.w                                    # (n, 16) float64
            with torch.no_grad():
                torch.mm(self.w, self.w.t(), out=self.buf)    # out=, a transposed factor
            z = (h.to(torch.complex64) @ self.c).abs()        # complex64 product
            e = torch.exp(h[:, ::2] * 0.01)                   # a strided view through VML
            s = torch.log_softmax(z.view(-1, 4, 4), dim=1)    # a middle dimension
            return h.square().mean() + self.buf.sum() * 1e-3 + z.float().mean() + e.mean() + s.float().mean()

    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(40, 24, dtype=torch.float64, generator=gen) for _ in range(3)]
    compare(M, lambda i: (xs[i % 3],), 36)
    """)
    assert out["losses"] and out["params"], out
    assert out["coexec"] >= 25, out
    if out["team"] is not None:
        assert out["team"]["one_thread_calls"] + out["team"]["team_calls"] >= 25 * 5, out["team"]


@needs_two_cores
def test_the_team_guard_can_be_switched_off():
    """TERRA_TEAM_GUARD=0: no guarded call, `worker_team` is None, the speed check does not settle
    by time (without the guard co-execution on several threads is 3-10x slower), and the results
    are eager's bits all the same."""
    out = run_child(MLP + """
    _, eager, p_eager = run(False, steps=20)
    model, terra, p_terra = run(True, steps=20)
    s = terra_torch.stats(model)
    print(json.dumps({"same": eager == terra and all(torch.equal(a, b) for a, b in zip(p_eager, p_terra)),
                      "team": s.worker_team, "calls": s.runner["graph_one_thread_calls"] + s.runner["graph_team_calls"],
                      "settle_s": model._terra_program._speed.settle_s, "coexec": s.iterations["coexec"]}))
    """, TERRA_TEAM_GUARD="0")
    assert out["same"] and out["coexec"] >= 15, out
    assert out["team"] is None and out["calls"] == 0 and out["settle_s"] == 0.0, out


@needs_two_cores
def test_python_gives_its_openmp_team_back_as_it_enters_coexecution():
    """Tracing runs kernels on the Python thread with torch's team of 2; the team's idle thread
    would spin on the core the graph worker needs. The first co-executed iteration gives it back
    (csrc/runtime/worker_threads.h), and with TERRA_OPENMP_POOL_RELEASE=0 it stays."""
    if not terra_torch._C.runtime.can_release_openmp_pool():
        pytest.skip("this OpenMP runtime cannot give a pool back (no omp_pause_resource_all)")
    source = """
        import json, os, torch, torch.nn as nn
        import terra_torch
        torch.set_num_threads(2)
        # A thread libgomp makes takes its creator's name at that moment: the Python thread is
        # named "pyteam" while its team is made (a parallel kernel), then named back, so that
        # the threads named "pyteam" are that team's (the worker thread, made later, and its
        # team are not, nor a team made anew later).
        def name_main(name):
            with open(f"/proc/self/task/{os.getpid()}/comm", "w") as f:
                f.write(name)

        def team_threads():
            return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pyteam"
                       for t in os.listdir("/proc/self/task"))

        original = open("/proc/self/comm").read().strip()
        name_main("pyteam")
        torch.randn(1 << 20).add_(1.0)  # at::parallel_for over 2**20 floats: the team of 2
        name_main(original)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(64, 64)

            def forward(self, x):
                return self.lin(x).relu().sum()

        model = terra_torch.wrap(Net())
        x = torch.randn(4096, 64)
        seen = []
        for i in range(8):
            model(x).backward()
            seen.append((model._terra_program._region_phase, team_threads()))  # (the phase it ran in)
        print(json.dumps(seen))
    """
    released = run_child(source)
    kept = run_child(source, TERRA_OPENMP_POOL_RELEASE="0")
    # (the phase of each iteration, the Python thread's first team's threads after it)
    assert kept[0][1] >= 1 and all(threads == kept[0][1] for phase, threads in kept), kept
    assert [phase for phase, _ in released] == [phase for phase, _ in kept], (released, kept)
    assert released[0] == ["tracing", kept[0][1]] and released[-1][0] == "coexec", released
    # Through tracing the team is there; from the first co-executed iteration on its idle thread is gone
    for phase, threads in released:
        assert threads == (0 if phase == "coexec" else kept[0][1]), released


def test_the_worker_runs_an_ops_cpu_kernel_not_its_composite_one():
    """The team guard's key (FPGA) is one a CompositeExplicitAutograd(NonFunctional) kernel is
    registered for, and an op's own kernel beats the guard's fallthrough: on the worker, every
    such op ran its composite kernel instead of its CPU one. F.mse_loss's is the default-backend
    wrapper of the structured op, whose out= call warned "An output with one or more elements
    was resized" in every co-executed iteration (eager never does). Such ops now fall through."""
    source = textwrap.dedent("""
        import json, torch, torch.nn.functional as F, terra_torch
        def run(terra, loss_fn):
            torch.manual_seed(0)
            model = torch.nn.Linear(10, 2)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            if terra:
                model = terra_torch.wrap(model)
            g = torch.Generator().manual_seed(1)
            losses = []
            for _ in range(20):
                x = torch.randn(16, 10, generator=g)
                loss = loss_fn(model(x), x[:, :2] * 3)
                opt.zero_grad(); loss.backward(); opt.step()
                losses.append(loss.detach())
            terra_torch.synchronize()
            coexec = terra_torch.stats(model).iterations["coexec"] if terra else 0
            return torch.stack(losses), [p.detach().clone() for p in model.parameters()], coexec, \
                (terra_torch.stats(model).worker_team if terra else None)
        out = {}
        for name in ("mse_loss", "smooth_l1_loss"):
            fn = getattr(F, name)
            le, pe, _, _ = run(False, fn)
            lt, pt, coexec, team = run(True, fn)
            out[name] = {"same": torch.equal(le, lt) and all(torch.equal(a, b) for a, b in zip(pe, pt)),
                         "coexec": coexec, "guard": team is not None}
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=LIMIT_S,
                          env=dict(os.environ, TERRA_SPEED_CHECK="0"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in out.items():
        assert r["same"] and r["coexec"] >= 15, (name, r)
    if not any(r["guard"] for r in out.values()):
        pytest.skip(f"the team guard is off on this machine (no per-thread BLAS team): {out}")
    assert "was resized" not in proc.stderr, proc.stderr[-2000:]
