"""Which side draws random numbers (csrc/capture/draw_side.h), and reads of the rows of an
unbind answered on Python's side (runtime/known_values.h, one recipe per output).

nanoGPT's batch function draws its indices from the default generator and reads them at once:

    ix = torch.randint(len(data) - block, (batch,))
    x = torch.stack([data[i:i + block] for i in ix])

While the graph has never drawn from the default generator, Python draws itself and `ix` is a
real tensor; each row's read is answered from the unbind's recipe, and nothing waits for the
graph. Once a recorded op draws from the default generator (dropout),
every later draw from it is the graph's, in program order. Every program here trains eagerly
and co-executed from the same seeds and must match bit for bit.

The side of a generator is decided once per process, so each program runs in a fresh
interpreter (a subprocess): what an earlier test recorded would decide it otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(r"""
    import hashlib, json, sys
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import terra_torch

    torch.set_num_threads(1)
    dropout, where, steps, reseed = float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    data = torch.randint(0, 32, (600,), generator=torch.Generator().manual_seed(3))

    def get_batch():
        ix = torch.randint(len(data) - 9, (6,))
        x = torch.stack([data[i:i + 8] for i in ix])
        y = torch.stack([data[i + 1:i + 9] for i in ix])
        return x, y

    def run(terra):
        global batch
        torch.manual_seed(0)
        # (wide enough that the graph runs behind Python: a draw Python made out of order would
        # come before the graph's draws of the steps before)
        model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 512), nn.GELU(), nn.Dropout(dropout),
                              nn.Linear(512, 32))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        wrapped = terra_torch.wrap(model, speed_check=False) if terra else model
        losses = []
        for step in range(steps):
            if reseed and step % 10 == 5:
                torch.manual_seed(step)  # the program reseeds the default generator mid-run
            if where == "before":
                x, y = get_batch()
            noise = torch.randn(6, 8, 32) * 0.01  # a factory draw after the batch's
            logits = wrapped(x if where == "before" else batch[0]) + noise
            loss = F.cross_entropy(logits.view(-1, 32), (y if where == "before" else batch[1]).view(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())  # (no read: Python runs ahead of the graph)
            if where == "after":
                batch = get_batch()  # the next step's batch, drawn after this step's dropout
        if terra:
            terra_torch.synchronize()
        digest = hashlib.sha256()
        for p in model.parameters():
            digest.update(p.detach().numpy().tobytes())
        out = {"losses": [float(v) for v in losses], "params": digest.hexdigest(), "draw": torch.rand(3).tolist()}
        if terra:
            s = terra_torch.stats(wrapped)
            out.update(iterations=dict(s.iterations), runner={k: v for k, v in s.runner.items()
                                                               if isinstance(v, (int, float))})
        return out

    if where == "after":
        torch.manual_seed(0)
        batch = get_batch()
        first = batch
    eager = run(False)
    if where == "after":
        torch.manual_seed(0)
        batch = first
    terra = run(True)
    print(json.dumps({"eager": eager, "terra": terra}))
""")


def run_child(dropout: float, where: str = "before", steps: int = 60, reseed: bool = False,
              env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(dropout), where, str(steps), "1" if reseed else "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TERRA_SPEED_CHECK="0", **(env or {})))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_same(out: dict) -> None:
    eager, terra = out["eager"], out["terra"]
    assert terra["losses"] == eager["losses"]
    assert terra["params"] == eager["params"]
    # The generator's state after the run: every draw happened, once, in order.
    assert terra["draw"] == eager["draw"]
    assert terra["iterations"]["coexec"] >= 0.9 * len(eager["losses"]), terra["iterations"]


def test_batches_drawn_by_python_without_waits():
    out = run_child(dropout=0.0)
    assert_same(out)
    runner, coexec = out["terra"]["runner"], out["terra"]["iterations"]["coexec"]
    # The indices are a real tensor: no read waits for the graph. Each row's read (`i` in the
    # slice bounds, 3 x 6 per step) is answered by the recipe of the unbind's output (one per row).
    assert runner["python_reads"] <= 1, runner
    assert runner["known_reads"] >= 18 * coexec, runner


def test_graph_draws_once_dropout_is_recorded():
    # Dropout's bernoulli draws from the default generator: from its first record on, the batch
    # indices and the noise are the graph's draws, in program order with the masks.
    out = run_child(dropout=0.2)
    assert_same(out)


def test_reseeding_the_default_generator_in_the_loop():
    for dropout in (0.0, 0.2):
        assert_same(run_child(dropout=dropout, reseed=True))


def test_next_batch_drawn_after_the_step():
    # The next step's indices are drawn after this step's dropout masks: recorded for the graph
    # from the first record of a draw on (the first traced iteration drew its batch on Python's side).
    assert_same(run_child(dropout=0.2, where="after"))
    assert_same(run_child(dropout=0.0, where="after"))


def test_graph_draws_the_defaults_when_told():
    # TERRA_PYTHON_DRAWS=0: the graph draws for the default generator (the behaviour before), and
    # the first read of each step's indices waits for it to finish the step before (the rows
    # read after it find their values published; so may the first, now and then, when the graph
    # got there first). Still exact.
    out = run_child(dropout=0.0, steps=40, env={"TERRA_PYTHON_DRAWS": "0"})
    assert_same(out)
    runner, coexec = out["terra"]["runner"], out["terra"]["iterations"]["coexec"]
    assert runner["python_reads"] >= coexec // 2, runner


@pytest.mark.parametrize("rows", [3, 7])
def test_rows_of_a_value_the_graph_computes(rows):
    # `for i in idx` over indices the program computes (a placeholder): each row's read takes its
    # value from the recipe of the unbind (one per output), which waits only for `idx` itself.
    import torch
    import torch.nn as nn
    import terra_torch

    def run(terra: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Linear(5, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        wrapped = terra_torch.wrap(model, speed_check=False) if terra else model
        x = torch.randn(20, 5, generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(50):
            scores = wrapped(x).squeeze(1)
            idx = scores.detach().argsort()[:rows]
            picked = [x[int(i)] for i in idx]  # Python reads each row
            loss = (model(torch.stack(picked)) ** 2).mean() + scores.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if terra:
            terra_torch.synchronize()
        return losses, [p.detach().clone() for p in model.parameters()]

    eager_losses, eager_params = run(False)
    terra_losses, terra_params = run(True)
    assert terra_losses == eager_losses
    for a, b in zip(terra_params, eager_params):
        assert torch.equal(a, b)
