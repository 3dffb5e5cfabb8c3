"""Attention with per-head sinks (GPT-OSS) through ``scaled_dot_product_attention``, for tracing and running.

Hugging Face's ``GptOssForCausalLM`` supports no ``sdpa`` implementation (its softmax takes one learned logit
per head, the sink, beside the scores, and half its layers see a sliding window of keys), so autopar's tracer
(which reads attention off ``scaled_dot_product_attention`` calls) could not build it. ``register()`` adds the
attention implementation ``SINK_SDPA`` to ``transformers.AttentionInterface``; it computes exactly what the
model's own ``eager_attention_forward`` computes, ``softmax([q k^T * scale + mask, sink])[:, :-1] v``, as one
sdpa call with one more key whose logit is the head's sink and whose value is zero: the queries get one more
feature (1), the keys a 0 there, the sink key ``sink / scale`` there and zeros elsewhere (one head_dim + 1
column, no score-sized mask), the values a zero column too (one head dim for q, k and v: the fused kernel) that
the output drops:

- full-attention layers: ``is_causal`` sdpa over a leading dummy query row (dropped) and the sink key first;
- sliding-window layers (``sliding_window=w``): the queries in blocks of ``w``, each block against the sink, its
  own and the previous block's keys (``2 w + 1`` keys, a boolean band mask broadcast over heads), as the batch
  of one sdpa call: a windowed kernel computes ``w`` keys a query, not the causal triangle (this form counts
  about ``1.5 w`` after the causal fraction the tracer applies to a masked sdpa).

The masks are built from the shapes: the inputs are whole unpadded sequences (what training and the tracer
pass); a padding mask from the caller is not applied. No transformers mask function is registered for the
name, so the model skips building its own masks (``masking_utils``: custom attention without a mask function).
"""

from __future__ import annotations

from typing import Any

SINK_SDPA = "autopar_sink_attention"  # no "sdpa" in it: transformers would check the model's sdpa support
MODEL_TYPES = ("gpt_oss",)
"""Model types whose attention is exactly softmax attention with per-head sinks over full or windowed keys."""


def _augment(q: Any, k: Any, v: Any, sinks: Any, scale: float) -> tuple[Any, Any, Any]:
    """One more feature and one more key: ``q' = [q, 1]``, real keys ``[k, 0]``, the sink key ``[0, sink /
    scale]`` with a zero value, so the sink key's logit is each head's sink (keys taken per query head)."""
    import torch

    b, h = q.shape[0], q.shape[1]
    if k.shape[1] != h:  # grouped-query attention: the sink key differs per query head
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    one = q.new_ones(*q.shape[:3], 1)
    q = torch.cat([q, one], dim=-1)
    k = torch.cat([k, k.new_zeros(*k.shape[:3], 1)], dim=-1)
    sink_key = torch.cat([k.new_zeros(b, h, 1, k.shape[3] - 1),
                          (sinks.to(k.dtype) / scale).reshape(1, h, 1, 1).expand(b, h, 1, 1)], dim=-1)
    v = torch.cat([v.new_zeros(b, h, 1, v.shape[3]), v], dim=2)
    # v zero-padded to the head_dim + 1 of q / k: the fused sdpa kernels take one head dim (a narrower v takes
    # the math path, which saves the scores); the tracer prices the FLOPs of the unpadded v (planner.mla_attention)
    return q, torch.cat([sink_key, k], dim=2), torch.nn.functional.pad(v, (0, 1))


def sink_sdpa_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                      dropout: float = 0.0, sliding_window: int | None = None, s_aux: Any = None,
                      **kwargs: Any) -> tuple[Any, None]:
    """``transformers`` attention-interface function: (b, h, s, d) query, (b, kv_heads, s, d) key / value ->
    ((b, s, h, d) output, None)."""
    import torch
    import torch.nn.functional as F

    b, h, s, d = query.shape
    kvh = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    sinks = s_aux if s_aux is not None else query.new_full((h,), float("-inf"))
    p = dropout if getattr(module, "training", False) else 0.0
    if sliding_window is not None and sliding_window < s and s % sliding_window == 0:
        w, n = sliding_window, s // sliding_window
        qb = query.reshape(b, h, n, w, d).transpose(1, 2).reshape(b * n, h, w, d)
        prev = lambda t: torch.cat([torch.zeros_like(t[:, :, :1]), t[:, :, :-1]], dim=2)  # noqa: E731
        kb, vb = (torch.cat([prev(t), t], dim=3).transpose(1, 2).reshape(b * n, kvh, 2 * w, d)
                  for t in (key.reshape(b, kvh, n, w, d), value.reshape(b, kvh, n, w, d)))
        qb, kb, vb = _augment(qb, kb, vb, sinks, scale)
        # query t of block m (position m w + t) sees the sink and the previous block's key j (position
        # (m - 1) w + j) when t < j, its own block's keys j <= t; the first block has no previous block
        t = torch.arange(w, device=query.device)[:, None]
        j = torch.arange(2 * w, device=query.device)[None, :]
        band = ((j >= w) & (j - w <= t)) | ((j < w) & (j > t))
        keep = torch.cat([band.new_ones(w, 1), band], dim=1)[None].expand(n, w, 2 * w + 1).clone()
        keep[0, :, 1:w + 1] = False
        keep = keep[None].expand(b, n, w, 2 * w + 1).reshape(b * n, 1, w, 2 * w + 1)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=keep, scale=scale, dropout_p=p)
        out = out[..., :d].reshape(b, n, h, w, d).transpose(1, 2).reshape(b, h, s, d)
    else:
        # a leading dummy query row: under sdpa's top-left causal mask query i (row i + 1) then sees the sink
        # key and keys 0..i
        qa, ka, va = _augment(torch.cat([query.new_zeros(b, h, 1, d), query], dim=2), key, value, sinks, scale)
        out = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale, dropout_p=p)
        out = out[:, :, 1:, :d]
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Add ``SINK_SDPA`` to transformers' attention functions (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(SINK_SDPA, sink_sdpa_forward)
    return SINK_SDPA
