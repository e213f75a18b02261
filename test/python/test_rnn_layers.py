"""nn.LSTM and nn.GRU (on CPU: aten::mkldnn_rnn_layer) under co-execution, bitwise against eager.

- batch_first=True: aten's RNN code runs time-major and turns its output back with
  `output.transpose_(0, 1)` (aten/src/ATen/native/RNN.cpp), an in-place restride of a placeholder
  (capture/region.cpp, run_placeholder); before it was handled the first co-executed iteration
  returned a (seq, batch, hidden) tensor.
- GradMode: the kernel trains (and fills the workspace its backward reads) only with GradMode on,
  and its training and inference results differ in the last bits; the graph runs with GradMode
  off. Before capture folded the user's GradMode into the op (capture/grad_mode_kernels.h), every
  training LSTM raised at its first co-executed iteration, and one under torch.no_grad() would
  have been exact only by accident.

Each program runs 60 iterations under terra_torch.wrap and eagerly from the same seed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bitwise_runs import check_bitwise

STEPS = 60


def _rnn_program(kind: str, lengths: tuple[int, ...]):
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, n, 6, generator=g), torch.randn(4, 1, generator=g)) for n in lengths]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(nn, kind)(6, 8, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            out, _ = self.rnn(x)  # (batch, seq, hidden): aten ends with out.transpose_(0, 1)
            return self.head(out[:, -1]), out

    def make():
        m = Net()
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    def step(model, opt, i):
        x, y = batches[i % len(batches)]
        pred, out = model(x)
        loss = F.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach()), tuple(out.shape)

    return make, step


@pytest.mark.parametrize("kind,lengths", [("GRU", (7,)), ("LSTM", (7,)), ("GRU", (5, 9, 13)), ("LSTM", (9, 5))])
def test_batch_first_recurrent_layers_co_execute_bitwise(kind, lengths):
    make, step = _rnn_program(kind, lengths)
    st, fallbacks = check_bitwise(make, step, STEPS)
    # (tracing takes an iteration or two per length; the rest co-executes without falling back)
    assert st.iterations["coexec"] >= STEPS - 4 * len(lengths), (st.iterations, [f.reason for f in fallbacks])
    assert not fallbacks, [(f.iteration, f.reason) for f in fallbacks]


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("how", ["no_grad", "no_grad+eval", "eval"])
def test_recurrent_layers_evaluated_co_execute_bitwise(kind, how):
    """Forward only, as in a validation pass or a generate loop: under torch.no_grad() with the
    module in training mode (train=True reaches the kernel, GradMode is off), under no_grad in eval
    mode, and in eval mode with GradMode on."""
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(3, 5 + i % 2, 6, generator=g) for i in range(4)]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(nn, kind)(6, 8, num_layers=2, batch_first=True)

        def forward(self, x):
            out, _ = self.rnn(x)
            return out.sum(1)

    def make():
        m = Net()
        if "eval" in how:
            m.eval()
        return m, None

    def step(model, opt, i):
        with torch.set_grad_enabled("no_grad" not in how):
            out = model(inputs[i % len(inputs)])
        return out.detach().sum().item(), tuple(out.shape)

    st, fallbacks = check_bitwise(make, step, STEPS)
    phases = st.evaluation.iterations if st.evaluation is not None else st.iterations
    assert phases["coexec"] >= STEPS - 8, (st.iterations, st.evaluation and st.evaluation.iterations)
    assert not fallbacks, [(f.iteration, f.reason) for f in fallbacks]
