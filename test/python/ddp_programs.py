"""Data-parallel training loops as DDP users write them, run by test_distributed.py in 2 processes
(gloo, loopback address), each first with eager DDP and then under terra_torch.wrap(DDP(model)).

    python ddp_programs.py PORT SCENARIO[,SCENARIO...]   -> one JSON line per scenario and rank

Each scenario returns what eager and terra must agree on bit for bit (losses, read values,
parameters, gradients) plus terra's iteration counts. Fault scenarios report the exception each
rank saw instead.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

STEPS = 60


def make_data(rank: int, n: int = 4, batch: int = 8, features: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(100 * seed + rank)  # each rank its own shard
    return [(torch.randn(batch, features, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


class Branchy(nn.Module):
    """Two heads, one of them used only on batches whose first feature sums above zero."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.a = nn.Linear(16, 3)
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if x[:, 0].sum() > 0:  # data-dependent: the ranks differ from step to step
            return self.b(h)
        return self.a(h)


def snapshot(net: nn.Module) -> dict:
    return {"params": [p.detach().flatten().tolist() for p in net.parameters()],
            "grads": [None if p.grad is None else p.grad.flatten().tolist() for p in net.parameters()],
            "buffers": [b.detach().flatten().tolist() for b in net.buffers()]}


def run(scenario: str, rank: int, terra: bool) -> dict:
    import terra_torch

    torch.manual_seed(0)
    kwargs = {}
    if scenario == "unused":
        net: nn.Module = Branchy()
        kwargs["find_unused_parameters"] = True
    elif scenario == "batchnorm":
        net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    else:
        net = mlp()
    ddp = nn.parallel.DistributedDataParallel(net, **kwargs)
    model = terra_torch.wrap(ddp, speed_check=False) if terra else ddp
    if terra and scenario == "speed_switch":
        # The speed check moves each rank between co-execution and eager on its own schedule.
        schedules = {0: [("coexec", 10), ("eager", 7), ("coexec", 15), ("eager", 3), ("coexec", 100)],
                     1: [("coexec", 20), ("eager", 11), ("coexec", 100)]}
        from forced_speed import Forced  # (beside this file, on the child's sys.path)

        model._terra_program._speed = Forced(schedules[rank])
    if scenario == "batchnorm":
        opt: torch.optim.Optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    elif scenario == "unused":
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, foreach=True)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    out: dict = {"losses": [], "reads": []}
    data = make_data(rank)

    if scenario == "sampler":
        # A DistributedSampler-style split of one dataset: each rank its own indices.
        g = torch.Generator().manual_seed(7)
        xs, ys = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
        dataset = torch.utils.data.TensorDataset(xs, ys)
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=2, rank=rank, seed=3)
        loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
        step = 0
        for epoch in range(8):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out["losses"].append(loss.item())
                step += 1
    else:
        for step in range(STEPS):
            x, y = data[step % len(data)]
            if scenario == "no_sync":
                # Gradient accumulation: two micro-batches, the first without communication.
                opt.zero_grad(set_to_none=step % 2 == 0)
                with ddp.no_sync():
                    F.cross_entropy(model(x[:4]), y[:4]).backward()
                loss = F.cross_entropy(model(x[4:]), y[4:])
                loss.backward()
                opt.step()
                out["losses"].append(loss.item())
                continue
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if scenario == "rank_print":
                if rank == 0 and step % 5 == 0:
                    out["reads"].append(loss.item())  # only rank 0 reads, every 5 steps
                continue
            if scenario == "metric":
                metric = loss.detach().clone()
                dist.all_reduce(metric)  # a metric averaged over ranks, in the loop
                if step % 3 == 0:
                    out["reads"].append(metric.item() / 2)
                # Every rank's predictions, gathered (an accuracy over the whole batch).
                with torch.no_grad():  # (DDP's forward under no_grad: no reduction expected)
                    hits = (model(x).argmax(1) == y).float()
                gathered = [torch.empty_like(hits) for _ in range(2)]
                dist.all_gather(gathered, hits)
                flat = torch.empty(2 * hits.numel())
                dist.all_gather_into_tensor(flat, hits)
                if step % 5 == 0:
                    out["reads"].append(torch.cat(gathered).mean().item())
                    out["reads"].append(flat.sum().item())
                continue
            if scenario == "diverge":
                if rank == 1 and step == 30:
                    # A path rank 1's graph has not seen, reached late: its graph has had time to
                    # run ahead to the allreduce below, which it must not issue before Python
                    # has validated it (Python issues it after the divergence).
                    time.sleep(0.05)
                    out["reads"].append((loss * 3).item())
                metric = loss.detach().clone()
                dist.all_reduce(metric)
                if step % 10 == 0:
                    out["reads"].append(metric.item())
            out["losses"].append(loss.item())
    if terra:
        terra_torch.synchronize()
        out["iterations"] = dict(terra_torch.stats(model).iterations)
        out["fallbacks"] = terra_torch.stats(model).fallbacks
        evaluation = terra_torch.stats(model).evaluation
        out["eval_iterations"] = dict(evaluation.iterations) if evaluation is not None else None
        out["why"] = [f"{f.iteration} {f.reason[:200]}" for f in model._terra_program.fallbacks]
        out["backward"] = {k: v for k, v in terra_torch.stats(model).runner.items() if k.startswith("backward")}
        terra_torch.unwrap(model)
    if scenario == "plain":
        # After unwrap, DDP's own forward and reducer work again (eager runs the same steps).
        for step in range(5):
            x, y = data[step % len(data)]
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out["losses"].append(loss.item())
    out.update(snapshot(net))
    return out


def gan(rank: int, terra: bool) -> dict:
    """Two DDP modules trained in turns (a GAN): each backward reduces the gradients of the modules
    whose forward asked for it and whose parameters it reached: D's alone, then G's and D's."""
    import terra_torch

    torch.manual_seed(0)
    g_net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    d_net = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    g_ddp, d_ddp = nn.parallel.DistributedDataParallel(g_net), nn.parallel.DistributedDataParallel(d_net)
    g_model = terra_torch.wrap(g_ddp, speed_check=False) if terra else g_ddp
    d_model = terra_torch.wrap(d_ddp, speed_check=False) if terra else d_ddp
    opt_g = torch.optim.Adam(g_net.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d_net.parameters(), lr=2e-3, betas=(0.5, 0.999))
    gen = torch.Generator().manual_seed(rank)
    reals = [torch.randn(8, 8, generator=gen) + 1 for _ in range(4)]
    noise = [torch.randn(8, 4, generator=gen) for _ in range(4)]
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
    out: dict = {"losses": [], "reads": []}
    for step in range(40):
        fake = g_model(noise[step % 4])
        d_loss = (F.binary_cross_entropy_with_logits(d_model(reals[step % 4]), ones) +
                  F.binary_cross_entropy_with_logits(d_model(fake.detach()), zeros))
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(d_model(fake), ones)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        out["losses"].append(d_loss.item())
        out["reads"].append(g_loss.item())
    if terra:
        terra_torch.synchronize()
        out["iterations"] = {k: v + d for (k, v), d in zip(terra_torch.stats(g_model).iterations.items(),
                                                          terra_torch.stats(d_model).iterations.values())}
        out["fallbacks"] = terra_torch.stats(g_model).fallbacks + terra_torch.stats(d_model).fallbacks
        out["backward"] = {"backward_replayed": terra_torch.stats(d_model).runner["backward_replayed"]}
        terra_torch.unwrap(g_model)
        terra_torch.unwrap(d_model)
    out.update({k: a + b for (k, a), b in zip(snapshot(g_net).items(), snapshot(d_net).values())})
    return out


def function(rank: int, terra: bool) -> dict:
    """@terra_torch.function around a step that calls an unwrapped DDP module: DDP's own forward
    and reducer run inside the region, on placeholders (their bucket copies and the bucket's
    allreduce, lowered to a functional one, are traced like the program's own ops)."""
    import terra_torch

    torch.manual_seed(0)
    net = mlp()
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    if terra:
        step = terra_torch.function(step, speed_check=False)
    data = make_data(rank)
    out: dict = {"losses": [], "reads": []}
    for i in range(STEPS):
        out["losses"].append(step(*data[i % len(data)]).item())
    if terra:
        terra_torch.synchronize()
        out["iterations"] = dict(terra_torch.stats(step).iterations)
        out["fallbacks"] = terra_torch.stats(step).fallbacks
        out["backward"] = {"backward_replayed": terra_torch.stats(step).runner["backward_replayed"]}
    out.update(snapshot(net))
    return out


def fault(scenario: str, rank: int, terra: bool) -> dict:
    """One rank raises in its step (`raise`): every rank must get an error, none may hang."""
    import terra_torch

    torch.manual_seed(0)
    net = mlp()
    ddp = nn.parallel.DistributedDataParallel(net)
    model = terra_torch.wrap(ddp, speed_check=False) if terra else ddp
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    data = make_data(rank)
    try:
        for step in range(STEPS):
            x, y = data[step % len(data)]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            if rank == 1 and step == 30:
                raise ValueError("rank 1 fails in its step")
            loss.backward()
            opt.step()
            loss.item()
        if terra:
            terra_torch.synchronize()
    except Exception as e:  # noqa: BLE001 (what each rank saw is the result)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"error": None}


def worker(rank: int, port: int, scenarios: list[str], queue) -> None:
    # A rank that hangs prints where and exits (the test then fails on its missing report).
    faulthandler.dump_traceback_later(200, exit=True)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        for scenario in scenarios:
            if scenario == "raise":
                result = {"terra": fault(scenario, rank, True)}
            elif scenario == "gan":
                result = {"eager": gan(rank, False), "terra": gan(rank, True)}
            elif scenario == "function":
                result = {"eager": function(rank, False), "terra": function(rank, True)}
            else:
                result = {"eager": run(scenario, rank, False), "terra": run(scenario, rank, True)}
            queue.put(json.dumps({"scenario": scenario, "rank": rank, **result}))
        if "raise" not in scenarios:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        queue.put(json.dumps({"scenario": "?", "rank": rank, "crash": traceback.format_exc()[-3000:]}))
    queue.put(json.dumps({"done": rank}))
    if "raise" in scenarios:
        queue.close()
        queue.join_thread()
        os._exit(0)  # the process group is broken: do not wait for its peer at exit


def main() -> None:
    port, scenarios = int(sys.argv[1]), sys.argv[2].split(",")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, scenarios, queue)) for r in range(2)]
    for p in procs:
        p.start()
    done = 0
    while done < 2:
        line = queue.get(timeout=240)
        if '"done"' in line:
            done += 1
        else:
            print(line, flush=True)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
