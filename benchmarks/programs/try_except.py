"""try/except around a tensor op that raises on some iterations.

Every third batch carries a corrupt token id (== vocabulary size), as dirty data does. The
embedding lookup raises IndexError on it; forward catches the error, counts the bad batch, and
retries with the ids clamped into range. The exception comes from a kernel's bounds check, so a
tool that runs the kernel later (in a graph, on another thread) must still raise it here, in
this try block, on the right iteration, and not execute anything the failed op would have fed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "bag-of-embeddings classifier; IndexError on corrupt ids caught, retried clamped"
FEATURES = ("try-except", "exception-from-kernel", "python-counter")
STEPS_PER_REP = 400
QUICK_STEPS_PER_REP = 100

VOCAB = 100


class BagClassifier(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 32, n_out: int = 4) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, n_out)
        self.bad_batches = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        try:
            e = self.emb(ids)
        except (IndexError, RuntimeError):
            self.bad_batches += 1
            e = self.emb(ids.clamp(0, self.vocab - 1))
        return self.head(torch.relu(self.mid(e.mean(dim=1))))


@dataclass
class State:
    net: BagClassifier
    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    batches = []
    for k in range(6):
        ids = torch.randint(0, VOCAB, (16, 12), generator=gen)
        y = ids[:, 0] % 4  # learnable: the class is a function of the first token
        if k % 3 == 2:
            ids[k, 5] = VOCAB  # one corrupt id in every third batch
        batches.append((ids.to(rt.device), y.to(rt.device)))
    net = BagClassifier().to(rt.device)
    model = rt.wrap(net, (batches[0][0],))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return State(net, model, opt, batches)


def step(s: State, i: int) -> torch.Tensor:
    ids, y = s.batches[i % len(s.batches)]
    loss = F.cross_entropy(s.model(ids), y)
    s.opt.zero_grad()
    loss.backward()
    s.opt.step()
    return loss.detach()


def digest(s: State) -> list[float]:
    return param_digest([s.net]) + [float(s.net.bad_batches)]
