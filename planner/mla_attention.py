"""Attention whose values are narrower than its queries and keys (multi-head latent attention, DeepSeek-V2 / V3:
q / k head dim ``qk_nope_head_dim + qk_rope_head_dim`` = 192, v head dim 128), through one fused sdpa call.

PyTorch's fused sdpa kernels take one head dim for q, k and v: with a narrower v, ``scaled_dot_product_attention``
falls back to the math path, which materialises the (B, H, S, S) scores and probabilities and saves them for
backward. That is not what training on a GPU keeps: FlashAttention-3 takes 192 / 128 directly, and transformers'
flash-attention path for DeepSeek (versions up to 4.x, ``DeepseekV3Attention``) pads v with zeros to the q / k
head dim and slices the output back. ``register()`` adds the attention implementation ``PADDED_V_SDPA`` that does
exactly that around transformers' own ``sdpa_attention_forward`` (same causal / mask / GQA handling): zero
columns in v give zero columns in ``softmax(q k^T) v``, so the sliced output is the unpadded attention exactly,
and the traced graph holds one fused attention op that saves q, k, v, the output and the log-sum-exp.

FLOPs: the tracer (``planner.trace``) prices an attention whose v is a zero-padded tensor with the v before the
padding (``2 b h s_q s_k (d_qk + d_v)`` forward), as FlashAttention-3 computes; the padded columns are not work.
Bytes read and saved stay those of the padded tensors (what the padded kernel reads and keeps; FA3 without
padding keeps ``d_v / d_qk`` of the v and output part).

``needs_padded_v(config)`` says which configs use it: those naming a ``v_head_dim`` narrower than their q / k
head dim. ``planner.models`` selects it as it selects ``planner.sink_attention`` for GPT-OSS.
"""

from __future__ import annotations

from typing import Any

PADDED_V_SDPA = "autopar_padded_v_attention"  # no "sdpa" in it: transformers would check the model's sdpa support


def qk_v_head_dims(config: Any) -> tuple[int, int] | None:
    """(q / k head dim, v head dim) of a transformers config naming ``v_head_dim``; None when it names none."""
    dv = getattr(config, "v_head_dim", None)
    if not dv:
        return None
    dqk = getattr(config, "qk_head_dim", None)
    if not dqk and getattr(config, "qk_nope_head_dim", None) is not None:
        dqk = int(config.qk_nope_head_dim) + int(getattr(config, "qk_rope_head_dim", 0) or 0)
    if not dqk:
        dqk = getattr(config, "head_dim", None)
    return (int(dqk), int(dv)) if dqk else None


def needs_padded_v(config: Any) -> bool:
    """True when the config's v head dim is narrower than its q / k head dim (the fused sdpa kernels refuse it)."""
    dims = qk_v_head_dims(config)
    return dims is not None and dims[1] < dims[0]


def padded_v_sdpa_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                          **kwargs: Any) -> tuple[Any, Any]:
    """``transformers`` attention-interface function: (b, h, s, d_qk) query / key, (b, kv_heads, s, d_v) value ->
    ((b, s, h, d_v) output, None): transformers' sdpa attention with v zero-padded to ``d_qk``, output sliced."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dv, dqk = value.shape[-1], query.shape[-1]
    if dv < dqk:
        value = F.pad(value, (0, dqk - dv))
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return (out[..., :dv] if dv < dqk else out), weights


def register() -> str:
    """Add ``PADDED_V_SDPA`` to transformers' attention functions, with sdpa's mask function (idempotent);
    returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(PADDED_V_SDPA, padded_v_sdpa_forward)
    AttentionMaskInterface.register(PADDED_V_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return PADDED_V_SDPA
