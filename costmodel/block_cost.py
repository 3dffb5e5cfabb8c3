"""What one block costs on one device for one micro-batch, and who computes it.

The step model (``costmodel.step``) composes pipeline, data-parallel and memory figures out of per-block
costs; it never prices a block itself. A ``Workload`` carries its ``BlockCoster``: for a traced model the
planner's graph coster (``planner.search.block_cost.GraphCoster``: the block's traced ops under the sharding
the intra-op ILP picks), for a model given by its dimensions only the closed-form oracle of
``costmodel.analytic`` (Narayanan et al. SC21, Korthikanti et al. 2022), which the tests hold the graph coster
against. Everything here is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

from costmodel.hardware import Accelerator, Cluster
from costmodel.step_config import StepConstants
from costmodel.workload import LayerWork


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCtx:
    """Everything a block's cost depends on besides the block: one layer context of a configuration."""

    microbatch: int
    tp: int
    cp: int
    ep: int
    sp: bool
    """Sequence parallelism (only with tp > 1)."""
    recompute: str
    """This block's recomputation: ``none``, ``selective`` or ``full``."""
    flash: bool
    """Fused attention that never materialises the scores (False: the unfused softmax of Megatron-LM 2021)."""
    device: Accelerator
    cluster: Cluster
    """The node group(s) the block's devices sit in: its tp / cp / ep collectives run there."""
    constants: StepConstants
    precision: str = "bf16"
    """GEMM precision of the block's linears (``constants.precision(name)`` says how the target runs it)."""
    autocast: bool = False
    """The rank computes fp32 parameters under bf16 autocast (its ``[memory.*]`` mode prices
    ``autocast_weight_copies``) rather than with bf16 parameters: a coster that knows that regime prices the
    block's time, collectives, activation and working bytes at the dtypes autocast runs each tensor in (fp32
    residual stream, norms and expert tokens, bf16 matmul outputs) under the same sharding."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PricedCollective:
    """One collective a block issues per micro-batch, as the runtime issues it (for CommDebugMode checks)."""

    axis: str
    """Mesh axis: ``tp``, ``cp`` or ``ep``."""
    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``all_to_all``."""
    nbytes: float
    """Full buffer bytes (the gathered / reduced tensor)."""
    phase: str
    """``forward``, ``backward`` or ``recompute``."""
    count: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCost:
    """One block, one micro-batch, one device. Seconds unless named otherwise; ``comm_*`` map link kind ->
    seconds on the critical path."""

    fwd_s: float
    bwd_s: float
    """Backward compute, without recomputation."""
    wgrad_s: float
    """Part of ``bwd_s`` that is weight-gradient work (zero-bubble's W)."""
    recompute_s: float
    """Forward work recomputation adds before the backward."""
    comm_fwd: Mapping[str, float] = field(default_factory=dict)
    comm_bwd: Mapping[str, float] = field(default_factory=dict)
    comm_recompute: Mapping[str, float] = field(default_factory=dict)
    activation_bytes: float = 0.0
    """Kept from the forward until the block's backward (per micro-batch in flight)."""
    working_bytes: float = 0.0
    """Transient bytes on top while the block runs: the activations a recomputed block rebuilds, the logits
    and loss temporaries of a head, the scores of an unfused attention."""
    params: float = 0.0
    """Dense parameters one device holds (after tensor parallelism, before ZeRO)."""
    expert_params: float = 0.0
    """Expert parameters one device holds (after expert parallelism, before ZeRO)."""
    collectives: tuple[PricedCollective, ...] = ()
    solver: Mapping[str, object] = field(default_factory=dict)
    """How the block's sharding was chosen: status, objective, bound, gap of the intra-op ILP."""


class BlockCoster(Protocol):
    """Prices one distinct block of a workload in one layer context. Must be pure: the step model memoizes
    its answers per (block, context)."""

    def __call__(self, layer: LayerWork, ctx: LayerCtx) -> LayerCost: ...
