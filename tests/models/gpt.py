"""A GPT written with ``nn.Embedding``, ``nn.Linear`` q/k/v/o, ``F.scaled_dot_product_attention(is_causal=True)``,
a GeLU MLP and pre-LayerNorm blocks in an ``nn.ModuleList``; the head is tied to the token embedding or not.

Variants for the planner's rules: ``manual`` computes attention with its own matmul + softmax (the graph has no
sdpa op, so heads are not visible), ``fused`` projects q/k/v with one nanoGPT-style ``c_attn`` linear and splits.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, *, impl: str = "sdpa") -> None:
        super().__init__()
        self.head_dim, self.impl = hidden // heads, impl
        if impl == "fused":
            self.c_attn = nn.Linear(hidden, 3 * hidden)
        else:
            self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape  # (B, S, H)
        if self.impl == "fused":
            q, k, v = self.c_attn(x).split(h, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        # -1, not a head count: under tensor parallelism q / k / v hold this rank's heads only
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, nh, S, hd)
        if self.impl == "manual":
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, *, impl: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, impl=impl)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, *, layers: int, hidden: int, heads: int, vocab: int, max_seq: int, ffn: int | None = None,
                 tied: bool = True, impl: str = "sdpa") -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn or 4 * hidden, impl=impl) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)  # (B, S, H)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, S, V)


def gpt(*, batch: int = 1, seq: int = 128, layers: int = 4, hidden: int = 256, heads: int = 8, vocab: int = 1000,
        ffn: int | None = None, tied: bool = True, impl: str = "sdpa") -> tuple[nn.Module, tuple]:
    model = GPT(layers=layers, hidden=hidden, heads=heads, vocab=vocab, max_seq=seq, ffn=ffn, tied=tied, impl=impl)
    return model, (torch.zeros(batch, seq, dtype=torch.long),)


def small(*, batch: int = 1, seq: int = 128, layers: int = 4, heads: int = 8) -> tuple[nn.Module, tuple]:
    """4 layers, hidden 256, 8 heads, vocab 1000, tied head."""
    return gpt(batch=batch, seq=seq, layers=layers, heads=heads)


def untied(*, batch: int = 1, seq: int = 64) -> tuple[nn.Module, tuple]:
    return gpt(batch=batch, seq=seq, layers=3, hidden=128, heads=4, vocab=500, tied=False)


def manual(*, batch: int = 1, seq: int = 64) -> tuple[nn.Module, tuple]:
    """Attention by hand (matmul + softmax): the graph shows no head count."""
    return gpt(batch=batch, seq=seq, layers=3, hidden=128, heads=4, vocab=500, impl="manual")


def fused(*, batch: int = 1, seq: int = 64) -> tuple[nn.Module, tuple]:
    """nanoGPT's fused ``c_attn`` (one (H, 3H) linear) followed by a split."""
    return gpt(batch=batch, seq=seq, layers=3, hidden=128, heads=4, vocab=500, impl="fused")
