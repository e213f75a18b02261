"""In-place ops that change a tensor's sizes or strides (transpose_, t_, unsqueeze_, squeeze_,
as_strided_) under co-execution.

On a placeholder the new metadata must show at once (the next op's shapes follow from it): before
this was handled, the first co-executed iteration returned a (seq, batch, hidden) tensor from a
batch-first nn.GRU, whose aten code ends with `output.transpose_(0, 1)` (test_rnn_layers.py). On a tensor that already has its value (a parameter,
the caller's input) the op runs for real instead, after the graph has finished what Python
validated: the graph holds the same tensor and would apply it a second time.

Each program trains 60 iterations under terra_torch.wrap and eagerly from the same seed; losses,
parameters and output shapes must match bitwise."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bitwise_runs import check_bitwise

STEPS = 60


def test_restrides_of_placeholders_co_execute_bitwise():
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(6, 4, generator=g), torch.randn(5, 6, generator=g)) for _ in range(3)]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 5)

        def forward(self, x):
            h = self.lin(x)      # (6, 5)
            h = h * 1.5          # a placeholder the next ops restride in place
            h.t_()               # (5, 6)
            h.unsqueeze_(0)      # (1, 5, 6)
            h.transpose_(0, 2)   # (6, 5, 1)
            h.squeeze_(2)        # (6, 5)
            h.swapdims_(0, 1)    # (5, 6)
            return h.relu()

    def make():
        m = Net()
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    def step(model, opt, i):
        x, y = data[i % len(data)]
        out = model(x)
        loss = F.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach()), (tuple(out.shape), out.stride())

    st, fallbacks = check_bitwise(make, step, STEPS)
    assert st.iterations["coexec"] >= STEPS - 4, st.iterations
    assert not fallbacks, [(f.iteration, f.reason) for f in fallbacks]


def test_restride_of_a_tensor_with_its_value_runs_for_real():
    g = torch.Generator().manual_seed(6)
    base = [torch.randn(8, 4, generator=g) for _ in range(3)]
    shapes_after_call = {}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            x.unsqueeze_(0)  # the caller's own tensor: its shape changes for the caller too
            return self.lin(x).sum(0)

    def make():
        m = Net()
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    def step(model, opt, i):
        x = base[i % len(base)].clone()  # a tensor with its value, made outside the model
        loss = model(x).pow(2).mean()
        shapes_after_call.setdefault(i, []).append(tuple(x.shape))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach()), tuple(x.shape)

    st, fallbacks = check_bitwise(make, step, STEPS)
    assert all(s == [(1, 8, 4), (1, 8, 4)] for s in shapes_after_call.values())
    # Each co-executed iteration stops at the op and runs the rest for real, with the reason.
    reasons = [f.reason for f in fallbacks]
    assert reasons and all("changes the sizes or strides" in r for r in reasons), reasons
