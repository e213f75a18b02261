"""Placeholders laid out as the real kernels lay out their outputs (capture/shape_inference.h,
"Layouts from real runs"): torch's meta kernels give a channels_last convolution a contiguous
output and linalg.svd's Vh a row-major one, where the CPU kernels do not. Each program trains
eagerly and under terra_torch.wrap from one seed and must agree bit for bit."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch
from terra_torch import _C
from bitwise_runs import check_bitwise

STEPS = 24


def _data(i: int, channels_last: bool = True):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(4, 3, 8, 8, generator=g)
    return (x.to(memory_format=torch.channels_last) if channels_last else x), torch.randint(0, 5, (4,), generator=g)


def _channels_last_cnn():
    """Conv -> BatchNorm2d -> ReLU -> Flatten -> Linear, all channels_last, and its optimizer."""
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                      nn.Linear(8 * 8 * 8, 5)).to(memory_format=torch.channels_last)
    return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def test_channels_last_conv_output_is_channels_last_in_co_execution():
    # The placeholder's strides are eager's, so Python takes eager's decisions from them.
    strides = {}

    def make():
        m = nn.Conv2d(3, 4, 3, padding=1).to(memory_format=torch.channels_last)
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    def step(model, opt, i):
        x, _ = _data(i)
        y = model(x)
        strides.setdefault(i, []).append(y.stride())
        loss = y.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), y.is_contiguous(memory_format=torch.channels_last)

    stats, fallbacks = check_bitwise(make, step, STEPS)
    assert all(s[0] == s[1] for s in strides.values()), strides
    assert stats.iterations["coexec"] >= STEPS - 6 and not fallbacks, (stats.iterations, fallbacks)


def test_channels_last_cnn_with_batch_norm_and_flatten_trains_bitwise():
    # Conv -> BatchNorm2d -> Flatten -> Linear, all channels_last: with the meta layout, flatten
    # became a view the graph could not take ("aten::view raised in the graph"), and conv with
    # batch norm drifted from eager by ~1e-8 from step 13.
    def step(model, opt, i):
        x, y = _data(i)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(_channels_last_cnn, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 6 and not fallbacks, (stats.iterations, fallbacks)


def test_svd_vh_keeps_its_column_major_layout():
    # Vh.reshape(-1) is a copy on the real (column-major) Vh; on a row-major placeholder it was a
    # view, which the graph refused.
    def make():
        m = nn.Linear(8, 8)
        return m, torch.optim.SGD(m.parameters(), lr=0.01)

    def step(model, opt, i):
        y = model(torch.randn(6, 8, generator=torch.Generator().manual_seed(i)))
        vh = torch.linalg.svd(y.detach(), full_matrices=False)[2]
        flat = vh.reshape(-1)
        loss = y.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return flat.abs().sum().detach(), vh.stride()

    stats, fallbacks = check_bitwise(make, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 6 and not fallbacks, (stats.iterations, fallbacks)


def test_a_layout_learned_after_the_entry_was_made_corrects_it():
    # A placeholder capture first (the meta layout goes into the cache), then a real run of the
    # same op on the same metadata: the entry takes the real layout.
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    w = torch.randn(5, 3, 3, 3).to(memory_format=torch.channels_last)
    before = _C.shape_cache_counts()["corrected"]

    def conv():
        return F.conv2d(x, w, padding=1)

    out, _ = terra_torch.debug.record(conv, mode="placeholder")
    real, _ = terra_torch.debug.record(conv)
    again, _ = terra_torch.debug.record(conv, mode="placeholder")
    assert real.stride() == F.conv2d(x, w, padding=1).stride() == (180, 1, 30, 5)
    assert out.stride() == (180, 36, 6, 1)  # the meta kernel's layout (shapes no other test uses)
    assert again.stride() == real.stride()
    assert _C.shape_cache_counts()["corrected"] == before + 1


def test_a_batch_size_first_seen_in_co_execution_gets_the_learned_order():
    # New batch sizes appear only after tracing: no real run had their metadata, so the
    # placeholder takes the order of dimensions the traced runs gave under the same input
    # layouts (channels_last), not the meta kernel's contiguous layout (the flatten's view then
    # raised in the graph).
    def step(model, opt, i):
        g = torch.Generator().manual_seed(i)
        n = 4 if i % 7 else 2 + i // 7
        x = torch.randn(n, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
        loss = F.cross_entropy(model(x), torch.randint(0, 5, (n,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(_channels_last_cnn, step, 36)
    assert stats.iterations["coexec"] >= 30 and not fallbacks, (stats.iterations, fallbacks)
