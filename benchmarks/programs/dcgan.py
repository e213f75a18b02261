"""DCGAN: two networks, two optimizers, the discriminator called on real and on fake images.

The discriminator runs three times per step (real, detached fake, fake for the generator loss)
from two call sites, and the generator's noise is a fresh torch.randn draw every step: an RNG
draw in the loop that every runner must reproduce. Noise is drawn on the CPU from the global RNG
(seeded in build) and moved to the device, so all runners see the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.runtime import Runtime
from benchmarks.programs._common import data_generator, param_digest

DESCRIPTION = "DCGAN 16x16: ConvT generator, conv discriminator (BatchNorm), 2 x Adam"
FEATURES = ("two-models", "two-optimizers", "shared-module-call-sites", "rng-in-loop")
STEPS_PER_REP = 48
QUICK_STEPS_PER_REP = 12
# The discriminator runs three times per step: with terra_torch.wrap each call would start an
# iteration, so terra's runners make the whole step the iteration (terra_torch.function).
TERRA_ITERATION = "step"

NZ = 16
BATCH = 8


class Generator(nn.Module):
    def __init__(self, nz: int = NZ, ngf: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),  # 4x4
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),  # 8x8
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, 1, 4, 2, 1, bias=False),  # 16x16
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self, ndf: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, ndf, 4, 2, 1, bias=False),  # 8x8
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),  # 4x4
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),  # 1x1
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).view(-1)


@dataclass
class State:
    gnet: Generator
    dnet: Discriminator
    G: nn.Module
    D: nn.Module
    opt_g: torch.optim.Optimizer
    opt_d: torch.optim.Optimizer
    real_batches: list[torch.Tensor]
    ones: torch.Tensor
    zeros: torch.Tensor
    device: str


def make_images(gen: torch.Generator) -> torch.Tensor:
    """Blurry blobs in [-1, 1]: a Gaussian bump at a random position per image."""
    coords = torch.linspace(-1, 1, 16)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    centre = torch.rand(BATCH, 2, 1, 1, generator=gen) * 1.2 - 0.6
    dist2 = (xx - centre[:, 0]) ** 2 + (yy - centre[:, 1]) ** 2
    return (2 * torch.exp(-dist2 / 0.1) - 1).unsqueeze(1)


def build(seed: int, rt: Runtime) -> State:
    torch.manual_seed(seed)
    gen = data_generator(seed)
    real = [make_images(gen).to(rt.device) for _ in range(4)]
    gnet = Generator().to(rt.device)
    dnet = Discriminator().to(rt.device)
    z0 = torch.randn(BATCH, NZ, 1, 1, generator=gen).to(rt.device)
    G = rt.wrap(gnet, (z0,))
    D = rt.wrap(dnet, (real[0],))
    opt_g = torch.optim.Adam(gnet.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(dnet.parameters(), lr=2e-3, betas=(0.5, 0.999))
    ones = torch.ones(BATCH, device=rt.device)
    zeros = torch.zeros(BATCH, device=rt.device)
    return State(gnet, dnet, G, D, opt_g, opt_d, real, ones, zeros, rt.device)


def step(s: State, i: int) -> torch.Tensor:
    real = s.real_batches[i % len(s.real_batches)]
    z = torch.randn(BATCH, NZ, 1, 1).to(s.device)
    fake = s.G(z)

    s.opt_d.zero_grad()
    loss_d = (F.binary_cross_entropy_with_logits(s.D(real), s.ones)
              + F.binary_cross_entropy_with_logits(s.D(fake.detach()), s.zeros))
    loss_d.backward()
    s.opt_d.step()

    s.opt_g.zero_grad()
    loss_g = F.binary_cross_entropy_with_logits(s.D(fake), s.ones)
    loss_g.backward()
    s.opt_g.step()
    return (loss_d + loss_g).detach()


def digest(s: State) -> list[float]:
    return param_digest([s.gnet, s.dnet])
