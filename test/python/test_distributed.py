"""Data-parallel training under terra_torch (docs/DISTRIBUTED.md): terra_torch.wrap(DDP(model))
co-executes and gives eager DDP's results bit for bit (2 processes, gloo over the loopback address,
spawned by test/python/ddp_programs.py in a child process with a time limit: a collective that
waits forever must fail the test, not stop the suite)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).with_name("ddp_programs.py")
SCENARIOS = ("plain", "batchnorm", "no_sync", "rank_print", "metric", "unused", "sampler", "diverge", "speed_switch",
             "gan", "function")


def _port(tag: str) -> int:
    return 29000 + (sum(map(ord, tag)) * 7919) % 900 * 2


def _run(scenarios: str, timeout: float = 300) -> dict[tuple[str, int], dict]:
    try:
        out = subprocess.run([sys.executable, str(PROGRAMS), str(_port(scenarios)), scenarios], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"data-parallel training hung: {e.stdout}\n{e.stderr}")
    assert out.returncode == 0, out.stderr[-3000:]
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            assert "crash" not in r, r["crash"]
            results[(r["scenario"], r["rank"])] = r
    return results


@pytest.fixture(scope="module")
def programs() -> dict[tuple[str, int], dict]:
    return _run(",".join(SCENARIOS))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_wrapped_ddp_co_executes_with_eager_ddps_bits(programs, scenario):
    """Losses, values read in the loop, parameters, gradients and buffers of both ranks equal eager
    DDP's, and most iterations co-executed (the rest traced once, or fell back where the program
    does something the graph has not seen: a DistributedSampler's new generator each epoch, rank
    1's new path in `diverge`)."""
    for rank in (0, 1):
        r = programs[(scenario, rank)]
        e, t = r["eager"], r["terra"]
        for key in ("losses", "reads", "params", "grads", "buffers"):
            assert e[key] == t[key], (scenario, rank, key)
        it = t["iterations"]
        if scenario == "speed_switch":
            # The ranks ran eagerly at different iterations (7 + 3 and 11 of them): the
            # collectives still came in the same order.
            assert it["eager"] == (10 if rank == 0 else 11), (scenario, rank, it)
        else:
            assert it["coexec"] >= (0.6 if scenario == "sampler" else 0.85) * sum(it.values()), (scenario, rank, it)
        # The reducer's hooks are idle: backward() is replayed without the engine. (Not in the
        # GAN, whose backwards reach into the other network's program, nor under
        # terra_torch.function, where DDP's own reducer works.)
        if scenario not in ("gan", "function"):
            assert t["backward"]["backward_replayed"] > 0, (scenario, rank, t["backward"])
    if scenario == "diverge":
        # Rank 1 left its graph once; rank 0 co-executed throughout; neither deadlocked.
        assert programs[("diverge", 1)]["terra"]["fallbacks"] >= 1
        assert programs[("diverge", 0)]["terra"]["fallbacks"] == 0
    if scenario == "metric":
        # The gathers ran in the no_grad calls' program, co-executed (lowered to functional
        # collectives; an unlowered one would have ended co-execution every time).
        for rank in (0, 1):
            it = programs[("metric", rank)]["terra"]["eval_iterations"]
            assert it["coexec"] >= 0.85 * sum(it.values()), (rank, it)
    if scenario == "rank_print":
        assert programs[("rank_print", 0)]["terra"]["reads"] and not programs[("rank_print", 1)]["terra"]["reads"]
    if scenario == "unused":
        # Some step used a head on one rank only: that head's gradient came from the other rank.
        grads = programs[("unused", 0)]["terra"]["grads"]
        assert all(g is not None for g in grads)


def test_a_rank_that_raises_gives_every_rank_an_error_and_no_hang():
    """Rank 1 raises in its step 30; rank 0's graph is in the allreduce of that step's gradients,
    which gloo fails when rank 1's process leaves: rank 0 gets a RuntimeError naming the
    collective, where eager DDP would raise from backward()."""
    results = _run("raise", timeout=240)
    assert results[("raise", 1)]["terra"]["error"].startswith("ValueError: rank 1 fails")
    error = results[("raise", 0)]["terra"]["error"]
    assert error is not None and "collective" in error and "failed in the graph" in error, error


CHILD = textwrap.dedent("""
    import os, sys, warnings
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist, torch.multiprocessing as mp

    def worker(rank, terra, port, q):
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.set_num_threads(1)
        import terra_torch
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if not terra:
                model = nn.parallel.DistributedDataParallel(net)
            elif CASE == "DDP(wrap)":
                model = nn.parallel.DistributedDataParallel(terra_torch.wrap(net))
            else:  # a communication hook: DDP runs as usual
                model = nn.parallel.DistributedDataParallel(net)
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
                model.register_comm_hook(None, default_hooks.allreduce_hook)
                model = terra_torch.wrap(model)
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(rank)
            data = [(torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(4)]
            losses = []
            for i in range(24):
                x, y = data[i % 4]
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                losses.append(loss.item())
        phases = terra_torch.stats(net if CASE == "DDP(wrap)" else model).iterations if terra else None
        warned = [str(w.message) for w in caught if "terra_torch.wrap" in str(w.message)]
        q.put((rank, terra, losses, [p.detach().tolist() for p in net.parameters()], phases, warned))
        dist.destroy_process_group()

    CASE = sys.argv[2]

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        out = {}
        for terra, port in ((False, int(sys.argv[1])), (True, int(sys.argv[1]) + 1)):
            q = ctx.Queue()
            ps = [ctx.Process(target=worker, args=(r, terra, port, q)) for r in range(2)]
            for p in ps:
                p.start()
            for _ in range(2):
                r = q.get(timeout=90)
                out[(r[0], r[1])] = r
            for p in ps:
                p.join(timeout=30)
        for rank in range(2):
            e, t = out[(rank, False)], out[(rank, True)]
            print("RANK", rank, "BITWISE", e[2] == t[2] and e[3] == t[3], "PHASES", t[4], "WARNED", t[5])
""")


@pytest.mark.parametrize("case", ["DDP(wrap)", "comm_hook"])
def test_what_is_not_lowered_warns_and_runs_eagerly_with_eager_ddp_results(tmp_path, case):
    """DDP(terra_torch.wrap(model)) (seen at the first forward call: before, the reducer's
    collectives inside backward raised for terra's dispatch key on one rank and left the other
    waiting) and a DDP with a communication hook run eagerly, with a warning that says why."""
    script = tmp_path / "ddp_child.py"
    script.write_text(CHILD)
    try:
        out = subprocess.run([sys.executable, str(script), str(_port(case) + 1), case], capture_output=True,
                             text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"data-parallel training hung: {e.stdout}\n{e.stderr}")
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(f"RANK {rank}"))
        assert "BITWISE True" in line, line
        assert "'tracing': 0" in line and "'coexec': 0" in line, line  # (the last iteration is still open)
        expected = "wrap the DistributedDataParallel module instead" if case == "DDP(wrap)" else "communication hook"
        assert expected in line, line


DROPPED = textwrap.dedent("""
    import gc, os, sys, torch, torch.nn as nn, torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[1]
    dist.init_process_group("gloo", rank=0, world_size=1)
    import terra_torch

    def train():
        net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        model = terra_torch.wrap(nn.parallel.DistributedDataParallel(net, find_unused_parameters=True))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(10):
            loss = model(torch.randn(3, 8)).sum()
            opt.zero_grad(); loss.backward(); opt.step()
        terra_torch.synchronize()
        return terra_torch.stats(model).runner["backward_replayed"]

    replayed = [train() for _ in range(3)]  # each wrapped DDP dropped without unwrap
    gc.collect()
    kept = terra_torch.wrap(nn.parallel.DistributedDataParallel(nn.Linear(2, 2)))  # wrapped at exit
    print("REPLAYED", replayed, flush=True)
""")


def test_a_wrapped_ddp_dropped_without_unwrap_gives_its_reducer_back_its_hooks(tmp_path):
    """The reducer's hooks are wrapped while it is idle (runtime/backward_replay.h); the reducer
    deletes them by address when it is destroyed, so they go back first, whenever the DDP module
    dies (without that, the reducer's destructor raised and the process aborted)."""
    script = tmp_path / "dropped.py"
    script.write_text(DROPPED)
    out = subprocess.run([sys.executable, str(script), str(_port("dropped") + 1)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    replayed = eval(next(ln for ln in out.stdout.splitlines() if ln.startswith("REPLAYED"))[len("REPLAYED "):])
    assert all(r > 0 for r in replayed), replayed  # find_unused_parameters=True replays too
