"""Training steps shared by the capture tests: an MLP with cross-entropy and Adam, and a small
CNN with BatchNorm, dropout and SGD with momentum."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.head(self.drop(x.flatten(1)))


def make_mlp(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def make_cnn(seed: int = 0):
    torch.manual_seed(seed)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def batch(kind: str, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        return torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss
