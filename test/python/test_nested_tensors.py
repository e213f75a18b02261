"""Nested tensors are not captured: nn.TransformerEncoder's fast path in eval with a padding mask
(torch._nested_tensor_from_mask) crashed the first traced call ("NestedTensorImpl doesn't support
sizes"). The region stops recording at the first nested tensor and runs the rest of the call for
real (nested ops skip our backend bit: csrc/capture/interceptor.cpp, nested_kernel); the program
then runs eagerly, with a warning that says why. Results equal eager's bit for bit."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import terra_torch


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2).eval()


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(6):
        x = torch.randn(3, 7, 16, generator=g)
        pad = torch.zeros(3, 7, dtype=torch.bool)
        pad[0, 5 - k % 3:] = True  # a different padding length per batch
        out.append((x, pad))
    return out


def _run(terra: bool):
    model = _encoder()
    if terra:
        model = terra_torch.wrap(model)
    outs = []
    with torch.inference_mode():
        for x, pad in _batches() * 4:
            outs.append(model(x, src_key_padding_mask=pad).clone())
    terra_torch.synchronize()
    return outs, model


def test_transformer_encoder_fast_path_runs_eagerly_with_a_warning():
    expected, _ = _run(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, model = _run(True)
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert any("nested tensors are not captured" in str(w.message) for w in caught), [str(w.message) for w in caught]
    program = model._terra_program.evaluation
    assert program.phase == "eager"
    assert "_nested_tensor_from_mask" in program._stats.eager_reason
