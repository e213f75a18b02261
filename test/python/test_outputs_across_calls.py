"""One backward over the outputs of several forward calls of the wrapped model.

Each forward call of a `terra_torch.wrap`ped model starts an iteration, so in
`a = model(x1); b = model(x2); loss(a, b).backward()` the backward of tanh (or sigmoid,
log_softmax: ops whose backward reads their saved *output*) reads a value of the previous
iteration. Autograd hands that output back as its own shallow copy (SavedVariable keeps
`tensor_data()`), another TensorImpl over the placeholder's memory, which the runtime did not
know: every such iteration fell back to eager ("reads a placeholder this program did not make",
19 fallbacks in 40 steps of a siamese loss; REINFORCE with six calls per episode likewise). The
copy now resolves to the value-table entry of the placeholder it copies
(PythonRunner::linked_index). Trained eagerly and under terra_torch.wrap from the same seed;
losses and parameters bitwise, and no fallback once the calls' iterations are learned."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch
from bitwise_runs import check_bitwise

STEPS = 60


def test_siamese_loss_over_two_calls_co_executes_bitwise():
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)) for _ in range(3)]

    def make():
        m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 3))
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    def step(model, opt, i):
        x1, x2 = data[i % len(data)]
        a = model(x1)
        b = model(x2)  # a second iteration begins: a's saved outputs belong to the first
        loss = F.mse_loss(a, b) + a.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach()), None

    st, fallbacks = check_bitwise(make, step, STEPS)
    assert st.iterations["coexec"] >= 2 * STEPS - 10, st.iterations
    assert not fallbacks, [(f.iteration, f.reason) for f in fallbacks]


def test_outputs_that_died_before_the_backward_are_read_from_their_storage():
    # Two calls per step of a model with ReLU then Dropout, batches of two sizes: the first
    # call's ReLU output dies once Dropout has consumed it, and the backward (in the second
    # call's iteration) reads autograd's copy of it. Its link went with the output, so every
    # other step fell back ("threshold_backward reads a placeholder this program did not make",
    # 73% co-executed); the value is found by its storage now (ValueTable::index_over_storage).
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    def step(model, opt, i):
        g = torch.Generator().manual_seed(i)
        loss = model(torch.randn(8, 8, generator=g)).pow(2).mean() + model(torch.randn(24, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None

    stats, fallbacks = check_bitwise(make, step, 40)
    assert not fallbacks and stats.iterations["coexec"] >= 70, (stats.iterations, [f.reason for f in fallbacks])


def test_policy_gradient_over_several_calls_co_executes_bitwise():
    g = torch.Generator().manual_seed(4)
    states = [torch.randn(1, 6, generator=g) for _ in range(8)]
    returns = torch.linspace(1.0, 0.2, 4)

    def make():
        m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    def step(model, opt, i):
        log_probs = []
        for t in range(4):  # an episode: one call per state, one backward at its end
            logits = model(states[(i + t) % len(states)])
            log_probs.append(F.log_softmax(logits, dim=-1)[0, t % 3])
        loss = -(torch.stack(log_probs) * returns).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach()), None

    st, fallbacks = check_bitwise(make, step, STEPS // 2)
    assert st.iterations["coexec"] >= 4 * (STEPS // 2) - 16, st.iterations
    # (the first episodes teach the graph the calls' four shapes of iteration: a fallback or two
    # while it learns them, none afterwards; before the fix one in every episode)
    assert all(f.iteration < 20 for f in fallbacks), [(f.iteration, f.reason) for f in fallbacks]


def test_sparse_embedding_gradients_run_eagerly_with_a_warning():
    # nn.Embedding(sparse=True) makes sparse COO gradients, which placeholders (strided tensors)
    # cannot stand for: its first co-executed backward raised NotImplementedError in the
    # dispatcher. The wrapped model runs eagerly instead, with a warning naming the module.
    x = torch.tensor([[1, 2, 3], [4, 5, 1]])

    def make():
        m = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def step(model, opt, i):
        loss = model(x).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach()), None

    with pytest.warns(UserWarning, match=r"0 \(Embedding\) makes sparse gradients"):
        st, _ = check_bitwise(make, step, 8)
    assert st.iterations["eager"] == 8, st.iterations


def test_averaged_model_of_a_wrapped_model():
    """torch.optim.swa_utils.AveragedModel (an EMA of the weights) deep-copies the model it is
    given; for a wrapped model the copy is an ordinary module with eager's values (the graph is
    waited for first), and the EMA updated every step equals eager's bit for bit."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    def run(terra: bool):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model = terra_torch.wrap(net) if terra else net
        g = torch.Generator().manual_seed(4)
        data = [(torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(4)]
        losses = []
        ema = None
        for i in range(50):
            x, y = data[i % 4]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i == 5:  # made mid-run: the copy must hold the weights after six steps
                ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
            elif ema is not None:
                ema.update_parameters(model)
            losses.append(loss.detach())
        terra_torch.synchronize()
        coexec = terra_torch.stats(model).iterations["coexec"] if terra else None
        return losses, [p.detach().clone() for p in ema.parameters()], ema(data[0][0]), coexec

    la, ea, oa, _ = run(False)
    lb, eb, ob, coexec = run(True)
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(a, b) for a, b in zip(ea, eb))
    assert torch.equal(oa, ob)
    assert coexec >= 35
