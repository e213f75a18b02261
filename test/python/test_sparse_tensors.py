"""Sparse tensors are not captured: nn.Embedding(sparse=True) under terra_torch.function raised
NotImplementedError in its first backward (`_sparse_coo_tensor_with_dims_and_tensors` has no
kernel for SparsePrivateUse3, the key our backend bit selects for a sparse tensor). The region
now stops capturing at the first sparse (or quantized) op, runs it and the rest of the call as
the device's own kernels (csrc/capture/interceptor.cpp, unsupported_layout_kernel), and the
program runs eagerly with a warning that says why. Results equal eager's bit for bit."""

from __future__ import annotations

import warnings

import torch

import terra_torch


def _run(terra: bool, steps: int = 12):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    head = torch.nn.Linear(4, 1)
    opt_sparse = torch.optim.SparseAdam(list(emb.parameters()), lr=1e-2)
    opt_dense = torch.optim.SGD(head.parameters(), lr=1e-2)
    ids = torch.randint(0, 10, (steps, 5), generator=torch.Generator().manual_seed(1))

    def step(i):
        loss = head(emb(ids[i])).pow(2).mean()
        opt_sparse.zero_grad()
        opt_dense.zero_grad()
        loss.backward()
        opt_sparse.step()
        opt_dense.step()
        return loss.detach()

    fn = terra_torch.function(step) if terra else step
    losses = [fn(i).item() for i in range(steps)]
    params = [p.detach().clone() for p in (*emb.parameters(), *head.parameters())]
    return losses, params, fn


def test_sparse_gradients_under_function_run_eagerly_with_a_warning():
    expected_losses, expected_params, _ = _run(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, params, fn = _run(True)
        terra_torch.synchronize()
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(expected_params, params))
    messages = [str(w.message) for w in caught]
    assert any("sparse tensors are not captured" in m and "sparse_coo" in m for m in messages), messages
    assert fn._terra_program.phase == "eager"
