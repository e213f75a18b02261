"""Two threads calling wrapped models at once. One capture region is open per process, owned by
the thread that opened it (csrc/capture/region.cpp); a call from a second thread while it is open
runs eagerly, with one warning, instead of ending the first thread's iteration from the wrong
thread (that hung, raised "reads a value that no earlier record produced" or freed memory twice).
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch

STEPS = 150


def _run(wrap: bool):
    torch.manual_seed(0)
    scorer = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 6)).eval()
    learner = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(learner.parameters(), lr=1e-2)
    if wrap:
        scorer, learner = terra_torch.wrap(scorer), terra_torch.wrap(learner)
    scores, errors = [], []

    def score() -> None:  # inference in a thread of its own, on its own data
        try:
            g = torch.Generator().manual_seed(7)
            for _ in range(STEPS):
                with torch.no_grad():
                    scores.append(scorer(torch.randn(8, 6, generator=g)).sum().item())
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=score, name="scorer")
    thread.start()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 6, generator=g)
        loss = F.mse_loss(learner(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    thread.join(timeout=120)
    assert not thread.is_alive(), "the scoring thread hung"
    assert not errors, errors
    if wrap:
        terra_torch.synchronize()
    return scores, losses, [p.detach().clone() for p in learner.parameters()]


def test_a_second_thread_runs_eagerly_and_neither_breaks(caplog):
    with caplog.at_level(logging.WARNING, logger="terra_torch"):
        (sa, la, pa), (sb, lb, pb) = _run(False), _run(True)
    assert sa == sb
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert any("calls from a second thread run eagerly" in r.getMessage() for r in caplog.records)
