"""What varies between iterations is fed, not traced again (issue 16, item 1): int, bool and
int-list attributes (the step number's batch index, a sequence length, a view size that follows
the batch size) merge into one node like Python floats, and optimizers' record_function handles
do not keep a program tracing. Each program trains 60+ iterations under terra_torch.wrap and
eagerly from the same seed; losses and parameters must match bitwise."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch
from terra_torch import runtime

STEPS = 64
WARMUP_ITERS = 6  # traced before co-execution can start (generous: a few shapes and values)


@pytest.fixture(autouse=True)
def _isolated():
    yield
    runtime.close_all()


def _train(terra: bool, make, step, steps: int = STEPS):
    torch.manual_seed(0)
    model, opt, state = make()
    if terra:
        model = terra_torch.wrap(model)
    log = []
    for i in range(steps):
        log.append(step(model, opt, i, state))
    info = None
    if terra:
        terra_torch.synchronize()
        info = (terra_torch.stats(model), list(model._terra_program.fallbacks))
        terra_torch.unwrap(model)
    return [float(v) for v in log], [p.detach().clone() for p in model.parameters()], info


def _check(make, step, max_fallbacks: int, steps: int = STEPS):
    la, pa, _ = _train(False, make, step, steps)
    lb, pb, (st, fallbacks) = _train(True, make, step, steps)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    after = steps - WARMUP_ITERS
    assert st.iterations["coexec"] - len(fallbacks) >= 0.8 * after, (st.iterations, [(f.iteration, f.reason) for f in fallbacks])
    assert len(fallbacks) <= max_fallbacks, [(f.iteration, f.source_line, f.reason) for f in fallbacks]
    assert st.iterations["eager"] == 0, st.eager_reason
    return st


def test_batch_by_step_number_with_cosine_schedule_clipping_and_adamw():
    n = 5
    g = torch.Generator().manual_seed(7)
    X, Y = torch.randn(n, 8, 8, generator=g), torch.randn(n, 8, 1, generator=g)
    base_lr, warmup = 3e-3, 8

    def make():
        m = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
        return m, torch.optim.AdamW(m.parameters(), lr=base_lr, weight_decay=0.01), {}

    def step(model, opt, i, state):
        x, y = X[i % n], Y[i % n]  # aten::select(X, 0, i % n): a new int every step
        if i < warmup:
            lr = base_lr * (i + 1) / warmup
        else:
            lr = 0.5 * base_lr * (1 + math.cos(math.pi * (i - warmup) / (STEPS - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    _check(make, step, max_fallbacks=4)


def test_sequence_lengths_varying_among_three_values():
    vocab, lengths = 50, (5, 9, 12)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (4, 12), generator=g)
    targets = torch.randn(4, 1, generator=g)

    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, 16)
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            return self.head(self.emb(x).mean(dim=1))

    def make():
        m = Pool()
        return m, torch.optim.Adam(m.parameters(), lr=1e-2), {}

    def step(model, opt, i, state):
        L = lengths[(i * 7) % 3]
        loss = F.mse_loss(model(tokens[:, :L]), targets)  # aten::slice(..., end=L)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    _check(make, step, max_fallbacks=6)


def test_view_whose_size_follows_the_batch_size():
    g = torch.Generator().manual_seed(5)
    data = torch.randn(22, 2, 4, generator=g)  # batches of 8, 8 and a last one of 6
    target = torch.randn(22, 1, generator=g)
    batches = [(0, 8), (8, 16), (16, 22)]

    def make():
        m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), {}

    def step(model, opt, i, state):
        a, b = batches[i % 3]
        x = data[a:b]
        out = model(x.reshape(x.shape[0], 8))  # aten::view(x, [B, 8]): B = 8, 8, 6
        loss = F.mse_loss(out, target[a:b])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    _check(make, step, max_fallbacks=6)


def test_a_loop_index_as_an_int_attribute_stays_bitwise():
    # x[:, t] inside a Python loop: one node fed the index per loop iteration.
    g = torch.Generator().manual_seed(9)
    seq = torch.randn(4, 6, 8, generator=g)
    y = torch.randn(4, 1, generator=g)

    class Rnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.RNNCell(8, 16)
            self.head = nn.Linear(16, 1)

        def forward(self, x, T):
            h = torch.zeros(4, 16)
            for t in range(T):
                h = self.cell(x[:, t], h)
            return self.head(h)

    def make_rnn():
        m = Rnn()
        return m, torch.optim.SGD(m.parameters(), lr=0.05), {}

    def step_rnn(model, opt, i, state):
        loss = F.mse_loss(model(seq, 6 if i % 2 else 4), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    _check(make_rnn, step_rnn, max_fallbacks=6)
