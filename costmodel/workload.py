"""What the cost model needs to know about a model: plain numbers, no FX nodes, and how to price its blocks.

The planner builds a ``Workload`` from a traced ``OpGraph`` (FLOPs and parameters per layer as traced, the
model's dimensions) with the graph coster that prices each distinct block from its traced ops; the cost model
never sees torch objects. Per-layer numbers are for ONE sequence of ``seq`` tokens (micro-batch 1), unsharded:
model FLOPs for throughput figures, parameters for memory bounds. Time and memory under a configuration come
from ``coster`` (``costmodel.block_cost``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

LayerKind = Literal["embedding", "transformer", "head", "other"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerWork:
    """Costs of one layer (block) for one sequence of ``Workload.seq`` tokens, unsharded."""

    name: str
    """Module FQN of the block (``model.layers.3``) or a group name (``embedding``, ``head``)."""
    kind: LayerKind
    signature: str = ""
    """Identity of the block's structure: blocks with equal signatures (and numbers) are priced once."""
    params: int
    """Parameters the block owns (tied weights counted once, on the first block that uses them)."""
    flops_fwd: float
    """Forward FLOPs (dense attention counted as causal kernels do it is ``attn_flops_fwd_causal``)."""
    flops_bwd: float
    """Backward FLOPs (input and weight gradients)."""
    attn_flops_fwd: float = 0.0
    """Part of ``flops_fwd`` spent in the attention core (QK^T and AV), dense count."""
    expert_params: int = 0
    """Part of ``params`` in MoE experts (sharded over the expert axis)."""
    bytes_fwd: float = 0.0
    """Bytes read + written by the forward pass (for memory-bound ops on the roofline)."""

    @property
    def recomputable(self) -> bool:
        """Whether activation recomputation applies: every block but the embedding and the head."""
        return self.kind not in ("embedding", "head")


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A transformer-shaped training workload: its dimensions and its layer sequence."""

    name: str
    layers: tuple[LayerWork, ...]
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq: int
    num_layers: int
    """Transformer layers (the ``kind == "transformer"`` entries of ``layers``)."""
    experts: int = 0
    topk: int = 0
    glu: bool = False
    """Gated MLP (SwiGLU: three ffn matrices) rather than GeLU (two)."""
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    coster: Callable[[LayerWork, Any], Any] | None = field(default=None, compare=False)
    """A ``costmodel.block_cost.BlockCoster``: prices each distinct block in a layer context; the step model
    refuses a workload without one."""
    meta: dict = field(default_factory=dict)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def flops_fwd_per_seq(self) -> float:
        return sum(layer.flops_fwd for layer in self.layers)

    @property
    def flops_bwd_per_seq(self) -> float:
        return sum(layer.flops_bwd for layer in self.layers)
