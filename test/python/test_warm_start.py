"""Warm start (terra_torch/_warm_start.py): a restarted job co-executes from its first iteration
with the traces an earlier run kept, with the same numbers as eager; corrupt, foreign and stale
entries are ignored with one warning; concurrent writers never leave a broken file.

Each run is a fresh Python process (a warm start only means something across processes)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import terra_torch
from terra_torch import _C, _warm_start

# A training loop as people write it: batches indexed by step, an LR schedule, Adam, a branch on
# the loss, a print. Prints one JSON line: what terra did and the numbers, with eager's.
SCRIPT = textwrap.dedent('''
    import json, sys, warnings
    import torch
    import terra_torch

    HIDDEN = int(sys.argv[2]) if len(sys.argv) > 2 else 16

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        return model, opt, sched

    def train(model, opt, sched, steps=30):
        g = torch.Generator().manual_seed(1)
        xs, ys = torch.randn(steps, 4, 8, generator=g), torch.randn(steps, 4, 1, generator=g)
        losses = []
        for step in range(steps):
            loss = torch.nn.functional.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            if loss > 10.0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
        return losses

    model, opt, sched = make()
    eager = train(model, opt, sched)
    eager_params = [p.detach().clone() for p in model.parameters()]

    model, opt, sched = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = terra_torch.wrap(model, warm_start=sys.argv[1], speed_check=False)
        terra = train(model, opt, sched)
        terra_torch.synchronize()
    s = terra_torch.stats(model)
    print(json.dumps({
        "same_losses": [a.hex() for a in eager] == [b.hex() for b in terra],
        "same_params": all(torch.equal(a, b) for a, b in zip(eager_params, model.parameters())),
        "iterations": s.iterations, "transitions": s.transitions, "warm_start": s.warm_start,
        "warnings": [str(w.message) for w in caught if "terra_torch" in str(w.message)],
    }))
''')


def run(script: Path, folder: Path, *extra: str) -> dict:
    env = dict(os.environ, TERRA_SPEED_CHECK="0")
    out = subprocess.run([sys.executable, str(script), str(folder), *extra], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json"))


def test_a_restarted_job_coexecutes_from_its_first_iteration(script: Path, tmp_path: Path) -> None:
    folder = tmp_path / "kept"
    cold = run(script, folder)
    assert cold["same_losses"] and cold["same_params"]
    assert cold["warm_start"]["loaded"] is False and cold["warm_start"]["kept"] >= 1
    assert cold["iterations"]["tracing"] >= 2  # the first iteration (Adam's state) and more
    assert len(entries(folder)) == 1

    warm = run(script, folder)
    assert warm["same_losses"] and warm["same_params"], warm
    assert warm["warm_start"]["loaded"] is True and warm["warm_start"]["traces"] >= cold["iterations"]["tracing"]
    assert warm["iterations"]["tracing"] == 0, warm
    assert warm["transitions"][0] == [0, "tracing", "coexec"]
    assert warm["iterations"]["coexec"] == 30
    assert warm["warnings"] == []


def test_another_module_structure_is_another_program(script: Path, tmp_path: Path) -> None:
    folder = tmp_path / "kept"
    run(script, folder, "16")
    wider = run(script, folder, "32")
    assert wider["warm_start"]["loaded"] is False and wider["warnings"] == []
    assert wider["same_losses"] and wider["same_params"]
    assert len(entries(folder)) == 2


def test_a_corrupt_entry_is_ignored_with_one_warning_and_rebuilt(script: Path, tmp_path: Path) -> None:
    folder = tmp_path / "kept"
    run(script, folder)
    [entry] = entries(folder)
    entry.write_text(entry.read_text()[: len(entry.read_text()) // 2])  # a half-written file
    broken = run(script, folder)
    assert broken["same_losses"] and broken["same_params"]
    assert broken["warm_start"]["loaded"] is False
    assert len(broken["warnings"]) == 1 and "corrupt" in broken["warnings"][0]
    again = run(script, folder)
    assert again["warm_start"]["loaded"] is True and again["warnings"] == []


def test_a_stale_entry_is_ignored_when_the_source_changed(script: Path, tmp_path: Path) -> None:
    folder = tmp_path / "kept"
    run(script, folder)
    script.write_text(SCRIPT.replace("if loss > 10.0:", "if loss > 20.0:"))
    stale = run(script, folder)
    assert stale["warm_start"]["loaded"] is False
    assert len(stale["warnings"]) == 1 and "stale" in stale["warnings"][0] and "train.py" in stale["warnings"][0]
    assert stale["same_losses"] and stale["same_params"]
    again = run(script, folder)
    assert again["warm_start"]["loaded"] is True and again["iterations"]["tracing"] == 0


def test_a_foreign_entry_is_ignored(script: Path, tmp_path: Path) -> None:
    folder = tmp_path / "kept"
    run(script, folder, "16")
    [small] = entries(folder)
    run(script, folder, "32")
    [large] = [p for p in entries(folder) if p != small]
    large.write_bytes(small.read_bytes())  # the 16-wide program's entry under the 32-wide's name
    foreign = run(script, folder, "32")
    assert foreign["warm_start"]["loaded"] is False
    assert len(foreign["warnings"]) == 1 and "foreign" in foreign["warnings"][0] and "structure" in foreign["warnings"][0]
    assert foreign["same_losses"] and foreign["same_params"]


def _save_many(folder: str, worker: int) -> None:
    kept = _warm_start.KeptProgram(Path(folder), "concurrent", None, [])
    for i in range(40):
        kept.save(json.dumps({"format": "x", "frames": [], "writer": worker, "i": i, "pad": "x" * (20000 * (i % 3))}))


def test_concurrent_writers_never_leave_a_broken_entry(tmp_path: Path) -> None:
    folder = tmp_path / "kept"
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_save_many, args=(str(folder), w)) for w in range(4)]
    for w in writers:
        w.start()
    kept = _warm_start.KeptProgram(folder, "concurrent", None, [])
    reads = 0
    while any(w.is_alive() for w in writers):
        text = kept.load()  # never a warning: every file a reader sees is complete
        if text is not None:
            assert json.loads(text)["format"] == "x"
            reads += 1
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert json.loads(kept.load())["i"] == 39
    assert [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []


def test_export_and_import_give_the_same_graph(tmp_path: Path) -> None:
    """In one process: a session's export merged into a new session generates the same graph."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @terra_torch.function(warm_start=tmp_path, speed_check=False)
    def step(x):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    for i in range(6):
        step(torch.full((3, 4), float(i)))
    terra_torch.synchronize()
    session = step._terra_program._session
    text = session.export_program()
    copy = _C.runtime.Session("coexec", False, False, True)
    copy.import_program(text)
    copy.build()
    assert copy.num_traces == session.num_traces
    assert copy.text == session.text
    assert copy.to_dot() == session.to_dot()  # nodes labelled with the same source lines
    assert "test_warm_start.py" in copy.to_dot()
    assert json.loads(copy.export_program())["traces"] == json.loads(text)["traces"]
    with pytest.raises(ValueError, match="format"):
        _C.runtime.Session("coexec", False, False, True).import_program('{"format": "other"}')
    broken = json.loads(text)
    broken["traces"][0]["ops"][0]["op"] = "aten::no_such_op"
    fresh = _C.runtime.Session("coexec", False, False, True)
    with pytest.raises(ValueError, match="no_such_op"):
        fresh.import_program(json.dumps(broken))
    assert fresh.num_traces == 0
