"""`p.data = tensor` in co-execution (capture/host_filled_tensors.cpp,
has_compatible_shallow_copy_type): torch's set_data asks whether `p` may take the new tensor's
storage, and a placeholder has none until the graph computed it. Old-style SGD
(`p.data = p.data - lr * p.grad.data`) raised "incompatible tensor type" in every co-executed
iteration. Now the placeholder gets its value first, `p` takes it as in eager, and both read as
inputs from outside from then on (Region::note_data_replaced). Each program trains eagerly and
under terra_torch.wrap and must agree bit for bit."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bitwise_runs import check_bitwise

STEPS = 50
X = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (4, 16), generator=torch.Generator().manual_seed(2))


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), None


def sgd_step(model, opt, i):
    """A training step through the optimizer (check_bitwise's step)."""
    loss = F.cross_entropy(model(X[i % 4]), Y[i % 4])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach(), None


def test_old_style_sgd_through_data():
    def step(model, _, i):
        loss = F.cross_entropy(model(X[i % 4]), Y[i % 4])
        model.zero_grad()
        loss.backward()
        for p in model.parameters():
            p.data = p.data - 0.05 * p.grad.data
        return loss.detach(), None

    stats, fallbacks = check_bitwise(mlp, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 5 and not fallbacks, (stats.iterations, fallbacks)


def test_momentum_buffers_clipping_and_renormalizing_through_data():
    """A momentum buffer replaced through `.data`, WGAN-style clipping and a row renormalization
    that assign `.data` twice per parameter, and a parameter's `.data` read after it was replaced."""
    buffers: dict[int, torch.Tensor] = {}

    def step(model, _, i):
        loss = F.cross_entropy(model(X[i % 4]), Y[i % 4])
        model.zero_grad()
        loss.backward()
        for k, p in enumerate(model.parameters()):
            b = buffers.setdefault(k, torch.zeros_like(p))
            b.data = 0.9 * b.data + p.grad.data
            p.data = p.data - 0.05 * b.data
            p.data = torch.clamp(p.data, -0.4, 0.4)
            if p.dim() == 2:
                p.data = p.data / p.data.norm(dim=1, keepdim=True)
        return loss.detach(), float(model[0].weight.data.abs().sum())

    def make():
        buffers.clear()
        return mlp()

    stats, fallbacks = check_bitwise(make, step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 5 and not fallbacks, (stats.iterations, fallbacks)


class ScaledHidden(nn.Module):
    """Replaces an intermediate's data in forward (a placeholder receives another's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        scaled = h.detach() * 0.5
        h.data = scaled
        return self.b(h)


def test_data_assigned_to_an_intermediate_in_forward():
    """The numbers were silently wrong here: set_data is no op, so the graph read the
    intermediate's old value. Now it gets its value first and reads as an input from outside."""

    def make():
        m = ScaledHidden()
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    stats, fallbacks = check_bitwise(make, sgd_step, STEPS)
    assert stats.iterations["coexec"] >= STEPS - 5 and not fallbacks, (stats.iterations, fallbacks)


def test_a_parameter_replaced_then_updated_in_place():
    """`weight.data = fresh` every 10 steps, then SGD updates it in place: the graph must write
    the new storage (it wrote its own copy of the fresh value, and Python's weight kept the value
    before the update: the final weights differed from eager's by 0.01)."""

    def make():
        m, _ = mlp()
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def step(model, opt, i):
        if i % 10 == 9:
            fresh = torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) * 0.1
            model[2].weight.data = fresh
        return sgd_step(model, opt, i)

    stats, fallbacks = check_bitwise(make, step, STEPS)
    # (one divergence: the first replacement is a new path)
    assert stats.iterations["coexec"] >= STEPS - 5 and len(fallbacks) <= 1, (stats.iterations, fallbacks)


def _vector_to_parameters_run(terra: bool, steps: int):
    """A Linear whose parameters are set from one new vector every iteration by
    torch.nn.utils.vector_to_parameters (`p.data = vec[i:j].view_as(p).data`: two tensors over
    parts of one storage that record no base), read by the forward under no_grad."""
    import terra_torch
    from torch.nn.utils import vector_to_parameters

    torch.manual_seed(0)
    lin = nn.Linear(2, 1)
    f = terra_torch.wrap(lin, speed_check=False) if terra else lin
    x = torch.tensor([[1.0, 2.0]])
    out = []
    with torch.no_grad():
        for i in range(steps):
            vector_to_parameters(torch.arange(3.0) * 0.5 + i, lin.parameters())
            out.append(f(x))
    if terra:
        terra_torch.synchronize()
        return out, terra_torch.stats(f)
    return out, None


def test_vector_to_parameters_every_iteration():
    """Session 31 hunt: from the first co-executed iteration the bias (the second part of the
    vector's storage) read 0 or garbage such as 1e30: the weight's part was bound first, which
    gave the storage memory, and the bias's part then passed for an ordinary tensor holding its
    value (PythonRunner::bind_base_first)."""
    expected, _ = _vector_to_parameters_run(False, 40)
    got, stats = _vector_to_parameters_run(True, 40)
    assert [v.item() for v in got] == [v.item() for v in expected]
    calls = stats.evaluation.iterations  # (calls under no_grad: the model's evaluation program)
    assert calls["coexec"] >= 30, calls


def test_training_step_through_vector_to_parameters():
    """A flat-vector SGD step written with parameters_to_vector / vector_to_parameters under
    terra_torch.function: losses and parameters bit for bit over 50 iterations."""
    import terra_torch
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    def run(terra: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

        def step(i):
            loss = F.cross_entropy(model(X[i % 4]), Y[i % 4])
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                flat = parameters_to_vector(model.parameters())
                grads = parameters_to_vector(p.grad for p in model.parameters())
                vector_to_parameters(flat - 0.1 * grads, model.parameters())
            return loss.detach()

        fn = terra_torch.function(step, speed_check=False) if terra else step
        losses = [fn(i) for i in range(STEPS)]
        if terra:
            terra_torch.synchronize()
        return [v.item() for v in losses], [p.detach().clone() for p in model.parameters()], fn

    e_losses, e_params, _ = run(False)
    t_losses, t_params, fn = run(True)
    assert t_losses == e_losses
    assert all(torch.equal(a, b) for a, b in zip(e_params, t_params))
    assert terra_torch.stats(fn).iterations["coexec"] >= STEPS - 10, terra_torch.stats(fn).iterations


def test_data_assignment_forgets_known_values():
    """`p.data = new` keeps p's TensorImpl and version counter while its value changes. A value
    Python knew for p (KnownValues, checked by version) passed for current: under no_grad a
    co-executed Linear computed with the previous iteration's bias, in 4 of 6 runs of the session
    31 hunt's program (PythonRunner::storage_replaced now forgets both tensors). Several variants
    in one process, as the hunt ran them; each run must equal eager."""
    import terra_torch

    def run(terra: bool, variant: str):
        torch.manual_seed(0)
        lin = nn.Linear(2, 1)
        f = terra_torch.wrap(lin, speed_check=False) if terra else lin
        out = []
        with torch.no_grad():
            for i in range(12):
                v = torch.arange(3.0) + i
                if variant == "clones":
                    lin.weight.data = v[0:2].view(1, 2).clone()
                    lin.bias.data = v[2:3].clone()
                elif variant == "weight_slice":
                    lin.weight.data = v[0:2].view(1, 2)
                    lin.bias.data = v[2:3].clone()
                else:
                    lin.weight.data = v[0:2].view(1, 2).clone()
                    lin.bias.data = v[2:3]
                out.append(f(torch.ones(1, 2)).item())
        if terra:
            terra_torch.synchronize()
        return out

    for _ in range(3):
        for variant in ("weight_slice", "bias_slice", "clones"):
            assert run(True, variant) == run(False, variant), variant
