"""Reads in co-execution wait only for what they read (docs/RUNTIME.md, "Reads").

The graph runs in program order, so a read that waited for everything Python has validated would
wait for the backward and the optimizer step whenever the program reads after them. A read of
placeholders nothing has written waits only for their values; a read of a small value computed
from such placeholders and from values Python knows (a recipe) runs that op on the Python side.
Each program here is bitwise against eager over 60 iterations and names the counter that shows
which way its reads went; each also writes a tensor the way that would make a shortcut wrong.
"""

from __future__ import annotations

import random

import pytest
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch

STEPS = 60
WARMUP = 6  # iterations a program may trace before it co-executes
DATA = torch.randn(6, 16, 8, generator=torch.Generator().manual_seed(3))
LABELS = torch.randint(0, 4, (6, 16), generator=torch.Generator().manual_seed(4))


def mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


Make = Callable[[], tuple[nn.Module, torch.optim.Optimizer]]


def with_sgd(module: Callable[[], nn.Module]) -> Make:
    """A maker of `module()` (seeded) and plain SGD over its parameters."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = module()
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    return make


def run(step: Callable[..., Any], terra: bool, make: Make) -> tuple[list[Any], list[torch.Tensor], Any]:
    model, opt = make()
    state: dict[str, Any] = {"avg": torch.tensor(1.4), "log": []}
    fn = terra_torch.function(step, speed_check=False) if terra else step
    for i in range(STEPS):
        fn(model, opt, state, i)
    stats = None
    if terra:
        terra_torch.synchronize()
        stats = terra_torch.stats(fn)
    log = [v.clone() if isinstance(v, torch.Tensor) else v for v in state["log"]]
    return log, [p.detach().clone() for p in model.parameters()], stats


def train_step(model: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer, x: torch.Tensor,
               i: int) -> torch.Tensor:
    """Forward, zero_grad, backward, step; returns the loss."""
    loss = F.cross_entropy(model(x), LABELS[i % 6])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def check(step: Callable[..., Any], make: Make = mlp) -> dict[str, Any]:
    eager_log, eager_params, _ = run(step, False, make)
    terra_log, terra_params, stats = run(step, True, make)
    assert len(terra_log) == len(eager_log)
    for a, b in zip(eager_log, terra_log):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (a, b)
    for a, b in zip(eager_params, terra_params):
        assert torch.equal(a, b)
    assert stats.iterations["coexec"] >= 0.8 * (STEPS - WARMUP), stats
    return stats.runner


def test_loss_item_after_the_step_waits_only_for_the_forward():
    """`total += loss.item()` after `opt.step()`: the loss was published by the forward. The read
    waits only for it (an early read), or finds it published already and takes it."""

    def step(model, opt, state, i):
        loss = train_step(model, opt, DATA[i % 6], i)
        state["log"].append(loss.item())

    runner = check(step)
    assert runner["early_reads"] + runner["known_reads_published"] >= STEPS - 2 * WARMUP, runner


HEAVY = torch.randn(384, 384, generator=torch.Generator().manual_seed(5))


def test_a_read_after_a_write_through_a_view_waits_for_the_write():
    """`total` is written through a view after it was computed: the read must wait for the
    write. The graph's `total` is the tensor the write changes, so a read that waited only for
    `total` would see the write or not by timing; the matrix product between them makes the graph
    reach the write milliseconds after `total`, and such a read 1 too little every time."""

    def step(model, opt, state, i):
        loss = train_step(model, opt, DATA[i % 6], i)
        total = loss.detach() * 2
        state["log"].append((HEAVY @ HEAVY @ HEAVY).sum().detach())
        total.view(1).add_(1.0)
        state["log"].append(float(total))

    runner = check(step)
    assert runner["python_reads"] >= STEPS - 2 * WARMUP, runner  # these reads waited


def test_a_branch_on_the_loss_against_a_running_average_runs_on_the_python_side():
    """`if loss > avg` after backward: `gt` is a recipe over the loss (published by the forward)
    and the average (known), so the read does not wait for the backward."""

    def step(model, opt, state, i):
        loss = F.cross_entropy(model(DATA[i % 6]), LABELS[i % 6])
        opt.zero_grad()
        loss.backward()
        if loss > state["avg"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            state["log"].append("clipped")
        opt.step()
        state["avg"] = 0.9 * state["avg"] + 0.1 * loss.detach()
        state["log"].append(loss.detach())

    runner = check(step)
    assert runner["known_reads"] >= STEPS - 2 * WARMUP, runner
    assert runner["python_reads"] <= 3 * WARMUP, runner


def test_a_read_of_a_value_the_graph_has_published_runs_no_recipe():
    """Rows of the indices the forward picks (`for j in idx`), read after the graph has had time
    to publish them (a sleep stands for the Python work between): each read takes the graph's
    value instead of running the row's recipe (the unbind) again on the Python side. Before the
    graph gets there (the sleep does not send it the batch), the first row's recipe would wait for
    `idx`, a few outputs before the row: that read waits for the row itself (known_reads_close)."""
    import time

    def step(model, opt, state, i):
        scores = model(DATA[i % 6])
        loss = F.cross_entropy(scores, LABELS[i % 6])
        idx = scores.detach().argmax(dim=1)[:3]
        time.sleep(0.002)
        picked = [int(j) for j in idx]
        opt.zero_grad()
        (loss + 0.01 * scores[picked].sum()).backward()
        opt.step()
        state["log"] += [loss.detach(), picked]

    runner = check(step)
    # (of 3 rows a step; the first may wait for its own value, a few outputs past `idx`)
    assert runner["known_reads_published"] + runner["known_reads_close"] >= 2 * (STEPS - 2 * WARMUP), runner


def test_a_convergence_check_waits_for_the_comparison_itself():
    """`if update.abs().mean() < tol: break` in a refinement loop of the forward: the recipe of
    the comparison would wait for `update` and then run abs, mean and lt again on the Python side,
    three outputs before the comparison's own. The read waits for the comparison instead (the
    graph runs the three ops), and it breaks where eager breaks. `tol` is a tensor the step
    writes in place after the loop, and `h` is written in place inside it, so a read that took a
    stale value would end the loop at another round."""

    class Refine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.f, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.inp(x))
            for _ in range(6):
                update = torch.tanh(self.f(h)) - h
                h = h + 0.5 * update
                if update.abs().mean() < tol:
                    break
            return self.out(h)

    def step(model, opt, state, i):
        tol = state.setdefault("tol", torch.tensor(0.05))
        loss = F.cross_entropy(model(DATA[i % 6] * (0.5 + 0.3 * (i % 3)), tol), LABELS[i % 6])
        opt.zero_grad()
        loss.backward()
        opt.step()
        tol.mul_(0.99)
        state["log"].append(loss.detach())

    runner = check(step, with_sgd(Refine))
    assert runner["known_reads"] >= STEPS - 2 * WARMUP, runner
    # No read waited for `update` to run its recipe after: each waited for the comparison itself,
    # or found its value (or the recipe's input) published already (the graph ahead, under load).
    assert runner["known_reads_recipe_waited"] <= WARMUP, runner


def test_a_branch_on_the_batch_in_forward_runs_on_the_python_side():
    """`if x.mean() > 0` on the batch (a real tensor nothing writes): both ops run on the Python
    side, without waiting for the previous iteration's step."""

    class TwoPath(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            h = self.a(x) if x.mean() > 0 else self.b(x)
            return self.out(torch.relu(h))

    def step(model, opt, state, i):
        x = DATA[i % 6] + (0.5 if i % 2 else -0.5)
        loss = train_step(model, opt, x, i)
        state["log"].append(loss.detach())

    runner = check(step, with_sgd(TwoPath))
    assert runner["known_reads"] >= STEPS - 2 * WARMUP, runner


def test_a_check_on_positions_made_from_arange_runs_on_the_python_side():
    """HuggingFace decoders called without an attention mask check for packed sequences in every
    forward (transformers/masking_utils.py, find_packed_sequence_indices): 14 ops from `arange`
    through slices, `cat` and `cumsum` to `(mask[:, -1] == 0).all()`. Every value comes from the
    numbers alone, so the read runs those ops' recipes on the Python side instead of waiting for
    the previous iteration's backward and step; its answer decides which layer runs."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x, past: int):
            position_ids = (torch.arange(x.shape[0]) + past).unsqueeze(0).expand(2, -1)
            first = position_ids[:, :1] - 1
            diff = torch.diff(position_ids, prepend=first, dim=-1)
            packed = (diff != 1).cumsum(-1)
            h = self.a(x) if (packed[:, -1] == 0).all() else self.b(x)
            return self.out(torch.relu(h))

    def step(model, opt, state, i):
        loss = train_step(lambda x: model(x, i % 3), opt, DATA[i % 6], i)
        state["log"].append(loss.detach())

    runner = check(step, with_sgd(Positions))
    # One read per iteration, answered on the Python side in every co-executed one: with recipes
    # at most 4 deep and none for `arange` or `cat`, it waited for `select`'s value from the graph.
    assert runner["known_reads"] >= STEPS - 2 * WARMUP and runner["known_reads_waited"] <= 2, runner


def test_a_recipe_reads_its_inputs_as_they_were_when_the_op_ran():
    """The op's inputs change after it ran and before the read: its placeholder input is
    written in place (the read waits for the graph: the value at its index is the tensor the
    write changes), a real tensor it read is overwritten (the recipe took a copy), its own output
    is written (no recipe), and an input that became known moves on (the recipe takes the value
    at its index, not the copy)."""

    def step(model, opt, state, i):
        loss = train_step(model, opt, DATA[i % 6], i)
        scaled = loss.detach() * 1.0
        threshold = torch.tensor(1.3)
        above = scaled > threshold   # a recipe: scaled (published), threshold (a copy)
        shifted = scaled + 0.25      # a recipe whose output is written below
        scaled.mul_(3.0)             # written after both ops read it
        threshold.fill_(100.0)       # overwritten after `above` read it
        shifted.sub_(1.0)            # its recipe no longer gives its value
        base = loss.detach() * 1.0
        tripled = base * 3.0         # a recipe over base
        first = float(base)          # base becomes known ...
        base.add_(1.0)               # ... and its known copy moves on: tripled reads the old one
        state["log"].append((bool(above), float(shifted), float(scaled), first, float(tripled), float(base)))

    check(step)


def test_a_checked_embedding_waits_for_its_indices_only():
    """try/except around an embedding whose batches are sometimes out of range: the check runs
    the embedding on the real indices with a stand-in weight, so it does not wait for the
    previous step to finish writing the weight; it raises in the same iterations as eager."""

    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 4)
            self.bad = 0

        def forward(self, ids):
            try:
                e = self.emb(ids)
            except (IndexError, RuntimeError):
                self.bad += 1
                e = self.emb(ids.clamp(0, 9))
            return self.head(e.mean(dim=1))

    ids = torch.randint(0, 10, (6, 16, 5), generator=torch.Generator().manual_seed(6))
    ids[3, 0, 0] = 12  # one batch in six is out of range

    def make_bag():
        torch.manual_seed(0)
        model = Bag()
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    def step(model, opt, state, i):
        loss = train_step(model, opt, ids[i % 6], i)
        state["log"].append(loss.detach())
        state["log"].append(model.bad)

    runner = check(step, make_bag)
    assert runner["early_reads"] + runner["known_reads_published"] >= STEPS - 2 * WARMUP, runner


def test_a_batch_the_idle_graph_waits_for_is_sent_at_once():
    """A read in the middle of the forward, then an op on a new tensor: the graph, caught up at
    the read, waits for that tensor's feed while Python still holds it in its unsent batch of
    posts. The batch goes at once (counted in `early_batches`) instead of when it fills or at the
    next read, which would wait for all the graph work the batch held back."""
    extra = torch.randn(6, 16, 4, generator=torch.Generator().manual_seed(8))

    def step(model, opt, state, i):
        h = model(DATA[i % 6])
        state["log"].append(h.abs().sum().item())  # the graph catches up here
        out = h * extra[i % 6]  # a fed tensor right after the read
        loss = F.cross_entropy(out, LABELS[i % 6])
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["log"].append(loss.detach())

    runner = check(step)
    assert runner["early_batches"] >= 1, runner
    assert runner["python_reads"] + runner["early_reads"] + runner["known_reads"] >= STEPS - 2 * WARMUP, runner


def test_step_counters_advanced_in_place_are_known_bit_for_bit():
    """Optimizers advance their step counters in place (`step_t += 1`) and read them at once.
    Python follows such one-element ops on its copies without the dispatcher
    (runtime/scalar_arithmetic.h): each dtype it takes, each op, Python numbers of both kinds
    and of every magnitude, a same-dtype one-element operand, and an alpha it leaves to ATen.
    Every read must be eager's value, answered without waiting for the graph."""
    rng = random.Random(11)
    floats = [rng.choice([1.0, -0.1, 1e-8, 3.3e30, 7.0 / 3.0, -2.5e-39]) * rng.uniform(0.5, 2.0) for _ in range(STEPS)]
    ints = [rng.choice([1, -3, 2**40, 7]) for _ in range(STEPS)]

    def step(model, opt, state, i):
        train_step(model, opt, DATA[i % 6], i)
        if "f32" not in state:
            state["f32"] = torch.tensor(0.75)
            state["f64"] = torch.tensor(0.75, dtype=torch.float64)
            state["i64"] = torch.tensor(5)
            state["inc"] = torch.tensor(1.0 / 3.0)
        f32, f64, i64 = state["f32"], state["f64"], state["i64"]
        f32 += floats[i]
        f32.sub_(ints[i] % 5)
        f32.mul_(1.0 + floats[i] * 1e-9)
        f32.add_(state["inc"])
        f64 += floats[i]
        f64 *= 1.0 / 3.0
        f64.sub_(ints[i])
        i64 += ints[i]
        i64.mul_(3)
        i64.sub_(1)
        f32.add_(floats[i], alpha=2)  # not taken: ATen runs it
        state["log"] += [f32.item(), f64.item(), i64.item()]

    runner = check(step)
    assert runner["known_reads"] >= 3 * (STEPS - 2 * WARMUP), runner


def test_running_averages_of_read_values_are_known_bit_for_bit():
    """`avg = 0.9 * avg + 0.1 * loss` after the loss was read: the functional add/sub/mul of
    one-element tensors Python knows are also followed without the dispatcher
    (runtime/scalar_arithmetic.h), and reading the average must give eager's bits. Beside the
    cases taken (float32, float64, int64; Python floats and ints; a same-dtype 0-dim tensor),
    cases it must leave to ATen because the result promotes or broadcasts: int64 * 0.5 (float),
    float32 + float64 tensor (float64), a 1-element vector + a 0-dim tensor, alpha != 1."""
    rng = random.Random(5)
    scales = [rng.choice([0.9, 1.0 / 3.0, 1e-7, 2.5e30]) * rng.uniform(0.5, 2.0) for _ in range(STEPS)]

    def step(model, opt, state, i):
        loss = train_step(model, opt, DATA[i % 6], i)
        if "f64" not in state:
            state["f64"] = torch.tensor(0.25, dtype=torch.float64)
            state["i64"] = torch.tensor(7)
            state["vec"] = torch.tensor([0.5])
        seen = loss.detach()
        state["log"].append(seen.item())  # the loss is known from here on
        avg = 0.9 * state["avg"] + 0.1 * seen
        avg = avg - scales[i] * 1e-9
        avg = avg * (1 + i % 3) + seen
        state["avg"] = avg
        f64 = state["f64"] * scales[i] + 1
        state["f64"] = f64 - 2 * (f64 * 1e-3)
        state["i64"] = state["i64"] * 3 - (i % 5) + 2**33
        mixed = state["f64"] + seen  # promotes to float64
        halves = state["i64"] * 0.5  # promotes to float
        vec = state["vec"] + seen  # broadcasts to [1]
        scaled = torch.add(seen, state["avg"], alpha=0.5)  # alpha != 1
        state["log"] += [state["avg"].item(), state["f64"].item(), state["i64"].item(), mixed.item(),
                         halves.item(), vec.item(), scaled.item(), str(mixed.dtype), str(halves.dtype)]

    runner = check(step)
    assert runner["known_reads"] >= 8 * (STEPS - 2 * WARMUP), runner


def test_comparisons_of_one_element_values_are_eager_bit_for_bit():
    """Branch conditions on one-element values (`if loss < avg`, `if x.mean() > 0.1`) are run on
    the Python side without the dispatcher (runtime/scalar_arithmetic.h): where the value is a
    recipe over the graph's (read before anything is known) and where it is known. Each case is
    one where comparing in another dtype would give another answer: float32 0.1 against the
    Python float 0.1 (equal in float32, not in float64), NaN against everything, -0.0 == 0.0,
    int64 against an int beyond float32's precision, and, left to ATen because they promote,
    int64 against a float and float32 against a float64 tensor."""

    def step(model, opt, state, i):
        loss = train_step(model, opt, DATA[i % 6], i)
        seen = loss.detach()
        # Recipes: the graph's value of the loss, compared on the Python side.
        state["log"] += [bool(seen < state["avg"]), bool(seen > 1.2), bool(seen.ge(i % 3)), bool(seen == seen),
                         bool(seen.le(seen))]
        state["avg"] = seen
        tenth = torch.tensor(0.1) * (1 + seen * 0)  # float32 0.1, a recipe over the loss
        nan = seen * float("nan")
        zero = torch.tensor(-0.0) * (1 + seen * 0)
        state["log"] += [bool(tenth > 0.1), bool(tenth == 0.1), bool(tenth >= 0.1), bool(nan < 1.0), bool(nan != nan),
                         bool(nan == nan), bool(nan >= nan), bool(zero == 0.0), bool(zero < 0), bool(zero.ne(0.0))]
        big = torch.tensor(2**40 + 1) + (seen * 0).long()  # int64
        state["log"] += [bool(big > 2**40), bool(big == 2**40 + 1), bool(big.lt(2**40 + 2)),
                         bool(big > 1.5),  # promotes to float: ATen
                         bool(tenth > torch.tensor(0.1, dtype=torch.float64))]  # promotes to float64: ATen
        # Known: the loss was read above, so these follow its copy.
        state["log"] += [bool(seen * 2 > seen), bool((seen - seen) != 0), bool(torch.ge(seen + 1, 1.0))]

    runner = check(step)
    assert runner["known_reads"] >= 15 * (STEPS - 2 * WARMUP), runner


def test_batch_norm_running_statistics_read_after_the_forward():
    """`bn.running_mean.sum().item()` after the forward, for logging. native_batch_norm's schema
    does not say that it writes its running statistics, so they passed for small tensors nothing
    had written, and the sum was computed from memory the graph had not updated yet: the
    previous step's statistics (capture/op_arguments.h, writes_running_statistics)."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4))
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    def step(model, opt, state, i):
        loss = F.cross_entropy(model(DATA[i % 6]), LABELS[i % 6])
        bn = model[1]
        mean, var = bn.running_mean.sum(), bn.running_var.max()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["log"] += [mean.item(), var.item(), int(bn.num_batches_tracked)]

    check(step, make)


def test_loss_read_after_the_step_is_not_computed_from_the_updated_weight():
    """`loss.item()` after `opt.step()`, with the graph given time to run the step first. In the
    first co-executed iteration the loss's recipe (huber_loss over the linear layer's output,
    itself a recipe over the bias, a copy, and `weight.t()`, a view of the weight, dead by then)
    took the view's value from the graph, whose weight the step had updated by then: the new weight and
    the old bias (about 19 in 20 fresh runs). Several fresh wraps, as the case is the first
    co-executed iteration's."""
    import time

    def run(terra: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Linear(10, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        if terra:
            model = terra_torch.wrap(model, speed_check=False)
        g = torch.Generator().manual_seed(1)
        log = []
        for _ in range(6):
            x = torch.randn(16, 10, generator=g)
            out = model(x)  # (kept: its recipe, not its published value, gives the loss)
            loss = F.huber_loss(out, x[:, :2] * 3)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if terra:
                time.sleep(0.02)  # (the graph runs the step before the read)
            log.append(loss.item())
        terra_torch.synchronize()
        return log, [p.detach().clone() for p in model.parameters()]

    eager_log, eager_params = run(False)
    for _ in range(3):
        terra_log, terra_params = run(True)
        assert terra_log == eager_log
        assert all(torch.equal(a, b) for a, b in zip(eager_params, terra_params))


@pytest.mark.parametrize("use", ["getitem", "index_select", "view_rows"])
def test_batches_indexed_by_slices_of_a_permutation_made_in_an_earlier_iteration(use):
    """The shuffle idiom `X[perm[i*bs:(i+1)*bs]]` with `perm = torch.randperm(n)` once per epoch:
    the permutation is a placeholder of the iteration that made it, and the index op, which
    checks its indices, gives the slice its value. That bound the slice into the storage it
    shares with `perm`, and `perm`, backed then, passed for an ordinary tensor with the rest of
    its elements uninitialized: the next slice, in the next iteration, indexed with garbage
    (IndexError, or silently wrong rows). The index op inside try/except is checked first, which
    gives its index its value. The base gets its whole value first now
    (PythonRunner::bind_base_first)."""

    def run(terra: bool):
        torch.manual_seed(0)
        X = torch.randn(64, 8)
        model = nn.Linear(8, 1)
        if terra:
            model = terra_torch.wrap(model)
        log = []
        for _ in range(8):
            perm = torch.randperm(64)  # made in the iteration that ends the epoch
            for i in range(2):
                if use == "view_rows":
                    idx = perm[:60].view(5, 12)[i]
                else:
                    idx = perm[i * 10:(i + 1) * 10]
                try:  # (guarded: the index op is checked before it runs, Region::check_first)
                    xb = X.index_select(0, idx) if use == "index_select" else X[idx]
                except IndexError:
                    xb = X[:10]
                log.append(model(xb).sum().detach())
        terra_torch.synchronize()
        stats = terra_torch.stats(model) if terra else None
        return torch.stack(log), stats

    la, _ = run(False)
    lb, stats = run(True)
    assert torch.equal(la, lb)
    assert stats.iterations["coexec"] >= 10, stats.iterations
