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


class ComplexProduct(nn.Module):
    """Two complex parameters multiplied: autograd's backward of `mul` takes `other.conj()`, a
    conjugate view over each parameter's storage with the parameter's layout."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([1.0 + 2.0j, -0.5 + 0.25j]))
        self.q = nn.Parameter(torch.tensor([0.5 - 1.0j, 2.0 + 0.5j]))

    def forward(self, x):
        return ((self.p * self.q) * x).abs().sum()


def _complex_product_step(model, opt, i):
    loss = model(torch.tensor([1.0 + 0.1 * (i % 5), 0.5]))
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():  # a read of a parameter after the backward
        seen = (model.p * 1.0).tolist()
    return loss.item(), seen


def test_complex_parameters_after_their_conjugate_views():
    """Session 31 hunt: once co-executing, a read of a complex parameter after the backward was
    taken for a read of the conjugate view autograd made of it (the same storage and layout;
    Region::find_produced did not compare the math bits): SGD updated conj(p), a read returned
    conj(p), and Adam raised "view_as_real doesn't work on unresolved conjugated tensors"."""
    for make_opt in (lambda ps: torch.optim.SGD(ps, lr=0.05), lambda ps: torch.optim.Adam(ps, lr=0.01)):
        def make():
            model = ComplexProduct()
            return model, make_opt(model.parameters())

        stats, fallbacks = check_bitwise(make, _complex_product_step, STEPS)
        assert stats.iterations["coexec"] >= STEPS - 5 and not fallbacks, (stats.iterations, fallbacks)


class Rotary(nn.Module):
    """The RoPE pattern: one complex buffer multiplies two activations (queries and keys)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.register_buffer("c", torch.polar(torch.ones(2), torch.tensor([0.3, 1.1])))

    def forward(self, x):
        q, k = torch.view_as_complex(self.lin(x).reshape(-1, 2, 2, 2)).unbind(1)
        return ((q * self.c) * (k * self.c)).real.mean()


def test_complex_buffer_read_by_two_products():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))

    def make():
        model = Rotary()
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    def step(model, opt, i):
        loss = model(x * (1 + 0.01 * (i % 3)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(make, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 5 and not fallbacks, (stats.iterations, fallbacks)
