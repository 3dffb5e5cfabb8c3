"""A small ResNet-like CNN (He et al. 2016, basic blocks): a conv / batchnorm / relu stem, identical residual
blocks ``relu(x + bn2(conv2(relu(bn1(conv1(x))))))`` in an ``nn.ModuleList``, global average pooling, a linear
classifier."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))  # (B, C, H, W)


class ResNet(nn.Module):
    def __init__(self, *, channels: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.ModuleList(BasicBlock(channels) for _ in range(blocks))
        self.fc = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(images)))
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))  # (B, classes)


def cnn(*, batch: int = 1, image: int = 32, channels: int = 32, blocks: int = 4,
        classes: int = 10) -> tuple[nn.Module, tuple]:
    return ResNet(channels=channels, blocks=blocks, classes=classes), (torch.zeros(batch, 3, image, image),)


def small(*, batch: int = 1) -> tuple[nn.Module, tuple]:
    """32x32 images, 32 channels, 4 basic blocks, 10 classes."""
    return cnn(batch=batch)
