"""Never hang (issue 16, item 4): an error inside the interceptor in the middle of backward() is an
exception, not a deadlock; ops a kernel issues while the interceptor runs it for real never reach
the interceptor (scaled_dot_product_attention's CPU backward calls aten::transpose through the
dispatcher). Each program runs in a child process with a time limit, so a hang fails the test
instead of stopping the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

LIMIT_S = 120


def run_child(source: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True,
                              timeout=LIMIT_S)
    except subprocess.TimeoutExpired as e:  # the hang this file exists for
        pytest.fail(f"the program hung (no exit within {LIMIT_S} s); output so far:\n{e.stdout}\n{e.stderr}")


PRELUDE = """
    import torch, torch.nn as nn, torch.nn.functional as F
    import terra_torch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
"""


@pytest.mark.parametrize("phase_steps", [1, 6])
def test_interceptor_error_mid_backward_is_an_exception(phase_steps: int):
    """The injected failure hits the first backward op in a traced iteration (1 step before) or in
    a co-executed one (6 steps before): backward() raises it, and training goes on afterwards."""
    out = run_child(PRELUDE + f"""
    model = terra_torch.wrap(model)
    for i in range({phase_steps}):
        loss = F.cross_entropy(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
    phase = model._terra_program.phase
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    try:
        with terra_torch.debug.fail_at("aten::nll_loss_backward"):
            loss.backward()
    except RuntimeError as e:
        print("RAISED", "injected failure" in str(e))
    else:
        print("NO ERROR")
    for i in range(5):
        loss = F.cross_entropy(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
    terra_torch.synchronize()
    print("PHASE", phase, "FINITE", bool(torch.isfinite(loss).item()))
    """)
    assert out.returncode == 0, out.stderr
    assert "RAISED True" in out.stdout, out.stdout + out.stderr
    assert "FINITE True" in out.stdout


def test_sdpa_backward_run_for_real_after_a_divergence():
    """A fallback in the middle of an iteration (a branch taken for the first time after the
    forward) runs the rest eagerly: the SDPA backward kernel runs for real on tensors autograd
    saved from placeholders, and its own dispatcher calls must pass the interceptor by. Bitwise
    equal to eager."""
    out = run_child("""
    import torch, torch.nn as nn, torch.nn.functional as F
    import terra_torch
    torch.set_num_threads(1)

    class Attention(nn.Module):
        def __init__(self, d=16, h=2):
            super().__init__()
            self.h, self.qkv, self.o = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            B, T, D = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(a.transpose(1, 2).reshape(B, T, D))

    def train(terra):
        torch.manual_seed(0)
        model = Attention()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if terra:
            model = terra_torch.wrap(model)
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
        losses = []
        for i in range(30):
            loss = model(x).pow(2).mean()
            if i in (12, 20):          # new paths: the iteration falls back here
                loss = loss * 1.5
            opt.zero_grad(); loss.backward(); opt.step()
            losses.append(loss.detach())
        if terra:
            terra_torch.synchronize()
            print("FALLBACKS", terra_torch.stats(model).fallbacks, "COEXEC", terra_torch.stats(model).iterations["coexec"])
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()]

    le, pe = train(False)
    lt, pt = train(True)
    print("BITWISE", torch.equal(le, lt) and all(torch.equal(a, b) for a, b in zip(pe, pt)))
    """)
    assert out.returncode == 0, out.stderr
    assert "BITWISE True" in out.stdout, out.stdout + out.stderr
    fallbacks = int(out.stdout.split("FALLBACKS ")[1].split()[0])
    assert fallbacks >= 1, out.stdout  # the divergence path did run
