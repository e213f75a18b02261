"""The speed check (terra_torch/_speed.py): a program whose co-execution is slower than eager
runs eagerly, with the same numbers.

The decision logic is tested on given times; the switching between co-execution and eager is
tested on real training loops with a forced schedule (timing on a shared machine decides
nothing reliably), bitwise against eager.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch
from terra_torch._speed import COEXEC, EAGER, SpeedCheck

from forced_speed import Forced


def feed(check: SpeedCheck, times: dict[str, float], n: int, start: int = 0) -> list[str]:
    """Runs `n` iterations, each in the mode the check asked for, taking times[mode]."""
    modes = []
    mode = check.mode
    for i in range(start, start + n):
        modes.append(mode)
        mode = check.observe(mode, times[mode], i)
    return modes


def test_slower_coexecution_moves_to_eager_after_both_are_measured_in_turns():
    check = SpeedCheck(first_after=10, window=4, settle=2, interval=8, max_interval=32)
    modes = feed(check, {COEXEC: 1.4, EAGER: 1.0}, 22)
    # 10 co-executed (the last 2 measured), then eager, co-executed and eager again: 2 to settle
    # after each switch and 2 measured each time.
    assert "".join(m[0] for m in modes) == "c" * 10 + "e" * 4 + "c" * 4 + "e" * 4
    first = check.verdicts[0]
    assert (first.iteration, first.coexec_s, first.eager_s, first.chosen) == (21, 1.4, 1.0, EAGER)
    assert check.mode == EAGER and check.next_check_in == 8


def test_a_burst_of_load_in_one_block_does_not_decide():
    """Co-execution is faster, but one of its blocks is measured while another process runs:
    with the modes measured in turns the median still sees the faster mode."""
    check = SpeedCheck(first_after=4, window=4, settle=0, settle_s=0.0, interval=50)
    times = iter([1.0, 1.0, 1.0, 1.0,   # skipped (first_after - window // 2 = 2), then block 1
                  1.5, 1.5,             # eager
                  9.0, 9.0,             # co-executed during a burst of load
                  1.5, 1.5])            # eager
    mode = check.mode
    for i in range(10):
        mode = check.observe(mode, next(times), i)
    v = check.verdicts[0]
    # Each mode's faster block: co-executed 1.0 (the burst's block is 9.0), eager 1.5.
    assert (v.coexec_s, v.eager_s, v.chosen) == (1.0, 1.5, COEXEC), v
def test_blocks_settle_for_a_time_after_a_switch_where_teams_can_spin(monkeypatch):
    """With more than one intra-op thread, a block starts `settle_s` after a switch (and after
    tracing), however many iterations that takes: OpenMP team threads of the mode just left spin
    on the core the other mode needs for tens of milliseconds. With one thread, no wait."""
    times = {COEXEC: 1 / 64, EAGER: 1 / 64}  # (exact in binary: the sums below are exact)
    check = SpeedCheck(first_after=4, window=4, settle=1, settle_s=4 / 64, interval=50)
    modes = "".join(m[0] for m in feed(check, times, 28))
    # co-executed: 4 to settle (first_after - window // 2 = 2 iterations, but 4/64 s) + a block of
    # 2; eager: 4 to settle (1 iteration, but 4/64 s) + 2; then the same again.
    assert modes == ("c" * (4 + 2) + "e" * (4 + 2)) * 2 + "c" * 4, modes
    assert check.verdicts and check.verdicts[0].iteration == 23
    # Where Python's pool is given back as it enters co-execution, co-executed blocks settle for
    # `settle` iterations only (and the first one for first_after's); eager blocks still for 4/64 s.
    check = SpeedCheck(first_after=4, window=4, settle=1, settle_s=4 / 64, interval=50, coexec_settle_s=0.0)
    modes = "".join(m[0] for m in feed(check, times, 19))
    assert modes == "c" * (2 + 2) + "e" * (4 + 2) + "c" * (1 + 2) + "e" * (4 + 2), modes
    assert check.verdicts and check.verdicts[0].iteration == 18
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    check = SpeedCheck(first_after=4, window=4, settle=1, interval=50)  # settle_s: by the threads
    modes = "".join(m[0] for m in feed(check, times, 11))
    assert modes.startswith("c" * (2 + 2) + "e" * (1 + 2) + "c" * (1 + 2)), modes
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    check = SpeedCheck(first_after=4, window=4, settle=1, interval=50)
    modes = "".join(m[0] for m in feed(check, times, 11))
    # SETTLE_S (50 ms): 4 iterations of 1/64 s to settle (3 are 47 ms), then a block of 2.
    assert modes.startswith("c" * (4 + 2) + "e"), modes


def test_the_interval_between_checks_doubles_while_the_decision_stays():
    check = SpeedCheck(first_after=4, window=2, settle=1, interval=5, max_interval=20)
    feed(check, {COEXEC: 1.0, EAGER: 1.2}, 300)  # (within `favoured`: every block measured)
    assert all(v.chosen == COEXEC for v in check.verdicts)
    gaps = [b.iteration - a.iteration for a, b in zip(check.verdicts, check.verdicts[1:])]
    # Each gap is the interval plus one check (4 blocks of 1, 3 switches of 1 to settle).
    assert gaps[:4] == [10 + 7, 20 + 7, 20 + 7, 20 + 7], gaps


def test_coexecution_stays_within_the_margin():
    check = SpeedCheck(first_after=4, window=4, settle=1, interval=5, margin=0.05)
    feed(check, {COEXEC: 1.04, EAGER: 1.0}, 40)
    assert check.verdicts and all(v.chosen == COEXEC for v in check.verdicts)
    check = SpeedCheck(first_after=4, window=4, settle=1, interval=5, margin=0.05)
    feed(check, {COEXEC: 1.06, EAGER: 1.0}, 40)
    assert check.verdicts[0].chosen == EAGER


def test_a_measurement_starts_over_when_the_program_falls_back():
    check = SpeedCheck(first_after=2, window=2, settle=2, interval=5)
    assert check.observe(COEXEC, 1.0, 0) == COEXEC  # (skipped: first_after - 1)
    assert check.observe(COEXEC, 1.0, 1) == EAGER   # the first block measured: eager next
    check.restart()  # (a divergence: the check starts over from co-execution, 2 settle)
    assert [check.observe(COEXEC, 1.0, i) for i in range(2, 5)] == [COEXEC, COEXEC, EAGER]
    # A divergence before the first measurement does not shorten the wait for it.
    check = SpeedCheck(first_after=10, window=2, settle=1, interval=5)
    check.observe(COEXEC, 1.0, 0)
    check.restart()
    assert [check.observe(COEXEC, 1.0, i) for i in range(1, 10)] == [COEXEC] * 8 + [EAGER]


def test_a_change_of_the_graph_side_is_measured_again_soon():
    # Co-execution was slower while segments compiled (the compiler took a core), so eager was
    # chosen for 200 iterations; compiled code arrives: recheck() measures again after `settle`
    # iterations, and the faster co-execution is chosen.
    check = SpeedCheck(first_after=4, window=2, settle=2, interval=200)
    feed(check, {COEXEC: 1.4, EAGER: 1.0}, 13)
    assert check.verdicts[0].chosen == EAGER and check.mode == EAGER and check.next_check_in == 200
    check.recheck()
    modes = feed(check, {COEXEC: 0.5, EAGER: 1.0}, 20, start=13)
    assert check.verdicts[-1].chosen == COEXEC and len(check.verdicts) == 2
    assert modes.index(COEXEC) <= 2 + 1 + 1 + 2  # settle, the eager block, then co-execution
    # During a measurement, recheck() starts it over from co-execution.
    check = SpeedCheck(first_after=2, window=2, settle=2, interval=5)
    assert check.observe(COEXEC, 1.0, 0) == COEXEC
    assert check.observe(COEXEC, 1.0, 1) == EAGER
    check.recheck()
    assert [check.observe(EAGER, 1.0, 2)] + [check.observe(COEXEC, 1.0, i) for i in range(3, 6)] == \
        [COEXEC, COEXEC, COEXEC, EAGER]


def feed_waiting(check: SpeedCheck, times: dict[str, float], n: int, waited: float) -> str:
    """Like feed, and co-executed iterations report that Python waited `waited` of their time
    for the graph."""
    modes, mode = [], check.mode
    for i in range(n):
        modes.append(mode)
        t = times[mode]
        mode = check.observe(mode, t, i, t * waited if check.probing else None)
    return "".join(m[0] for m in modes)


def test_a_program_waiting_for_its_graph_is_checked_at_once():
    # Python waits for the graph most of the time (its kernels fight Python for a core): the
    # probe (co-executed iterations 4-14) starts the first check at once, with its iterations as
    # the check's co-executed block, and the check ends as soon as eager's first 3 iterations
    # (after 5 to settle) are each under half the co-executed median.
    times = {COEXEC: 3.0, EAGER: 0.4}
    check = SpeedCheck(window=20, settle=5)
    modes = feed_waiting(check, times, 60, waited=0.8)
    assert modes == "c" * (4 + 10) + "e" * 46, modes
    assert check.verdicts[0].chosen == EAGER and check.verdicts[0].iteration == 14 + 5 + 3 - 1
    # Python waits little: the first check comes after `first_after` co-executed iterations.
    check = SpeedCheck(window=20, settle=5)
    modes = feed_waiting(check, times, 200, waited=0.2)
    assert modes.index("e") == 40
    assert check.verdicts[0].chosen == EAGER and check.verdicts[0].iteration < 60
    # The probe starts over after a fallback (its iterations must be of one graph).
    check = SpeedCheck(window=20, settle=5)
    for i in range(10):
        check.observe(COEXEC, 3.0, i, 2.9 if check.probing else None)
    check.restart()
    assert check.probing


def test_a_decisive_gap_ends_a_check_early_in_both_directions():
    # Co-execution at 7x eager's time: a recheck from eager costs one eager block, `settle` and
    # 3 co-executed iterations, not two blocks of each.
    check = SpeedCheck(first_after=20, window=20, settle=5, interval=200, max_interval=12800)
    modes = feed(check, {COEXEC: 2.8, EAGER: 0.4}, 2000)
    assert all(v.chosen == EAGER for v in check.verdicts) and len(check.verdicts) >= 4
    assert modes.count(COEXEC) <= 20 + 5 + 3 + (len(check.verdicts) - 1) * (5 + 3), modes.count(COEXEC)
    # Co-execution at a third of eager's time: eager's block ends after 3 iterations.
    check = SpeedCheck(first_after=20, window=20, settle=5, interval=200)
    modes = feed(check, {COEXEC: 0.3, EAGER: 0.9}, 40)
    assert "".join(m[0] for m in modes[:40]) == "c" * 20 + "e" * (5 + 3) + "c" * 12
    assert check.verdicts[0].chosen == COEXEC
    # Within the decisive factor every block is measured, as before.
    check = SpeedCheck(first_after=4, window=4, settle=1, interval=50)
    feed(check, {COEXEC: 1.45, EAGER: 1.0}, 2 + 2 + (1 + 2) * 3 - 1)  # (skip, 4 blocks, 3 settles)
    assert not check.verdicts
    feed(check, {COEXEC: 1.45, EAGER: 1.0}, 1, start=12)
    assert check.verdicts[0].chosen == EAGER and check.verdicts[0].iteration == 12


def test_eager_iterations_clearly_slower_end_a_check_for_coexecution_sooner():
    """Co-execution is where a program stays within the noise, so evidence for it needs less:
    3 eager iterations each beyond `favoured` times co-execution's median end the check (the
    quick suite's lstm, 1.4x faster co-executed, ran 30 eager iterations of its 140 before)."""
    check = SpeedCheck(first_after=20, window=20, settle=5, interval=200)
    modes = feed(check, {COEXEC: 1.0, EAGER: 1.35}, 40)
    assert "".join(m[0] for m in modes) == "c" * 20 + "e" * (5 + 3) + "c" * 12
    v = check.verdicts[0]
    assert (v.iteration, v.coexec_s, v.eager_s, v.chosen) == (27, 1.0, 1.35, COEXEC)
    # Below `favoured` every block is measured, as before.
    check = SpeedCheck(first_after=20, window=20, settle=5, interval=200)
    modes = feed(check, {COEXEC: 1.0, EAGER: 1.2}, 20 + 3 * 15)
    assert "".join(m[0] for m in modes) == "c" * 20 + "e" * 15 + "c" * 15 + "e" * 15
    assert check.verdicts[0].chosen == COEXEC and check.verdicts[0].iteration == 64
    # Not in eager's favour: co-execution 1.35x slower is measured in full (then left).
    check = SpeedCheck(first_after=20, window=20, settle=5, interval=200)
    modes = feed(check, {COEXEC: 1.35, EAGER: 1.0}, 20 + 3 * 15)
    assert "".join(m[0] for m in modes) == "c" * 20 + "e" * 15 + "c" * 15 + "e" * 15
    assert check.verdicts[0].chosen == EAGER
    # From eager (a recheck), co-executed iterations each 1.3x faster end it as soon.
    modes = feed(check, {COEXEC: 1.0, EAGER: 1.3}, 200 + 5 + 10 + 5 + 3, start=65)
    # (a recheck starts in the mode the program is in, with no iterations to settle)
    assert "".join(m[0] for m in modes[200:]) == "e" * 10 + "c" * (5 + 3) + "c" * 5, modes[200:]
    assert check.verdicts[1].chosen == COEXEC and check.verdicts[1].iteration == 65 + 200 + 10 + 8 - 1
    with pytest.raises(ValueError):
        SpeedCheck(favoured=1.6)  # beyond decisive
    with pytest.raises(ValueError):
        SpeedCheck(favoured=1.04)  # within the margin


def test_disabled_never_moves():
    check = SpeedCheck(False, first_after=2, window=2, settle=0)
    assert feed(check, {COEXEC: 9.0, EAGER: 1.0}, 20) == [COEXEC] * 20
    with pytest.raises(ValueError):
        SpeedCheck(first_after=2, window=5)
    with pytest.raises(ValueError):
        SpeedCheck(decisive=1.0)


def train(terra: bool, optimizer: str, steps: int = 90, schedule=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    params = list(model.parameters())
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
           "adam": lambda: torch.optim.Adam(params, lr=1e-2),
           "adamw-accumulate": lambda: torch.optim.AdamW(params, lr=1e-2)}[optimizer]()
    if terra:
        model = terra_torch.wrap(model)
        model._terra_program._speed = Forced(schedule)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]
    losses, reads = [], []
    accumulate = optimizer == "adamw-accumulate"
    for i in range(steps):
        x, y = data[i % 5]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if not accumulate or i % 3 == 2:
            opt.step()
            opt.zero_grad(set_to_none=i % 2 == 0)
        if i % 4 == 0:
            reads.append(loss.item())  # a read in some iterations
        losses.append(loss.detach())
    stats = None
    if terra:
        terra_torch.synchronize()
        stats = terra_torch.stats(model)
        # (iteration, python reads posted) per co-executed iteration
        stats.spans = [(span[0], span[6]) for span in model._terra_program._session.iteration_spans()]
        terra_torch.unwrap(model)
    return losses, reads, [p.detach().clone() for p in model.parameters()], opt, stats


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw-accumulate"])
def test_switching_between_coexecution_and_eager_keeps_eagers_numbers(optimizer):
    schedule = [(COEXEC, 12), (EAGER, 7), (COEXEC, 15), (EAGER, 1), (COEXEC, 9), (EAGER, 11), (COEXEC, 100)]
    e_losses, e_reads, e_params, e_opt, _ = train(False, optimizer)
    t_losses, t_reads, t_params, t_opt, st = train(True, optimizer, schedule=schedule)
    assert t_reads == e_reads
    for i, (a, b) in enumerate(zip(e_losses, t_losses)):
        assert torch.equal(a, b), i
    for a, b in zip(e_params, t_params):
        assert torch.equal(a, b)
    for sa, sb in zip(e_opt.state.values(), t_opt.state.values()):
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k], sb[k]), k
    moves = [(old, new) for _, old, new in st.transitions]
    assert moves.count(("coexec", "eager")) >= 3 and moves.count(("eager", "coexec")) >= 3, st.transitions
    assert st.iterations["eager"] >= 15 and st.iterations["coexec"] >= 40, st.iterations
    # Each co-executed iteration right after eager ones reads only what the loop reads (the loss
    # every 4th step): the step counters eager iterations advanced are answered from their memory
    # (KnownValues::relearn_from_memory), not by waiting for the graph at each counter.
    coexec = {it for it, _ in st.spans}
    firsts = [(it, reads) for it, reads in st.spans if it - 1 not in coexec and it > 20]
    assert len(firsts) >= 3, st.spans
    for it, reads in firsts:
        assert reads <= (1 if it % 4 == 0 else 0), (it, reads, firsts)
    # (accumulating over three steps with zero_grad alternating set_to_none: one path is met for
    # the first time after the first graph was built, in every run, with or without switching)
    assert st.fallbacks <= (1 if optimizer == "adamw-accumulate" else 0), st.fallbacks


def test_a_read_heavy_loop_is_measured_and_the_decision_is_reported(caplog):
    """With real times: whatever it decides, the check runs, is reported in stats, and the
    numbers stay eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ref.load_state_dict(model.state_dict())
    runs = []
    for m, terra in ((ref, False), (model, True)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        if terra:
            m = terra_torch.wrap(m)
            m._terra_program._speed = SpeedCheck(True, first_after=12, window=6, settle=2, settle_s=0.0, interval=10)
        g = torch.Generator().manual_seed(2)
        xs = [torch.randn(4, 8, generator=g) for _ in range(3)]
        log = []
        with caplog.at_level(logging.INFO, logger="terra_torch"):
            # 130 iterations: room for two checks whatever the first decides. A verdict that
            # agrees with the previous one doubles the interval (10 -> 20), and each check spends
            # 4 blocks of 3 plus 3 settles of 2 iterations; the retraces of the first 21
            # iterations (the inner loop's new exits) delay the first check to iteration 27.
            for i in range(130):
                h = m(xs[i % 3])
                loss = h.square().mean()
                for _ in range(3):  # a data-dependent inner loop: reads every round
                    if loss.item() < 0.01:
                        break
                    loss = loss * 0.5
                opt.zero_grad()
                loss.backward()
                opt.step()
                log.append(loss.item())
        if terra:
            terra_torch.synchronize()
            st = terra_torch.stats(m)
            terra_torch.unwrap(m)
        runs.append((log, [p.detach().clone() for p in m.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert len(st.speed_checks) >= 2, st.speed_checks
    for c in st.speed_checks:
        assert c["coexec_ms"] > 0 and c["eager_ms"] > 0 and c["chosen"] in (COEXEC, EAGER)
    if any(c["chosen"] == EAGER for c in st.speed_checks):
        assert "speed check" in st.eager_reason
        assert any("running eagerly (the same numbers)" in r.getMessage() for r in caplog.records)


def test_a_graph_bound_loop_is_checked_within_its_first_iterations():
    """A real loop whose graph is the limit (large GEMMs, a cheap Python side): Python waits
    for the graph through the probe, so the first comparison ends within ~70 iterations instead
    of after ~150 (`first_after=100` here, so that only the probe can make it early), whatever
    it decides; the numbers stay eager's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(384, 384), nn.Tanh(), nn.Linear(384, 384), nn.Tanh(), nn.Linear(384, 1))
    runs = []
    for terra in (False, True):
        m = copy.deepcopy(net)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        if terra:
            m = terra_torch.wrap(m)
            # (settling as the Program sets it up for this machine)
            m._terra_program._speed = SpeedCheck(True, first_after=100, settle_s=m._terra_program._speed.settle_s,
                                                 coexec_settle_s=m._terra_program._speed.coexec_settle_s)
        x = torch.randn(256, 384, generator=torch.Generator().manual_seed(3))
        losses = []
        for _ in range(90):
            loss = m(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        if terra:
            terra_torch.synchronize()
            st = terra_torch.stats(m)
            terra_torch.unwrap(m)
        runs.append((losses, [p.detach().clone() for p in m.parameters()]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert st.speed_checks and st.speed_checks[0]["iteration"] < 90, (st.speed_checks, st.iterations)
