"""Zero tensors are not captured: forward-mode AD's tangent of a value without one is a ZeroTensor
(`torch._efficientzerotensor`), which ops treat as zeros without reading memory. The generated
graph cannot run ops on it: `add` on one recursed through Python's meta functions on the worker,
and the first co-executed iteration of a program using forward-mode AD (dual tensors,
torch.func.jvp, jacfwd, hessian) failed with a RecursionError (session 31 hunt). The region
now stops capturing at the first op that makes or takes one (csrc/capture/region.cpp,
makes_zero_tensor), and the program runs eagerly with a warning that says why. Results equal
eager's bit for bit."""

from __future__ import annotations

import warnings

import torch
import torch.autograd.forward_ad as fwAD

import terra_torch


def _dual_tangents(terra: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    f = terra_torch.wrap(model, speed_check=False) if terra else model
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(10):
        x = torch.randn(4, 5, generator=g)
        v = torch.randn(4, 5, generator=g)
        with fwAD.dual_level():
            out.append(fwAD.unpack_dual(f(fwAD.make_dual(x, v))).tangent.clone())
    if terra:
        terra_torch.synchronize()
    return out, f


def test_forward_mode_ad_through_a_wrapped_model_runs_eagerly_with_a_warning():
    expected, _ = _dual_tangents(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, model = _dual_tangents(True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    messages = [str(w.message) for w in caught]
    assert any("zero tensors are not captured" in m for m in messages), messages


def _jvp_penalty(terra: bool):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 3))
    opt = torch.optim.SGD([w], lr=0.05)

    def step(x):
        f = lambda inp: torch.tanh(inp @ w)  # noqa: E731
        out, tangent = torch.func.jvp(f, (x,), (torch.ones_like(x),))
        loss = out.pow(2).mean() + 0.1 * tangent.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    fn = terra_torch.function(step, speed_check=False) if terra else step
    g = torch.Generator().manual_seed(2)
    losses = [fn(torch.randn(2, 3, generator=g)).item() for _ in range(12)]
    if terra:
        terra_torch.synchronize()
    return losses, w.detach().clone()


def test_jvp_in_a_training_step_equals_eager():
    e_losses, e_w = _jvp_penalty(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_losses, t_w = _jvp_penalty(True)
    assert t_losses == e_losses
    assert torch.equal(t_w, e_w)
