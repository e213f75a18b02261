"""A tiny GPT-2-style language model, defined here (no downloads, no transformers package).

Pre-LayerNorm blocks with causal self-attention written out (QK^T, causal mask buffer, softmax),
a GELU MLP, learned position embeddings and weight tying between the token embedding and the
output head (one parameter used in two places). AdamW with weight decay. Dropout is 0, as in
many small configurations, so that compiled peers need not reproduce eager's random stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "GPT-2-style, 2 layers, 2 heads, d=32, context 16, vocab 64, tied head, AdamW"
FEATURES = ("attention", "weight-tying", "adamw")
STEPS_PER_REP = 64
QUICK_STEPS_PER_REP = 16

VOCAB = 64
CONTEXT = 16


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int, context: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        mask = torch.tril(torch.ones(context, context)).view(1, 1, context, context)
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.size()
        q, k, v = self.qkv(x).split(d, dim=2)
        q = q.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, context: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, context)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, context: int = CONTEXT, d: int = 32,
                 n_layer: int = 2, n_head: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, n_head, context) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@dataclass
class State:
    net: GPT
    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]


def make_tokens(gen: torch.Generator, batch: int = 8) -> torch.Tensor:
    """Sequences from a noisy rule (next = 3 * tok + 1 mod VOCAB) so that the loss can fall."""
    seq = torch.empty(batch, CONTEXT + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
    for t in range(1, CONTEXT + 1):
        noise = torch.randint(0, VOCAB, (batch,), generator=gen)
        keep = torch.rand(batch, generator=gen) < 0.8
        seq[:, t] = torch.where(keep, (3 * seq[:, t - 1] + 1) % VOCAB, noise)
    return seq


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    batches = []
    for _ in range(4):
        seq = make_tokens(gen)
        batches.append((seq[:, :-1].to(rt.device), seq[:, 1:].to(rt.device)))
    net = GPT().to(rt.device)
    model = rt.wrap(net, (batches[0][0],))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
    return State(net, model, opt, batches)


def step(s: State, i: int) -> torch.Tensor:
    x, y = s.batches[i % len(s.batches)]
    logits = s.model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
    s.opt.zero_grad()
    loss.backward()
    s.opt.step()
    return loss.detach()


def digest(s: State) -> list[float]:
    return param_digest([s.net])
