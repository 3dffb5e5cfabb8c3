"""A residual MLP stack: an input projection, pre-LayerNorm blocks ``x + fc2(gelu(fc1(norm(x))))`` in an
``nn.ModuleList``, and a classifier. Inputs are feature vectors ``(B, in_features)``: no sequence."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResidualBlock(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))  # (B, width)


class MLPStack(nn.Module):
    def __init__(self, *, in_features: int, width: int, hidden: int, layers: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(ResidualBlock(width, hidden) for _ in range(layers))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def mlp(*, batch: int = 1, in_features: int = 64, width: int = 128, hidden: int = 512, layers: int = 4,
        classes: int = 10) -> tuple[nn.Module, tuple]:
    model = MLPStack(in_features=in_features, width=width, hidden=hidden, layers=layers, classes=classes)
    return model, (torch.zeros(batch, in_features),)


def tiny(*, batch: int = 1) -> tuple[nn.Module, tuple]:
    """4 blocks of width 128, hidden 512, 64 features in, 10 classes out: 537,482 parameters."""
    return mlp(batch=batch)


def mlp_8b(*, batch: int = 1) -> tuple[nn.Module, tuple]:
    """16 blocks of width 8192, hidden 32768 (8 * 8192^2 weights each), 1024 features in, 1000 classes out:
    8,607,441,896 parameters (34 GB in fp32, if it were ever materialised)."""
    return mlp(batch=batch, in_features=1024, width=8192, hidden=32768, layers=16, classes=1000)
