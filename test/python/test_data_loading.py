"""A DataLoader's batch assembly runs outside the program (csrc/capture/outside_program.h,
terra_torch/_data_loading.py): in a loop under terra_torch.wrap, the dataset's indexing and the
collate function's stacking run for real where Python calls them and reach neither the trace nor
the graph, where nothing the graph owes can reach them. Each program trains eagerly and under
terra_torch.wrap from the same seeds, over several epochs, and must match bitwise (losses and
parameters); where the loader's work touches what the program draws or writes, those ops stay in
the program and the numbers stay eager's."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import terra_torch
from terra_torch import _C, runtime


def model_and_optimizer(dropout: float = 0.0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(make_loader: Callable[[], Any], terra: bool, epochs: int = 8, dropout: float = 0.0,
          after_step: Callable[[Any, torch.Tensor], None] | None = None) -> dict[str, Any]:
    """Trains `epochs` epochs over the loader `make_loader()` makes (called after the model's
    seed); per batch of the co-executed iterations, the ops the region handled while the loader
    made it (`next(it)` runs in the open region of the iteration before)."""
    model, opt = model_and_optimizer(dropout)
    loader = make_loader()
    wrapped = terra_torch.wrap(model, speed_check=False) if terra else model
    losses: list[torch.Tensor] = []
    loader_ops: list[int] = []
    for _ in range(epochs):
        it = iter(loader)
        while True:
            program = getattr(wrapped, "_terra_program", None)
            region = getattr(program, "_region", None)
            coexec = region is not None and program.phase == "coexec"
            before = region.handled if coexec else 0
            try:
                x, y = next(it)
            except StopIteration:
                break
            if coexec:
                loader_ops.append(region.handled - before)
            per_sample = F.cross_entropy(wrapped(x), y, reduction="none")
            loss = per_sample.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if after_step is not None:
                after_step(loader, per_sample)
            losses.append(loss.detach())
    out: dict[str, Any] = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
                           "loader_ops": loader_ops}
    if terra:
        terra_torch.synchronize()
        out["stats"] = terra_torch.stats(wrapped)
        out["reasons"] = [f.reason for f in wrapped._terra_program.fallbacks]
        out["explained"] = str(terra_torch.explain(wrapped))
        terra_torch.unwrap(wrapped)
    return out


def check(make_loader: Callable[[], Any], **kw: Any) -> dict[str, Any]:
    eager, terra = train(make_loader, False, **kw), train(make_loader, True, **kw)
    assert len(eager["losses"]) == len(terra["losses"]) >= 40
    assert all(torch.equal(a, b) for a, b in zip(eager["losses"], terra["losses"]))
    assert all(torch.equal(a, b) for a, b in zip(eager["params"], terra["params"]))
    st = terra["stats"]
    assert st.iterations["eager"] == 0 and st.iterations["coexec"] >= len(terra["losses"]) - 8, (st.iterations,
                                                                                                terra["reasons"])
    return terra


def tensors(n: int = 60) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_a_shuffled_tensor_dataset_is_assembled_outside_the_program():
    """64 selects and 2 stacks per batch of 32 pairs (TensorDataset.__getitem__, default_collate)
    would be the program's ops; outside it the region handles only the training step's ops, and
    epochs bring no fallback of their own (the short last batch is a new size for the loss, as
    for any program: at most two while the program learns it)."""
    r = check(lambda: DataLoader(tensors(), batch_size=16, shuffle=True), epochs=12)
    assert r["stats"].fallbacks <= 2, r["reasons"]
    assert len(r["loader_ops"]) >= 30
    seeded_epochs(r["loader_ops"], 12)
    # explain() counts them: at least the 34 ops of each full co-executed batch
    assert r["stats"].runner["outside_ops"] >= 34 * 24, r["stats"].runner["outside_ops"]
    assert "ops outside the program" in r["explained"], r["explained"]


def seeded_epochs(loader_ops: list[int], epochs: int) -> None:
    """No op of the loader reaches the program but the sampler's seed, drawn from the default
    generator at each epoch's first batch (`random_` and its `item()`: the program's draw, in
    program order)."""
    assert set(loader_ops) <= {0, 2} and loader_ops.count(2) <= epochs, loader_ops


def test_the_block_is_what_keeps_the_loader_out_of_the_program(monkeypatch):
    """Without the block (the stand-ins' context manager made a no-op), the same loop records the
    loader's ops: the count above is the block's doing, not the program's shape."""
    import contextlib

    monkeypatch.setattr(_C, "outside_program", contextlib.nullcontext)
    r = train(lambda: DataLoader(tensors(), batch_size=16, shuffle=True), True, epochs=6)
    # (a select per tensor per sample, and a stack per tensor: 34 for a full batch of 16)
    assert r["loader_ops"] and min(r["loader_ops"]) >= 2 * 12 + 2, r["loader_ops"]


class NoisyDataset(Dataset):
    """Random augmentation from the default generator, as a transform would draw it."""

    def __init__(self) -> None:
        self.data = tensors()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        return x + 0.1 * torch.randn(8), y


def test_draws_from_the_default_generator_stay_in_program_order():
    """The dataset draws noise from the default generator and the model draws dropout masks from
    it: those draws stay the program's (recorded, the graph draws them in program order), while
    the indexing around them runs outside. Drawn on the Python side instead, the dropout masks
    of the steps the graph had not run yet would come after the next batch's noise."""
    check(lambda: DataLoader(NoisyDataset(), batch_size=10, shuffle=True), dropout=0.3)


class WeightedDataset(Dataset):
    """Each sample carries a weight the training loop rewrites in place after every step (the
    hardest samples weigh more): a tensor the program writes, which the loader reads."""

    def __init__(self) -> None:
        self.data = tensors()
        self.weight = torch.ones(len(self.data))
        self.last: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        return x * self.weight[i], y


def test_a_tensor_the_program_writes_is_read_in_program_order():
    """Every other step the loop writes the weights of the samples two batches ahead
    (`index_put_`), after a few ms of matrix products the graph runs first; the batch after next
    reads them in the next iteration, in which the program wrote nothing, while the graph may
    still be behind the write. An op of the loader reading memory the program has written stays
    the program's (the graph runs it after the write), so every batch sees the weights eager's
    would."""
    steps = [0]

    def reweight(loader: DataLoader, per_sample: torch.Tensor) -> None:
        step = steps[0]
        steps[0] += 1
        if step % 2:
            return
        ds = loader.dataset
        idx = torch.arange(10) + 10 * ((step + 2) % 6)  # (six batches of ten, in order)
        slow = per_sample.detach()[:1] * torch.ones(200, 200)
        for _ in range(4):
            slow = slow @ slow / 200.0
        ds.weight[idx] = 1.0 + per_sample.detach().clamp(max=2.0) + 0.0 * slow[0, :1]

    check(lambda: DataLoader(WeightedDataset(), batch_size=10, shuffle=False), after_step=reweight)


class NormalizingDataset(Dataset):
    """Clones a sample and normalises the clone in place, reads a label through numpy."""

    def __init__(self) -> None:
        self.data = tensors()
        self.labels = self.data.tensors[1].clone()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.data.tensors[0][i].clone()
        x.sub_(x.mean()).div_(x.std() + 1e-5)
        return x, int(self.labels[i : i + 1].numpy()[0])


def test_writes_into_what_the_loader_made_and_numpy_reads_run_outside(monkeypatch):
    """In-place writes into a tensor the block made, and numpy() of the dataset's tensors, stay
    outside: no op of the loader is handled, and no numpy() waits for the graph (a read of memory
    the graph may write waits until the graph has caught up: Program.materialize)."""
    waits: list[int] = []
    materialize = runtime.Program.materialize

    def counted(self, t):
        waits.append(1)
        return materialize(self, t)

    monkeypatch.setattr(runtime.Program, "materialize", counted)
    r = check(lambda: DataLoader(NormalizingDataset(), batch_size=12, shuffle=True))
    assert r["loader_ops"]
    seeded_epochs(r["loader_ops"], 8)
    assert waits == [], len(waits)


class ReusedBuffer(IterableDataset):
    """Yields every batch in the same preallocated tensor (`copy_` into it): the graph may still
    read the last batch from it when the next one is written."""

    def __init__(self) -> None:
        self.data = tensors()
        self.buffer = torch.empty(10, 8)

    def __iter__(self):
        for k in range(0, 60, 10):
            x, y = self.data[k : k + 10]
            yield self.buffer.copy_(x * 2.0), y


def test_a_write_into_memory_the_graph_reads_stays_in_program_order():
    """The loader writes each batch into the tensor the model read the batch before from: that
    write is the program's (recorded), so the graph reads every batch before the next one
    overwrites it."""
    check(lambda: DataLoader(ReusedBuffer(), batch_size=None))


class ReplayBuffer(IterableDataset):
    """Yields batches of the program's own values: detached outputs the loop appends."""

    def __init__(self) -> None:
        self.data = tensors()
        self.kept: list[torch.Tensor] = []

    def __iter__(self):
        for k in range(0, 60, 10):
            x, y = self.data[k : k + 10]
            if self.kept:
                x = x + 0.01 * self.kept[-1].mean()
            yield x, y


def test_a_loader_that_reads_values_of_the_program_records_those_ops():
    """A batch computed from a value the program produced (a kept loss) is the program's: those
    ops are recorded and the graph computes them."""

    def keep(loader: DataLoader, per_sample: torch.Tensor) -> None:
        loader.dataset.kept.append(per_sample.detach())

    check(lambda: DataLoader(ReplayBuffer(), batch_size=None), after_step=keep, epochs=8)


def test_outside_a_co_executed_iteration_the_block_changes_nothing(monkeypatch):
    """Eagerly (no program), the stand-ins only open the block: the loader's batches are those of
    torch's own methods."""
    def batches() -> list[torch.Tensor]:
        loader = DataLoader(tensors(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(3))
        return [x.clone() for _ in range(2) for x, _ in loader]

    got = batches()
    assert not _C.outside_program_active()
    monkeypatch.setattr(DataLoader, "__iter__", DataLoader.__iter__.__wrapped__)
    iterator = torch.utils.data.dataloader._BaseDataLoaderIter
    monkeypatch.setattr(iterator, "__next__", iterator.__next__.__wrapped__)
    want = batches()
    assert len(got) == len(want) == 8 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_loader_of_ones_own_in_an_outside_program_block():
    """terra_torch.outside_program() around a hand-written batch function (index a tensor, stack):
    its ops stay out of the program, as a DataLoader's do, and the numbers are eager's."""
    data = tensors(96)
    order = torch.randperm(96, generator=torch.Generator().manual_seed(7)).tolist()
    loader_ops: list[int] = []

    def run(terra: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model, opt = model_and_optimizer()
        wrapped = terra_torch.wrap(model, speed_check=False) if terra else model
        losses = []
        for step in range(48):
            program = getattr(wrapped, "_terra_program", None)
            region = getattr(program, "_region", None)
            before = region.handled if region is not None and program.phase == "coexec" else None
            with terra_torch.outside_program():
                idx = order[(step * 8) % 96:(step * 8) % 96 + 8]
                x = torch.stack([data.tensors[0][i] for i in idx])
                y = torch.stack([data.tensors[1][i] for i in idx])
            if before is not None:
                loader_ops.append(region.handled - before)
            loss = F.cross_entropy(wrapped(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        if terra:
            terra_torch.synchronize()
            terra_torch.unwrap(wrapped)
        return losses, [p.detach().clone() for p in model.parameters()]

    (la, pa), (lb, pb) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(la, lb)) and all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert len(loader_ops) >= 40 and max(loader_ops) == 0, loader_ops


def test_running_statistics_read_in_a_block_stay_the_programs():
    """A batch function that normalises with the model's batch-norm statistics, inside
    outside_program(). native_batch_norm's schema does not say that it writes its running
    statistics (capture/op_arguments.h): they were not listed as memory the program writes, so
    `bn.running_mean` passed for data nothing had written and its sum ran outside, on memory the
    graph (behind Python: a wide layer and no read per step) had not updated yet."""
    g = torch.Generator().manual_seed(4)
    xs, ys = torch.randn(64, 64, generator=g), torch.randint(0, 3, (64,), generator=g)

    def run(terra: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        wrapped = terra_torch.wrap(model, speed_check=False) if terra else model
        bn = model[1]
        shifts = []
        for step in range(40):
            with terra_torch.outside_program():
                shift = bn.running_mean.sum() * 1e-3
                x = xs[(step % 8) * 8:(step % 8) * 8 + 8] + shift
            loss = F.cross_entropy(wrapped(x), ys[(step % 8) * 8:(step % 8) * 8 + 8])
            opt.zero_grad()
            loss.backward()
            opt.step()
            shifts.append(shift)
        if terra:
            terra_torch.synchronize()
            terra_torch.unwrap(wrapped)
        return shifts, [p.detach().clone() for p in model.parameters()]

    (sa, pa), (sb, pb) = run(False), run(True)
    assert [float(v) for v in sb] == [float(v) for v in sa]
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
