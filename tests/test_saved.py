"""planner.saved: the bytes autograd keeps for backward, counted on a fake replay of the exported graph, equal
what the eager model saves on real CPU tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planner.models import build_model
from planner.saved import saved_bytes_by_node
from planner.trace import export_model


def _eager_saved_bytes(model: nn.Module, *inputs) -> float:
    frozen = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        sid = t.untyped_storage()._cdata
        if sid not in frozen:
            seen.setdefault(sid, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return float(sum(seen.values()))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def test_mlp_saves_what_eager_saves():
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(8, 64)
    ep = torch.export.export(model, (x,), strict=False)
    saved = saved_bytes_by_node(ep)
    # up saves x (the graph input: charged to up, the op that saved it); gelu saves its input (up's output),
    # down its own input (gelu's output)
    assert sum(saved.values()) == pytest.approx(_eager_saved_bytes(model, x))
    per_op = [(str(n.target), saved.get(n.name, 0.0)) for n in ep.graph.nodes if n.op == "call_function"]
    assert per_op[:3] == [("aten.linear.default", (8 * 64 + 8 * 256) * 4), ("aten.gelu.default", 8 * 256 * 4),
                          ("aten.linear.default", 0.0)]


def test_llama_layers_save_what_eager_saves():
    """A 2-layer Llama with grouped-query attention in bf16 (RMSNorm's fp32 upcasts, rotary temporaries, SwiGLU
    intermediates, flash attention's q / k / v / out / log-sum-exp): the replay of the graph autopar exports
    counts exactly what eager autograd keeps on real CPU tensors (the export takes eager's unmasked causal GQA
    path, not torch.export's materialised mask and repeated K / V)."""
    spec = "llama:layers=2,hidden=128,ffn=352,heads=4,kv_heads=2,vocab=512,seq=64"
    meta = build_model(spec, batch=2)
    ep = export_model(meta.model.to(torch.bfloat16), tuple(meta.example_inputs))
    replayed = sum(saved_bytes_by_node(ep).values())
    real = build_model(spec, batch=2, device="cpu")
    ids = torch.randint(0, 512, (2, 64))
    eager = _eager_saved_bytes(real.model.to(torch.bfloat16), ids)
    assert replayed == eager


def test_untraceable_replay_returns_none(caplog):
    class _Bad(nn.Module):
        def forward(self, x):
            return x * 2

    ep = torch.export.export(_Bad(), (torch.randn(3),), strict=False)
    ep.graph_signature.input_specs.clear()  # a broken program: the replay cannot feed the graph
    assert saved_bytes_by_node(ep) is None
    assert "could not replay" in caplog.text
