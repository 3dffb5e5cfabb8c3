"""A Vision Transformer (Dosovitskiy et al. 2021): Conv2d patch embedding, a class token, learned positions,
``nn.TransformerEncoder`` of pre-norm ``nn.TransformerEncoderLayer`` s (GeLU MLP), LayerNorm and a linear head
on the class token. Attention is ``nn.MultiheadAttention`` (a packed ``in_proj_weight``)."""

from __future__ import annotations

import torch
import torch.nn as nn


class ViT(nn.Module):
    def __init__(self, *, image: int, patch: int, layers: int, hidden: int, heads: int, mlp: int,
                 classes: int, channels: int = 3) -> None:
        super().__init__()
        tokens = (image // patch) ** 2 + 1  # patches + class token
        self.patch = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos = nn.Parameter(torch.zeros(1, tokens, hidden))
        layer = nn.TransformerEncoderLayer(hidden, heads, mlp, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)  # (B, patches, H)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos  # (B, tokens, H)
        x = self.encoder(x)
        return self.head(self.norm(x[:, 0]))  # (B, classes)


def vit(*, batch: int = 1, image: int = 32, patch: int = 8, layers: int = 4, hidden: int = 64, heads: int = 4,
        mlp: int = 256, classes: int = 10) -> tuple[nn.Module, tuple]:
    model = ViT(image=image, patch=patch, layers=layers, hidden=hidden, heads=heads, mlp=mlp, classes=classes)
    return model, (torch.zeros(batch, 3, image, image),)


def tiny(*, batch: int = 1) -> tuple[nn.Module, tuple]:
    """32x32 images in 8x8 patches (17 tokens), 4 layers, hidden 64, 4 heads, mlp 256."""
    return vit(batch=batch)


def vit_l16(*, batch: int = 1) -> tuple[nn.Module, tuple]:
    """ViT-L/16: 224x224 images, 16x16 patches (197 tokens), 24 layers, hidden 1024, 16 heads, mlp 4096, 1000
    classes: 304,326,632 parameters (as timm's ``vit_large_patch16_224``)."""
    return vit(batch=batch, image=224, patch=16, layers=24, hidden=1024, heads=16, mlp=4096, classes=1000)
