"""Composite kernels that fill a fresh tensor through its data pointer (capture/host_filled_tensors.h):
F.ctc_loss builds its lengths with at::tensor() and reads tensor lengths on the host, and
pad_packed_sequence fills its lengths the same way. In co-execution the empty() inside was a
placeholder without memory, and the first co-executed iteration raised "its data is not allocated
yet". Also: _ctc_loss_backward has a shape rule (capture/meta_functions.cpp), without which the
backward read a saved output whose tensor was gone. Every program is compared bit for bit with
eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from bitwise_runs import check_bitwise

STEPS = 50


def _ctc_model():
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _batches(n: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 2, 6, generator=g), torch.randint(1, 5, (2, 4), generator=g),
             torch.randint(1, 5, (2,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("how", ["module", "lists", "tensors_sum"])
def test_ctc_loss_co_executes(how):
    batches = _batches()
    ctc = nn.CTCLoss()

    def step(model, opt, i):
        x, targets, target_lengths = batches[i % len(batches)]
        log_probs = model(x).log_softmax(2)
        # (torch.full: the lengths are made in the iteration, a placeholder the kernel reads)
        input_lengths = torch.full((2,), 12, dtype=torch.long)
        if how == "module":
            loss = ctc(log_probs, targets, input_lengths, target_lengths)
        elif how == "lists":
            loss = F.ctc_loss(log_probs, targets, [12, 12], target_lengths.tolist())
        else:
            loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(_ctc_model, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 12, stats.iterations


class _PackedGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 8, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        y, _ = self.rnn(packed)
        y, _ = pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])
        return self.out(y).mean()


def test_pad_packed_sequence_co_executes():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, 5, 4, generator=g) for _ in range(6)]
    lengths = torch.tensor([5, 3, 2])

    def make():
        model = _PackedGRU()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i):
        loss = model(xs[i % len(xs)], lengths)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(make, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 10, stats.iterations
    assert not fallbacks, [f.reason for f in fallbacks]
