"""An analytic ``Workload`` for GPT / Llama / Mixtral-shaped transformers, from their dimensions alone.

A test oracle: priced by the closed-form ``costmodel.closed_form.ClosedFormCoster``, used by tests and as a
cross-check of the tracer and of the graph coster. Counts per sequence of ``seq`` tokens (micro-batch 1),
unsharded, dense attention (SC21 Eq. 2-3):

- transformer layer parameters: q/k/v/o ``h (h + 2 h_kv) + h^2`` (``h_kv = h * kv_heads / heads``), MLP
  ``2 h f`` (GeLU) or ``3 h f`` (SwiGLU), times ``experts`` for MoE plus the router ``h * experts``; biases
  (GPT: ``3h + h + f + h``) and norms (2 x LayerNorm ``2h`` with bias, 2 x RMSNorm ``h``).
  A GPT layer with ``f = 4h`` has ``12 h^2 + 13 h`` (SC21 Eq. 2).
- forward FLOPs: ``2 s`` x the matmul parameters a token passes (``top_k`` experts), plus attention
  ``4 s^2 h_head_total`` (QK^T and AV, dense count); backward twice the forward.
- embedding ``V h`` (+ ``s h`` learned positions for GPT); the LM head ``2 s h V`` forward, ``V h`` params
  unless tied. So the step's model FLOPs are ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` for GPT (SC21 Eq. 3).
"""

from __future__ import annotations

from costmodel.closed_form import ClosedFormCoster, TransformerDims
from costmodel.errors import ConfigError
from costmodel.workload import LayerWork, Workload


def transformer_workload(
    *,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq: int,
    ffn_hidden: int | None = None,
    kv_heads: int | None = None,
    glu: bool = False,
    bias: bool = True,
    learned_positions: bool = True,
    tied_embeddings: bool = True,
    experts: int = 0,
    topk: int = 0,
    name: str = "analytic",
) -> Workload:
    """Embedding, ``layers`` identical transformer layers and the LM head (see the module docstring)."""
    for key, val in (("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab), ("seq", seq)):
        if not isinstance(val, int) or val < 1:
            raise ConfigError(f"{key}={val!r} must be a positive integer")
    h, s = hidden, seq
    f = ffn_hidden or 4 * h
    kv = kv_heads or heads
    if hidden % heads or heads % kv:
        raise ConfigError(f"hidden={hidden} must be a multiple of heads={heads}, and heads of kv_heads={kv}")
    if experts and not 1 <= topk <= experts:
        raise ConfigError(f"topk={topk} must be in 1..experts={experts} for a MoE model")
    h_kv = h * kv // heads
    attn_w = h * (h + 2 * h_kv) + h * h
    mlp_w = (3 if glu else 2) * h * f
    attn_b = (h + 2 * h_kv + h) if bias else 0
    mlp_b = (f + h) if bias else 0
    norms = 4 * h if bias else 2 * h
    n_exp = max(experts, 1)
    router = h * experts if experts else 0
    expert_params = experts * (mlp_w + mlp_b) if experts else 0
    layer_params = attn_w + attn_b + n_exp * (mlp_w + mlp_b) + router + norms
    active_mlp = mlp_w * (topk if experts else 1)
    attn_core = 4.0 * s * s * h  # QK^T + AV over all heads, dense
    fwd = 2.0 * s * (attn_w + active_mlp + router) + attn_core
    # bytes the forward reads + writes, bf16: weights once, activations per Korthikanti's 34 s h (x2 r/w)
    act_bytes = 2.0 * 34.0 * s * h
    tr = tuple(
        LayerWork(
            name=f"layers.{i}", kind="transformer", params=layer_params, flops_fwd=fwd, flops_bwd=2.0 * fwd,
            attn_flops_fwd=attn_core, expert_params=expert_params, bytes_fwd=2.0 * layer_params + act_bytes,
        )
        for i in range(layers)
    )
    emb_params = vocab * h + (s * h if learned_positions else 0)
    emb = LayerWork(name="embedding", kind="embedding", params=emb_params, flops_fwd=0.0, flops_bwd=0.0,
                    bytes_fwd=2.0 * 2 * s * h)
    head_params = (0 if tied_embeddings else vocab * h) + norms // 2
    head_fwd = 2.0 * s * h * vocab
    head = LayerWork(name="head", kind="head", params=head_params, flops_fwd=head_fwd, flops_bwd=2.0 * head_fwd,
                     bytes_fwd=2.0 * (vocab * h + s * vocab))
    coster = ClosedFormCoster(TransformerDims(hidden=h, heads=heads, kv_heads=kv, ffn_hidden=f, vocab=vocab, seq=s,
                                              experts=experts, topk=topk, glu=glu))
    return Workload(
        name=name, layers=(emb, *tr, head), hidden=h, heads=heads, kv_heads=kv, ffn_hidden=f, vocab=vocab, seq=s,
        num_layers=layers, experts=experts, topk=topk, glu=glu, tied_embeddings=tied_embeddings, coster=coster,
        meta={"source": "costmodel.analytic"},
    )


def closed_form_priced(workload: Workload) -> Workload:
    """``workload`` priced by the closed-form oracle from its own dimensions (for hand-built test workloads)."""
    import dataclasses

    w = workload
    dims = TransformerDims(hidden=w.hidden, heads=w.heads, kv_heads=w.kv_heads, ffn_hidden=w.ffn_hidden,
                           vocab=w.vocab, seq=w.seq, experts=w.experts, topk=w.topk, glu=w.glu,
                           dtype_bytes=w.dtype_bytes)
    return dataclasses.replace(w, coster=ClosedFormCoster(dims))


def gpt_workload(*, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
                 ffn_hidden: int | None = None, name: str = "gpt") -> Workload:
    """Megatron GPT (SC21): 4h GeLU MLP, biases, LayerNorm, learned positions, tied embeddings."""
    return transformer_workload(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq,
                                ffn_hidden=ffn_hidden, name=name)


def llama_workload(*, layers: int, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, vocab: int, seq: int,
                   experts: int = 0, topk: int = 0, name: str = "llama") -> Workload:
    """Llama / Mixtral: SwiGLU, GQA, RMSNorm, rotary positions, no biases, untied head."""
    return transformer_workload(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq,
                                ffn_hidden=ffn_hidden, kv_heads=kv_heads, glu=True, bias=False,
                                learned_positions=False, tied_embeddings=False, experts=experts, topk=topk,
                                name=name)


def sc21_model_flops(*, batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool) -> float:
    """SC21 Eq. 3: ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``, or the 96 form with full recomputation."""
    b, s, l, h, v = batch, seq, layers, hidden, vocab
    if recompute:
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
