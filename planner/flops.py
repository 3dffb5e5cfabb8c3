"""FLOP and byte rules per aten op: forward, backward, and the op class the cost model times it by.

What is counted as FLOPs: matrix multiplies and the attention core (2 FLOPs per multiply-add), the convention
of Megatron-LM SC21 Eq. 3 and of model-FLOPs utilisation. Norms, pointwise ops, reductions, gathers and
copies count 0 FLOPs: they are memory-bound and the cost model times them by ``bytes_read + bytes_written``.

Forward counts come from ``torch.utils.flop_counter`` (``mm_flop``, ``addmm_flop``, ``bmm_flop``,
``baddbmm_flop``, ``conv_flop``, ``sdpa_flop_count``) plus our own rules where it is silent:
``aten.linear`` (it is counted only after decomposition), ``aten.scaled_dot_product_attention`` and the CPU
kernel ``_scaled_dot_product_flash_attention_for_cpu`` (the registry knows only the CUDA kernels), and
``_grouped_mm`` (MoE: each token row meets exactly one expert, ``2 * tokens * k * n``).

Backward rules (not a blanket 2x):

- matmul-like ops: one matmul of the forward's size per matrix operand that requires grad (dX = dY W^T and
  dW = X^T dY). A projection of raw inputs costs 1x forward (weight gradient only), a matmul of two
  activations 2x, a weight-only product of non-trainable inputs 0.
- attention: ``torch.utils.flop_counter.sdpa_backward_flop_count``, 5 matmuls = 2.5x forward, because the
  flash / memory-efficient kernels that sdpa dispatches to recompute the score matrix QK^T in backward
  (Dao et al. 2022, FlashAttention, Sec. 3.1 and App. B.2). The recomputed 0.5x forward is reported apart
  (``flops_bwd_recompute``) so model FLOPs (Eq. 3, which assumes stored scores: 2x) stay available.
- embedding: no input gradient (token ids are integers) and no matmul: the weight gradient is a scatter-add of
  dY into the table, memory-bound, 0 FLOPs.
- everything with 0 forward FLOPs: 0.

Causal attention: ``causal_fraction`` is the fraction of the (Sq x Sk) score matrix a causal kernel computes,
``(Sq*Sk - Sq*(Sq-1)/2) / (Sq*Sk)`` for bottom-right aligned masks; ``flops * causal_fraction`` is the
causal count, ``flops`` the dense one (Eq. 3's ``s/(6h)`` term counts attention dense).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from torch.utils import flop_counter as fc

Shape = tuple[int, ...]

# grouped GEMMs: torch._grouped_mm / F.grouped_mm, and transformers' CPU fallback custom op
GROUPED_MM_OPS = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})
MATMUL_OPS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "_convolution",
                        "conv1d", "conv2d", *GROUPED_MM_OPS})
ATTENTION_OPS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
})
NORM_OPS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
                      "batch_norm", "native_batch_norm", "_native_batch_norm_legit_no_training"})
EMBEDDING_OPS = frozenset({"embedding", "embedding_bag", "_embedding_bag"})
VIEW_OPS = frozenset({
    "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "transpose", "t", "permute", "expand",
    "expand_as", "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "as_strided", "alias",
    "flatten", "unflatten", "detach", "getitem", "_assert_tensor_metadata", "view_as", "movedim", "narrow",
    "unfold", "lift_fresh_copy", "sym_size", "sym_numel", "_assert_scalar", "sym_constrain_range_for_size",
    "dim", "size", "contiguous",
})
ELEMENTWISE_OPS = frozenset({
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "silu", "gelu",
    "relu", "dropout", "native_dropout", "feature_dropout", "to", "_to_copy", "clone", "masked_fill", "where",
    "cos", "sin", "reciprocal", "abs", "clamp", "clamp_min", "clamp_max", "eq", "ne", "le", "lt", "ge", "gt",
    "__and__", "__or__", "__xor__", "__invert__", "bitwise_and", "bitwise_or", "bitwise_not", "logical_and",
    "logical_or", "logical_not", "type_as", "fill", "zeros_like", "ones_like", "full_like", "empty_like",
    "erf", "softplus", "copy", "copy_", "add_", "mul_", "div_", "sub_", "masked_fill_", "leaky_relu", "elu",
    "hardtanh", "square", "rsub", "float", "bfloat16", "half", "sign", "floor", "ceil", "round", "trunc",
    "remainder", "fmod", "floor_divide", "maximum", "minimum", "lerp", "addcmul", "addcdiv", "mish", "hardswish",
    "isinf", "isnan", "nan_to_num", "exp2", "log1p", "expm1", "relu6", "glu", "gelu_", "silu_", "type",
})
REDUCTION_OPS = frozenset({
    "mean", "sum", "softmax", "_softmax", "log_softmax", "_log_softmax", "amax", "amin", "max", "min",
    "cumsum", "cumprod", "topk", "sort", "argmax", "argmin", "var", "var_mean", "std", "norm",
    "linalg_vector_norm", "all", "any", "diff", "prod", "logsumexp", "cross_entropy_loss", "nll_loss",
    "nll_loss_forward", "nll_loss2d_forward", "histc", "bincount", "count_nonzero",
})
# Data movement with no arithmetic: covered (0 FLOPs, costed by bytes), class "other".
MOVEMENT_OPS = frozenset({
    "cat", "stack", "index", "gather", "scatter", "scatter_add", "index_select", "index_add", "index_put",
    "index_copy", "repeat_interleave", "repeat", "arange", "zeros", "ones", "full", "empty", "new_ones",
    "new_zeros", "new_full", "new_empty", "tril", "triu", "one_hot", "pad", "constant_pad_nd", "roll", "flip",
    "masked_scatter", "masked_select", "index_put_", "scatter_", "scatter_add_", "index_add_", "index_copy_", "nonzero", "scalar_tensor", "lift_fresh", "_local_scalar_dense",
    "item", "embedding_dense_backward", "tensor", "linspace", "randperm", "rand", "randn", "bernoulli",
    "empty_strided", "select_scatter", "slice_scatter", "diagonal", "tile", "unique", "searchsorted",
    "bucketize", "clone_", "fill_", "zero_", "set_", "resize_", "_unsafe_index", "take_along_dim",
})


@dataclass(frozen=True, kw_only=True, slots=True)
class OpCost:
    """The cost rule's answer for one op instance."""

    op_class: str
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    flops_bwd_recompute: float = 0.0
    """Part of ``flops_bwd`` that re-does forward work (flash-attention score recomputation)."""
    causal_fraction: float = 1.0
    covered: bool = True
    """False when no rule knows this op (it is listed in the coverage report)."""


def op_name(target: object) -> str:
    """``aten.linear.default`` -> ``linear``; ``<built-in function getitem>`` -> ``getitem``."""
    packet = getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)
    return str(packet).split(".")[0]


def op_class_of(name: str) -> str:
    for cls, table in (("matmul", MATMUL_OPS), ("attention", ATTENTION_OPS), ("norm", NORM_OPS),
                       ("embedding", EMBEDDING_OPS), ("view", VIEW_OPS), ("elementwise", ELEMENTWISE_OPS),
                       ("reduction", REDUCTION_OPS)):
        if name in table:
            return cls
    return "other"


def op_cost(name: str, *, in_shapes: Sequence[Shape | None], out_shapes: Sequence[Shape], grads: Sequence[bool],
            kwargs: dict, causal_mask: bool) -> OpCost:
    """Cost of aten op ``name`` with tensor inputs ``in_shapes`` (None for non-tensor args, in arg order) and
    ``grads[i]`` = input i requires grad."""
    cls = op_class_of(name)
    if cls == "matmul":
        return _matmul_cost(name, in_shapes, out_shapes, grads)
    if cls == "attention":
        return _attention_cost(name, in_shapes, grads, kwargs, causal_mask)
    return OpCost(op_class=cls, covered=cls != "other" or name in MOVEMENT_OPS)


def _shape(in_shapes: Sequence[Shape | None], i: int) -> Shape:
    s = in_shapes[i] if i < len(in_shapes) else None
    return tuple(s) if s is not None else ()


def _matmul_cost(name: str, ins: Sequence[Shape | None], outs: Sequence[Shape], grads: Sequence[bool]) -> OpCost:
    """Forward from torch.utils.flop_counter where it has a formula; backward = forward per grad operand."""
    g = lambda i: bool(grads[i]) if i < len(grads) else False  # noqa: E731
    out = tuple(outs[0]) if outs else ()
    if name == "linear":  # (..., k) @ (n, k)^T
        x, w = _shape(ins, 0), _shape(ins, 1)
        flops = 2 * math.prod(x[:-1]) * x[-1] * w[0]
        operands = (g(0), g(1))
    elif name == "mm":
        flops, operands = fc.mm_flop(_shape(ins, 0), _shape(ins, 1)), (g(0), g(1))
    elif name == "addmm":
        flops, operands = fc.addmm_flop(_shape(ins, 0), _shape(ins, 1), _shape(ins, 2)), (g(1), g(2))
    elif name == "bmm":
        flops, operands = fc.bmm_flop(_shape(ins, 0), _shape(ins, 1)), (g(0), g(1))
    elif name == "baddbmm":
        flops, operands = fc.baddbmm_flop(_shape(ins, 0), _shape(ins, 1), _shape(ins, 2)), (g(1), g(2))
    elif name in GROUPED_MM_OPS:  # (T, k) x (E, k, n) with offsets: each row meets one expert
        a, b = _shape(ins, 0), _shape(ins, 1)
        flops, operands = 2 * math.prod(a[:-1]) * a[-1] * b[-1], (g(0), g(1))
    elif name == "matmul":  # broadcasting matmul: 2 * prod(out) * k
        flops, operands = 2 * math.prod(out) * _shape(ins, 0)[-1], (g(0), g(1))
    else:  # convolutions: 2 * output elements * (in_channels / groups) * kernel size
        x, w = _shape(ins, 0), _shape(ins, 1)
        flops = 2 * math.prod(out) * math.prod(w[1:]) if x and w else 0
        operands = (g(0), g(1))
    flops = float(flops)
    return OpCost(op_class="matmul", flops_fwd=flops, flops_bwd=flops * sum(operands))


def _attention_cost(name: str, ins: Sequence[Shape | None], grads: Sequence[bool], kwargs: dict,
                    causal_mask: bool) -> OpCost:
    q, k, v = _shape(ins, 0), _shape(ins, 1), _shape(ins, 2)
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        return OpCost(op_class="attention", covered=False)
    b, hq, sq, _ = q
    # GQA: key/value heads broadcast to the query heads (the kernels do the same work).
    kq, vq = (k[0], hq, k[2], k[3]), (v[0], hq, v[2], v[3])
    fwd = float(fc.sdpa_flop_count(q, kq, vq))
    needs_grad = any(bool(x) for x in grads[:3])
    bwd = float(fc.sdpa_backward_flop_count((b, hq, sq, v[3]), q, kq, vq)) if needs_grad else 0.0
    recompute = float(fc.bmm_flop((b * hq, sq, q[3]), (b * hq, q[3], k[2]))) if needs_grad else 0.0
    has_mask = len(ins) > 3 and ins[3] is not None
    is_causal = bool(kwargs.get("is_causal", False)) or (has_mask and causal_mask)
    return OpCost(op_class="attention", flops_fwd=fwd, flops_bwd=bwd, flops_bwd_recompute=recompute,
                  causal_fraction=causal_fraction(sq, k[2]) if is_causal else 1.0)


def causal_fraction(sq: int, sk: int) -> float:
    """Fraction of the (sq, sk) score matrix under a bottom-right aligned causal mask."""
    if sq <= 0 or sk <= 0:
        return 1.0
    if sk >= sq:
        kept = sq * sk - sq * (sq - 1) / 2
    else:  # more queries than keys: the first sq - sk rows see nothing past the diagonal
        kept = sk * (sk + 1) / 2
    return kept / (sq * sk)
