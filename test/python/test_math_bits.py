"""Conjugate and negative views (`z.conj()`, `z.conj().imag`) of placeholders.

torch marks such views with a math bit instead of computing them, and its Conjugate/Negative
fallbacks resolve the bit before ops that need it. A placeholder view without the bit took
another op sequence than the traced iterations (every co-executed iteration fell back at the
`mul`), and the fallback bound the graph's value to a view that read it unconjugated:
`(z * z.conj()).real.mean()` returned -1.9e-9 where eager returns 0.574, and training went
wrong from there. Placeholders now carry the bits the meta kernel gives their outputs
(capture/shape_inference.h, OutputSpec::conj / neg).

Trained eagerly and under terra_torch.wrap from the same seed: losses and parameters bitwise,
no fallback."""

from __future__ import annotations

import torch
import torch.nn as nn

from bitwise_runs import check_bitwise

STEPS = 50


class Spectral(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        z = torch.complex(self.a(x), self.b(x))
        power = (z * z.conj()).real                  # a conjugate view, resolved by mul
        phase = z.conj().imag.transpose(0, 1)         # a negative view of a conjugate view
        return power.mean() + 0.1 * phase.pow(2).mean()


def test_conjugate_and_negative_views_co_execute_bitwise():
    g = torch.Generator().manual_seed(6)
    data = [torch.randn(8, 16, generator=g) for _ in range(3)]

    def make():
        m = Spectral()
        return m, torch.optim.SGD(m.parameters(), lr=0.01)

    def step(model, opt, i):
        loss = model(data[i % len(data)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    st, fallbacks = check_bitwise(make, step, STEPS)
    assert st.iterations["coexec"] >= STEPS - 5, st.iterations
    assert not fallbacks, [(f.iteration, f.reason) for f in fallbacks]


def test_conjugate_product_under_no_grad_reads_the_right_value():
    torch.manual_seed(0)
    m = Spectral()
    x = torch.randn(8, 16)
    with torch.no_grad():
        eager = [m(x) for _ in range(8)]
        import terra_torch

        w = terra_torch.wrap(m)
        got = [w(x).item() for _ in range(8)]  # each read waits for that iteration's value
        terra_torch.synchronize()
        stats = terra_torch.stats(w)
        terra_torch.unwrap(w)
    assert got == [e.item() for e in eager]
    assert stats.evaluation.iterations["coexec"] >= 4, stats.evaluation.iterations
