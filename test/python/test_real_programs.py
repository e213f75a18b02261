"""Training loops written the way people write them (issue 16, item 7): each trains 60 or more
iterations eagerly and under terra_torch.wrap from the same seeds and must match bitwise, with at
least 80% of the iterations after warm-up co-executed and a bound on fallbacks. The tiny
HuggingFace models are built from configs (random weights, no downloads) and skipped where
transformers is not installed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import terra_torch
import terra_torch._optimizer

STEPS = 60
WARMUP = 6  # iterations a program may trace before it co-executes


@dataclass
class Run:
    log: list[Any]
    params: list[torch.Tensor]
    stats: Any = None
    reasons: list = field(default_factory=list)


def run(make: Callable[[], tuple[nn.Module, torch.optim.Optimizer]], step: Callable[..., None], terra: bool,
        steps: int) -> Run:
    torch.manual_seed(0)
    model, opt = make()
    if terra:
        model = terra_torch.wrap(model)
    torch.manual_seed(1)  # dropout and other draws: the same stream in both runs
    log: list[Any] = []
    for i in range(steps):
        step(model, opt, i, log)
    out = Run([], [])
    if terra:
        terra_torch.synchronize()
        out.stats = terra_torch.stats(model)
        out.reasons = [(f.iteration, f.reason, f.source_line) for f in model._terra_program.fallbacks]
        terra_torch.unwrap(model)
    out.log = [v.clone() if isinstance(v, torch.Tensor) else v for v in log]
    out.params = [p.detach().clone() for p in model.parameters()]
    return out


def optimize(opt: torch.optim.Optimizer, loss: torch.Tensor, log: list[Any]) -> None:
    """The usual end of a step: zero_grad, backward, step; the loss goes to the log."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    log.append(loss.detach())


def check(make, step, steps: int = STEPS, max_fallbacks: int = 3, min_share: float = 0.8) -> Run:
    eager = run(make, step, False, steps)
    terra = run(make, step, True, steps)
    assert len(terra.log) == len(eager.log)
    for a, b in zip(eager.log, terra.log):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (a, b)
    for a, b in zip(eager.params, terra.params):
        assert torch.equal(a, b)
    st = terra.stats
    assert st.iterations["coexec"] >= min_share * (steps - WARMUP), (st.iterations, terra.reasons)
    assert st.fallbacks <= max_fallbacks, terra.reasons
    return terra


# ---- own programs -------------------------------------------------------------------------------


class Attention(nn.Module):
    """A pre-norm transformer block with F.scaled_dot_product_attention and dropout."""

    def __init__(self, d: int = 16, heads: int = 2, causal: bool = True) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)
        self.ff = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, T, D)))
        return x + self.ff(x)


TOKENS = torch.randn(4, 2, 8, 16, generator=torch.Generator().manual_seed(2))  # 4 batches of (2, 8, 16)
PAD_MASK = torch.ones(2, 1, 8, 8, dtype=torch.bool)
PAD_MASK[1, :, :, 6:] = False  # the second sequence is padded after 6 tokens


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding-mask"])
@pytest.mark.parametrize("optimizer", ["adamw", "adam-fused"])
def test_transformer_block_with_sdpa_and_dropout(masked: bool, optimizer: str):
    def make():
        model = nn.ModuleList([Attention(causal=not masked), Attention(causal=not masked)])
        params = model.parameters()
        opt = (torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01) if optimizer == "adamw"
               else torch.optim.Adam(params, lr=1e-3, fused=True))
        return Stack(model), opt

    def step(model, opt, i, log):
        loss = model(TOKENS[i % 4], PAD_MASK if masked else None).pow(2).mean()
        optimize(opt, loss, log)

    r = check(make, step)
    assert r.stats.runner["backward_replayed"] >= STEPS - 2 * WARMUP, r.stats.runner


class Stack(nn.Module):
    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x, mask=None):
        for b in self.blocks:
            x = b(x, mask)
        return x


@pytest.mark.parametrize("replay", [False, True], ids=["per-op-steps", "replayed-steps"])
def test_adam_step_counters_are_read_without_waiting_for_the_graph(replay, monkeypatch):
    """Single-tensor Adam reads every parameter's step counter (.item()) each step: after the
    first read the Python side answers them itself (known values), bitwise. A replayed step
    (terra_torch/_optimizer/) reads them without an op, for its numbers."""
    monkeypatch.setattr(terra_torch._optimizer, "enabled", replay)

    def make():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(model, opt, i, log):
        x = TOKENS[i % 4, :, 0, :8]
        loss = model(x).pow(2).mean()
        optimize(opt, loss, log)

    r = check(make, step)
    runner = r.stats.runner
    # 4 parameters, one read each per step the body runs
    assert runner["known_reads"] + 4 * runner["calls_replayed"] >= 4 * (STEPS - 2 * WARMUP), runner
    assert (runner["calls_replayed"] >= STEPS - 2 * WARMUP) == replay, runner
    assert runner["python_reads"] <= 4 * 3, runner  # the first reads of each graph build wait


def test_validation_pass_and_greedy_generation_are_their_own_program():
    """Every 8 steps: a validation loss under eval()/no_grad and a greedy decode that grows the
    sequence one token a step. They run as the model's evaluation program, so the training
    program's TraceGraph is not disturbed by them."""
    vocab = 13

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, 16)
            self.block = Attention()
            self.head = nn.Linear(16, vocab)

        def forward(self, ids):
            return self.head(self.block(self.emb(ids)))

    data = torch.randint(0, vocab, (4, 2, 9), generator=torch.Generator().manual_seed(3))

    def make():
        model = LM()
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

    def step(model, opt, i, log):
        ids = data[i % 4]
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        optimize(opt, loss, log)
        if i % 8 == 7:
            model.eval()
            with torch.no_grad():
                log.append(F.cross_entropy(model(ids[:, :-1]).reshape(-1, vocab), ids[:, 1:].reshape(-1)))
                out = ids[:1, :3]
                for _ in range(4):
                    nxt = model(out)[:, -1].argmax(-1, keepdim=True)
                    out = torch.cat([out, nxt], 1)
                log.append(out)
            model.train()

    r = check(make, step, steps=64, max_fallbacks=4)
    assert r.stats.evaluation is not None and sum(r.stats.evaluation.iterations.values()) == 5 * (64 // 8)


def test_tied_weights_keep_co_executing_after_a_replayed_backward():
    """An embedding tied to the output layer (GPT-2, BART): the linear layer's backward makes
    t(t(weight)), a view equal to the weight, so from then on the weight is that op's output.
    The optimizer's loop then writes it in place; a replayed backward must leave the weight's
    latest output as the engine's run did (before: every replayed iteration fell back there).
    Every third step skips a layer, so the optimizer's loop over parameters with gradients has
    two trip counts and is a prim::Loop, where reads are checked against the latest output."""
    vocab = 11

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, 16)
            self.mid = nn.Linear(16, 16)
            self.head = nn.Linear(16, vocab, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids, skip_mid: bool):
            h = self.emb(ids)
            return self.head(h if skip_mid else torch.tanh(self.mid(h)))

    data = torch.randint(0, vocab, (4, 2, 6), generator=torch.Generator().manual_seed(10))

    def make():
        model = Tied()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(model, opt, i, log):
        ids = data[i % 4]
        optimize(opt, F.cross_entropy(model(ids, i % 3 == 0).reshape(-1, vocab), ids.reshape(-1)), log)

    r = check(make, step, max_fallbacks=2)
    assert r.stats.runner["backward_replayed"] >= STEPS - 2 * WARMUP, r.stats.runner
    assert not any(it >= 2 * WARMUP for it, _, _ in r.reasons), r.reasons


transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")


def test_tiny_gpt2_trains_bitwise_in_coexecution():
    def make():
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=32)
        model = transformers.GPT2LMHeadModel(config)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    batches = torch.randint(0, 97, (4, 2, 16), generator=torch.Generator().manual_seed(4))

    def step(model, opt, i, log):
        ids = batches[i % 4]
        loss = model(input_ids=ids, labels=ids).loss
        optimize(opt, loss, log)

    r = check(make, step)
    assert r.stats.runner["backward_replayed"] >= STEPS - 2 * WARMUP, r.stats.runner


@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_optimizer_implementations_co_execute_bitwise(kind: str, impl: str):
    """Single-tensor, foreach and fused Adam, AdamW and SGD (issue 16, item 6). Foreach optimizers
    pass per-parameter step sizes as float lists, which vary every step and are fed."""

    def make():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        flags = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
        if kind == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=1e-2, **flags)
        elif kind == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, **flags)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, **flags)
        return model, opt

    def step(model, opt, i, log):
        x = TOKENS[i % 4, :, 0, :8]
        loss = model(x).pow(2).mean()
        optimize(opt, loss, log)

    check(make, step)


def test_tiny_bert_with_three_sequence_lengths():
    """Sizes are not part of node identity: one graph covers every length, and the backward is
    replayed per length."""

    def make():
        config = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                         intermediate_size=64, vocab_size=97, max_position_embeddings=32,
                                         num_labels=3)
        model = transformers.BertForSequenceClassification(config)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(6)
    batches = [(torch.randint(0, 97, (2, L), generator=g), torch.randint(0, 3, (2,), generator=g)) for L in (8, 12, 16)]

    def step(model, opt, i, log):
        ids, labels = batches[i % 3]
        loss = model(input_ids=ids, labels=labels).loss
        optimize(opt, loss, log)

    r = check(make, step)
    assert r.stats.runner["backward_replayed"] >= STEPS - 3 * WARMUP, r.stats.runner


@pytest.mark.parametrize("replay", [False, True], ids=["per-op-steps", "replayed-steps"])
def test_foreach_adam_step_counters_are_followed_through_the_foreach_op(replay, monkeypatch):
    """Foreach Adam increments every step counter with one _foreach_add_(steps, tensor(1.0)) (CPU
    path of torch/optim/adam.py) and reads each of them twice per step: the list op is followed
    on the copies, so after the first reads none waits. (The foreach kernel's version bumps
    happen inside it, which co-execution never runs: a copy's version is settled at the next op.)
    A replayed step (terra_torch/_optimizer/) reads the counters without an op for its
    numbers and teaches Python their new values: the program's own reads do not wait either."""
    monkeypatch.setattr(terra_torch._optimizer, "enabled", replay)

    def make():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)

    def step(model, opt, i, log):
        loss = model(TOKENS[i % 4, :, 0, :8]).pow(2).mean()
        optimize(opt, loss, log)
        if i % 7 == 0:
            log.append([s["step"].item() for s in opt.state.values()])

    r = check(make, step)
    runner = r.stats.runner
    assert runner["python_reads"] <= 4 * 3, runner  # 4 parameters: only the first reads of a graph wait
    if replay:
        assert runner["calls_replayed"] >= STEPS - 2 * WARMUP, runner
        assert runner["known_reads"] >= 4 * (STEPS // 7 - 2), runner  # (the program's own reads)
    else:
        assert runner["known_reads"] >= 2 * 4 * (STEPS - 2 * WARMUP), runner


class LayerDrop(nn.Module):
    """Residual layers skipped at random while training (LayerDrop, as in BART's encoder), or by
    a given mask. Each layer is an nn.Sequential, a loop of its own inside the loop over layers:
    both are unrolled, and which copy of a layer's ops ran decides what later ops read."""

    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(n)])
        self.out = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if keep is None and torch.rand([]) < 0.5:
                continue
            if keep is not None and keep[i] < 0.5:
                continue
            x = x + layer(x)
        return self.out(x)


LD_X = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
LD_Y = torch.randint(0, 2, (4,), generator=torch.Generator().manual_seed(8))


def layerdrop_make():
    model = LayerDrop()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_layerdrop_random_layer_skipping():
    """`if torch.rand([]) < p: continue` per layer: 8 ways through the layers, drawn at random.
    The graph reads `x` as whichever layer's output ran last, so paths whose combination of
    skipped layers no traced iteration had co-execute too (before: the graph read a value its
    path never assigned and the iteration failed)."""

    def step(model, opt, i, log):
        optimize(opt, F.cross_entropy(model(LD_X), LD_Y), log)

    check(make=layerdrop_make, step=step, steps=80, max_fallbacks=8, min_share=0.75)


def test_layerdrop_unseen_combination_of_layer_copies_co_executes():
    """After the traces ran layers {1}, {1, 3}, {2, 3} and {1, 2}, the combination {2} runs only
    copies of layer ops some trace ran, in a combination none had: it co-executes, bitwise (the
    graph reads `x` as whichever layer's output ran last). Other new combinations may fall back
    once where their backward takes a new order."""
    seen = ["Lss", "LsL", "sLL"] * 4
    patterns = seen + ["LLs"] * 3 + ["sLs"] * 3 + ["LLL"] * 3 + ["sss"] * 3 + seen
    masks = [torch.tensor([1.0 if c == "L" else 0.0 for c in p]) for p in patterns]

    def step(model, opt, i, log):
        optimize(opt, F.cross_entropy(model(LD_X, masks[i]), LD_Y), log)

    r = check(make=layerdrop_make, step=step, steps=len(patterns), max_fallbacks=6, min_share=0.6)
    assert not any(15 <= it < 18 for it, _, _ in r.reasons), r.reasons


class FirstKept(nn.Module):
    """Reads the output of the first layer that ran, whichever that was: not "the latest layer
    output", so the graph's variable there holds particular copies of the layer's op."""

    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])
        self.out = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, layer in enumerate(self.layers):
            if keep[i] < 0.5:
                continue
            x = torch.tanh(layer(x))
            outs.append(x)
        return self.out(x) + outs[0].mean()


def test_read_of_a_layer_copy_the_graph_does_not_hold_falls_back():
    """Traces {1, 2} and {3}: the read of outs[0] sees copy 1 (copy 2 ran later) and copy 3, and
    in both the one it read is the latest-run of those two. {1, 3} passes the node-level checks,
    but there copy 3 runs after copy 1: the graph would read copy 3. The PythonRunner checks the
    copy Python read (EmittedGraph::checked_reads) and falls back there, so the numbers stay
    eager's (before: wrong numbers without a word)."""
    patterns = ["LLs", "ssL"] * 4 + ["LsL"] * 3 + ["LLs", "ssL"] * 3
    masks = [torch.tensor([1.0 if c == "L" else 0.0 for c in p]) for p in patterns]

    def make():
        model = FirstKept()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, i, log):
        optimize(opt, F.cross_entropy(model(LD_X, masks[i]), LD_Y), log)

    r = check(make=make, step=step, steps=len(patterns), max_fallbacks=4, min_share=0.6)
    assert any(it == 8 and "reads another value than the one the graph reads there" in why
               for it, why, _ in r.reasons), r.reasons


def test_tiny_bart_with_layerdrop():
    """BART's encoder and decoder skip each layer with probability `layerdrop` while training
    (`if torch.rand([]) < self.layerdrop: continue`). This program used to hang in backward() at
    its fourth iteration; then it failed with "Expected Tensor but got Uninitialized"; under
    load it read AdamW's step counters one step ahead (a fresh tensor's memory was copied after
    the graph could write it). It must train bitwise."""

    def make():
        config = transformers.BartConfig(encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                         decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64,
                                         decoder_ffn_dim=64, vocab_size=97, max_position_embeddings=32,
                                         encoder_layerdrop=0.5, decoder_layerdrop=0.5)
        model = transformers.BartForConditionalGeneration(config)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    batches = torch.randint(0, 97, (4, 2, 12), generator=torch.Generator().manual_seed(9))

    def step(model, opt, i, log):
        ids = batches[i % 4]
        optimize(opt, model(input_ids=ids, labels=ids).loss, log)

    check(make, step, max_fallbacks=12, min_share=0.7)
