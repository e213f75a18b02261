"""The graph's stream policy (docs/RUNTIME.md, "Streams") as Python sees it. A CPU program must
get none (no events, stream id 0); on CUDA the graph must run on a pool stream of its own, with
values equal to eager (scripts/gpu_coexec_check.py, which skips without CUDA)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch


@pytest.fixture(autouse=True)
def _isolated():
    yield
    from terra_torch import runtime
    runtime.close_all()


def _train(model: nn.Module, device: str, steps: int = 12) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 8, generator=g).to(device), torch.randn(4, 1, generator=g).to(device)) for _ in range(3)]
    losses = []
    for i in range(steps):
        x, y = data[i % len(data)]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_cpu_program_gets_no_stream_policy():
    torch.manual_seed(0)
    eager = _train(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), "cpu")
    torch.manual_seed(0)
    m = terra_torch.wrap(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    got = _train(m, "cpu")
    terra_torch.synchronize()
    st = terra_torch.stats(m)
    assert st.iterations["coexec"] > 0, st
    assert got == eager
    assert st.runner["graph_stream_id"] == 0
    assert st.runner["graph_stream_device"] == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_coexec_check():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_coexec_check.py")
    spec = importlib.util.spec_from_file_location("gpu_coexec_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main() == 0
