"""A tiny HuggingFace transformers GPT-2 (GPT2LMHeadModel), trained the way its users train it.

The model comes from `transformers.GPT2Config` with random weights (built from the config, so
nothing is downloaded): 2 layers, 2 heads, n_embd 64, vocabulary 256, 64 positions. The step is
the usual `model(input_ids, labels=labels).loss`, backward, AdamW: the library's own Python
(config lookups, attention-implementation dispatch, the output dataclass, the shifted loss) runs
every step, which is what separates it from the hand-written `gpt` program.

transformers is optional (the `test` extra in pyproject.toml): without it the program is skipped
with `UNAVAILABLE` as the reason (the harness reads it before building), and the rest of the
suite runs as before. Dropout is 0, as in `gpt`, so that compiled peers need not reproduce
eager's random stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

log = logging.getLogger(__name__)

try:
    import transformers
except ImportError:  # the suite must run without the optional package
    transformers = None

UNAVAILABLE: str | None = None if transformers is not None else (
    "transformers is not installed (pip install transformers, or pip install -e '.[test]')")

DESCRIPTION = ("HuggingFace transformers GPT2LMHeadModel from a config (random weights): 2 layers, "
               "2 heads, n_embd 64, vocab 256, context 32, labels= loss, AdamW")
FEATURES = ("transformers", "attention", "weight-tying", "adamw", "library-python")
STEPS_PER_REP = 32
QUICK_STEPS_PER_REP = 8

VOCAB = 256
POSITIONS = 64
CONTEXT = 32  # tokens per sequence (at most POSITIONS)
BATCH = 8


def make_config() -> Any:
    """The tiny GPT-2 configuration; dropout 0 and no KV cache (training only).

    bos/eos ids are given because GPT-2's default (token 50256) makes transformers warn with a
    256-token vocabulary.
    """
    return transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=POSITIONS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)


class LMWithLoss(nn.Module):
    """What the harness wraps: GPT2LMHeadModel called as `model(input_ids, labels=labels)`.

    The harness calls `rt.wrap(model, example_inputs)` with positional inputs (torch.jit.trace
    needs them), so the labels travel positionally here and the loss tensor is returned instead
    of the output dataclass; the library's forward, loss included, is unchanged.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels).loss


@dataclass
class State:
    net: LMWithLoss
    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[torch.Tensor]


def build(seed: int, rt: Runtime) -> State:
    if UNAVAILABLE is not None:  # the harness checks first; this guards direct callers
        raise RuntimeError(UNAVAILABLE)
    torch.manual_seed(seed)  # the random initial weights come from the global RNG
    gen = data_generator(seed)
    # Random token batches; GPT2LMHeadModel shifts the labels itself, so labels = input_ids.
    batches = [torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=gen).to(rt.device)
               for _ in range(4)]
    lm = transformers.GPT2LMHeadModel(make_config())
    lm.loss_type = "ForCausalLM"  # the loss it would pick anyway; unset, it warns at first use
    net = LMWithLoss(lm).to(rt.device)
    net.train()
    log.debug("hf_gpt2: transformers %s, attention %s", transformers.__version__,
              getattr(lm.config, "_attn_implementation", "?"))
    model = rt.wrap(net, (batches[0], batches[0]))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    return State(net, model, opt, batches)


def step(s: State, i: int) -> torch.Tensor:
    tokens = s.batches[i % len(s.batches)]
    loss = s.model(tokens, tokens)
    s.opt.zero_grad()
    loss.backward()
    s.opt.step()
    return loss.detach()


def digest(s: State) -> list[float]:
    return param_digest([s.net])
