"""The thread state a user sets around a wrapped model's call is the user's: torch.autocast and
torch.inference_mode entered around the call and left after it stay left, and a model called
under torch.inference_mode() co-executes.

A capture region lives from one iteration's start to the next one's, so it is opened inside the
user's `with torch.autocast(...)` and closed outside it (at the next call, or at synchronize()).
Closing it used to restore the thread's whole dispatch-key state as it was when it opened, which
turned autocast back on for everything the program ran afterwards (a plain matmul returned
bfloat16). Each test checks the state after the loop and that the results match eager bitwise."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch

STEPS = 12


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]


def _train_under_autocast(terra: bool):
    net = _mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = terra_torch.wrap(net) if terra else net
    losses = []
    for i, (x, y) in enumerate(_data() * (STEPS // 3)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        assert not torch.is_autocast_enabled("cpu")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if terra:
        terra_torch.synchronize()  # (closes the last iteration's region, opened inside autocast)
        assert terra_torch.stats(model).iterations["coexec"] >= STEPS - 4
    return losses, [p.detach().clone() for p in net.parameters()]


def test_autocast_left_after_the_call_stays_off():
    eager = _train_under_autocast(False)
    terra = _train_under_autocast(True)
    assert not torch.is_autocast_enabled("cpu")
    assert (torch.randn(2, 3) @ torch.randn(3, 2)).dtype == torch.float32
    assert eager[0] == terra[0]
    assert all(torch.equal(a, b) for a, b in zip(eager[1], terra[1]))


def test_inference_mode_left_after_the_call_stays_off():
    net = _mlp()
    model = terra_torch.wrap(net)
    outs = []
    for x, _ in _data() * (STEPS // 3):
        with torch.inference_mode():
            out = model(x)
            assert out.is_inference()  # (as eager's: made in inference mode)
            outs.append(out.sum().item())
        assert not torch.is_inference_mode_enabled()
    terra_torch.synchronize()
    assert not torch.is_inference_mode_enabled()
    # (views of the parameters taken in inference mode, linear's weight.t(), are ordinary tensors
    # in eager; as inference placeholders autograd's view kernel refused them)
    assert terra_torch.stats(model).evaluation.iterations["coexec"] >= STEPS - 4
    t = torch.ones(2)
    assert not t.is_inference()
    with torch.no_grad():
        expected = [net(x).sum().item() for x, _ in _data() * (STEPS // 3)]
    assert outs == expected


def test_ops_on_placeholders_alone_are_autocast():
    """Under torch.autocast an op whose tensors are all placeholders is cast as eager casts it:
    placeholders carry their device's autocast key (torch adds it from a tensor's backend bit,
    which for ours gives none). Without it cross_entropy's log_softmax, which autocast runs in
    float32, ran in bfloat16 on the logits (a placeholder): the loss was bfloat16, and from the
    first co-executed step every value differed."""

    def run(terra: bool):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        model = terra_torch.wrap(net) if terra else net
        g = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(40):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        terra_torch.synchronize()
        coexec = terra_torch.stats(model).iterations["coexec"] if terra else None
        return losses, [p.detach().clone() for p in net.parameters()], coexec

    la, pa, _ = run(False)
    lb, pb, coexec = run(True)
    assert all(loss.dtype == torch.float32 for loss in lb), [loss.dtype for loss in lb]
    assert all(torch.equal(a, b) for a, b in zip(la, lb)), [(float(a), float(b)) for a, b in zip(la, lb)]
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert coexec >= 30
