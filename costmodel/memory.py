"""Memory per device: model states by ZeRO stage, activations by recomputation, buffers, allocator reserve.

Model states under mixed-precision Adam (Rajbhandari et al., ZeRO, SC20): per parameter 2 bytes
bf16 weights + 2 bytes gradients + 12 bytes fp32 master weights, momentum and variance. Over a data-parallel
group of ``d``: ZeRO-0 ``16 P``; ZeRO-1 ``4 P + 12 P / d``; ZeRO-2 ``2 P + 14 P / d``; ZeRO-3 ``16 P / d``
(``P`` = the parameters of the device's model-parallel shard).

Activations of one transformer layer and one micro-batch (Korthikanti et al. 2022, 16-bit), generalised to an
``f``-wide MLP and ``h_kv``-wide K/V (GQA); with ``f = 4h`` and ``h_kv = h`` the terms are the paper's:

- replicated under tp without sequence parallelism: the two LayerNorm inputs ``4 s b h``, the attention and
  MLP inputs ``4 s b h``, the two dropout masks ``2 s b h`` (total ``10 s b h``);
- sharded over tp: Q, K, V and the attention output ``(4 + 4 h_kv / h) s b h`` and the MLP's two ``f``-wide
  activations ``4 f / h s b h`` (GeLU) or three (SwiGLU) (total ``24 s b h / t`` for GPT);
- the attention scores, softmax and dropout mask ``5 a s^2 b`` (``/ t``): gone with flash attention (never
  materialised) and with selective recomputation (recomputed);
- sequence parallelism shards the replicated part over tp too; context parallelism divides everything by cp;
- full recomputation keeps only each layer's input ``2 s b h`` (``/ t`` with sequence parallelism) and, during
  the backward of a layer, one layer's full activations (``recompute_working``).

The pipeline schedule sets how many micro-batches' activations a stage holds (``costmodel.pipeline``). The step
model (``costmodel.step``) lays model states out as the execution target does (``profiles/targets/*.toml``
``[memory.*]``, per device kind: autopar's runtime shards with FSDP2 mixed precision on CUDA only), and adds:
the logits and what the target's loss holds per logit element (``StepConstants.loss_bytes_per_logit``);
tensor-parallel buffers (DDP's buckets are in its layout's gradient bytes); for FSDP2 layouts, while a block's
gradients are reduced, their unsharded copy, the root module's and the reduce-scatter staging (two at ZeRO-3; the
peak holds the larger of these and the logits, which are freed first), and at ZeRO-3 the gathered root module
and two gathered blocks on a GPU (the one computing and the one prefetched; one on a CPU), with a MoE block's
experts module, its own FSDP2 unit, gathered once beside them (``costmodel.step.fsdp_buffer_bytes``); other ZeRO-3
layouts two prefetched layers. The allocator reserve, on
GPU ranks only, is the CUDA context (with cuBLAS / NCCL workspaces) plus a stated fragmentation margin of 5% of everything else (``MemoryConstants``); device capacities are the bytes
PyTorch can allocate (``costmodel.hardware``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from costmodel.errors import ConfigError

RECOMPUTE = ("none", "selective", "full")
GB = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConstants:
    """Bytes per parameter and the allocator's share. Sources: ZeRO (SC20) for the 2 + 2 + 12; the CUDA context
    + cuBLAS/NCCL workspaces measure ~0.8-1.2 GB on A100/H100 (``torch.cuda.mem_get_info`` before and after
    init); caching-allocator fragmentation ~5-10% in Megatron-LM / torchtitan memory profiles: the margin is
    5% of everything else (``fragmentation``), on GPU ranks only."""

    weight_bytes: float = 2.0
    grad_bytes: float = 2.0
    optimizer_bytes: float = 12.0
    context_bytes: float = 1.0e9
    fragmentation: float = 0.05


DEFAULT_MEMORY = MemoryConstants()


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Bytes per device by term; ``dominant`` names the largest term."""

    terms: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.__getitem__) if self.terms else ""

    def terms_gb(self) -> dict[str, float]:
        return {k: v / GB for k, v in self.terms.items()}


def model_state_bytes(
    *, params: float, zero_stage: int, dp: int, constants: MemoryConstants = DEFAULT_MEMORY
) -> dict[str, float]:
    """Weights, gradients and optimizer state of ``params`` parameters sharded by ZeRO ``zero_stage`` over ``dp``."""
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if dp < 1:
        raise ConfigError(f"dp={dp} must be >= 1")
    c = constants
    w, g, o = params * c.weight_bytes, params * c.grad_bytes, params * c.optimizer_bytes
    return {
        "weights": w / dp if zero_stage >= 3 else w,
        "gradients": g / dp if zero_stage >= 2 else g,
        "optimizer": o / dp if zero_stage >= 1 else o,
    }


def activation_terms(
    *, hidden: int, heads: int, ffn_hidden: int | None = None, kv_heads: int | None = None, glu: bool = False
) -> tuple[float, float, float]:
    """Korthikanti's per-layer coefficients ``(replicated, tp_sharded, scores)``: bytes =
    ``s b h (replicated + tp_sharded) + scores * a s^2 b`` before any division (``(10, 24, 5)`` for GPT)."""
    f = ffn_hidden or 4 * hidden
    kv_ratio = (kv_heads or heads) / heads
    replicated = 10.0
    sharded = 4.0 + 4.0 * kv_ratio + (6.0 if glu else 4.0) * f / hidden
    return replicated, sharded, 5.0


def activation_bytes_per_layer(
    *,
    seq: int,
    microbatch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sp: bool = False,
    cp: int = 1,
    recompute: str = "none",
    flash: bool = False,
    ffn_hidden: int | None = None,
    kv_heads: int | None = None,
    glu: bool = False,
) -> float:
    """Activation bytes one transformer layer keeps for one micro-batch until its backward (module doc)."""
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute={recompute!r}; choose one of {RECOMPUTE}")
    if min(seq, microbatch, hidden, heads, tp, cp) < 1:
        raise ConfigError("seq, microbatch, hidden, heads, tp and cp must all be >= 1")
    sbh = seq * microbatch * hidden / cp
    if recompute == "full":
        return 2.0 * sbh / (tp if sp else 1)
    rep, shard, score = activation_terms(hidden=hidden, heads=heads, ffn_hidden=ffn_hidden, kv_heads=kv_heads,
                                         glu=glu)
    total = sbh * (rep / (tp if sp else 1) + shard / tp)
    if recompute == "none" and not flash:
        # a s^2 b per layer; with cp each rank holds its s/cp query rows against all s keys
        total += score * heads * seq * seq * microbatch / (tp * cp * cp)
    return total


def full_layer_activation_bytes(
    *, seq: int, microbatch: int, hidden: int, heads: int, tp: int = 1, sp: bool = False, cp: int = 1,
    flash: bool = False, ffn_hidden: int | None = None, kv_heads: int | None = None, glu: bool = False,
) -> float:
    """One layer's activations with nothing recomputed: the working set a recomputing layer rebuilds."""
    return activation_bytes_per_layer(seq=seq, microbatch=microbatch, hidden=hidden, heads=heads, tp=tp, sp=sp,
                                      cp=cp, recompute="none", flash=flash, ffn_hidden=ffn_hidden,
                                      kv_heads=kv_heads, glu=glu)


def allocator_reserve_bytes(subtotal_bytes: float, constants: MemoryConstants = DEFAULT_MEMORY, *,
                            gpu: bool = True) -> float:
    """On a GPU: the CUDA context (with cuBLAS / NCCL workspaces) plus the caching allocator's fragmentation
    margin on everything else (``MemoryConstants``). A CPU rank has neither: its tensors are what it holds."""
    if not gpu:
        return 0.0 * subtotal_bytes
    return constants.context_bytes + constants.fragmentation * subtotal_bytes


def memory_estimate(terms: dict[str, float], constants: MemoryConstants = DEFAULT_MEMORY, *,
                    gpu: bool = True) -> MemoryEstimate:
    """Add the allocator reserve to the other terms."""
    out = {k: float(v) for k, v in terms.items()}
    out["allocator_reserve"] = allocator_reserve_bytes(sum(out.values()), constants, gpu=gpu)
    return MemoryEstimate(terms=out)
