"""``ParallelConfig`` (one fixed parallel configuration) and its validation against a workload and cluster.

Every check raises ``ConfigError`` naming the numbers and a fix (the nearest valid values).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from costmodel.errors import ConfigError
from costmodel.memo import ByIdentity
from costmodel.pipeline import SCHEDULES, check_schedule
from costmodel.workload import Workload

RECOMPUTE = ("none", "selective", "full")


PRECISIONS = ("bf16", "fp8", "fp8-cs", "mxfp8", "nvfp4")
"""GEMM precisions a plan may train with: bf16; fp8 with per-tensor delayed scaling (``fp8``) or current
scaling (``fp8-cs``); MX block-scaled fp8 (``mxfp8``, Blackwell); NVFP4 (``nvfp4``, Blackwell)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionConstants:
    """How an execution target trains with one GEMM precision (a ``[precision.<name>]`` table of its file)."""

    name: str
    gemm_dtype: str
    """The tensor-core rate the quantized linears run at (``profiles/accelerators.toml`` peak key: bf16,
    fp8, fp4); attention, the router and the LM head stay bf16."""
    cast_bytes_per_element: float = 0.0
    """Memory traffic per GEMM input element to quantize it (the forward input, the backward output gradient):
    read bf16, write the quantized copies and scales."""
    weight_bytes_per_param: float = 0.0
    """Bytes per parameter of the quantized weight copies (and their scales) kept beside the model states."""
    param_gather_bytes: float | None = None
    """Bytes per parameter the data-parallel parameter all-gather moves when the target gathers quantized
    weights (None: the target's ``param_gather_bytes``)."""
    requires: str = ""
    """A rate the accelerator must also have (``fp4``: the fifth-generation tensor cores that scale MX blocks in
    hardware), besides ``gemm_dtype``'s."""


P2P_BOUNDARIES = ("full", "sequence_shard", "tp_slice")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepConstants:
    """How one execution target runs a step: its kernels, overlaps and communication dtypes. Read from
    ``profiles/targets/<name>.toml`` (``costmodel.targets.Target.constants``; every value with its source there);
    there is no default set. Memory-bound byte counts are per token and hidden (or ffn) element, forward, bf16.

    Kernels:

    - ``sustained_compute``: tensor-core work in a training step against an isolated kernel (clocks under the
      power limit, SMs shared with communication kernels).
    - ``tp_fused_input_projections``: the backward reduces the input gradient of the column-parallel
      projections reading one tensor once (fused QKV / gate+up modules) instead of once per module.
    - ``fused_memory_bound``: norms, pointwise ops and residual adds run as one fused kernel each (reading
      their inputs and writing their output once: Transformer Engine, torch.compile), not as the traced eager
      ops (a traced RMSNorm upcasts to fp32 and moves ~3.5x that).
    - ``selective_recompute``: what ``recompute="selective"`` keeps: ``attention`` (everything but the attention
      core, Korthikanti et al. 2022: Megatron's selective recomputation) or ``op`` (op-level checkpointing that
      keeps the outputs of every other matmul and of attention and recomputes the rest: torchtitan's policy).
    - ``expert_gemm_efficiency``: the MoE experts' work (grouped GEMMs with the token permutation around them)
      against dense GEMMs of the same FLOPs and bytes.
    - ``expert_gemm_host_s``: host seconds to issue one expert's GEMM of a grouped linear (per local expert,
      grouped linear and pass): the experts op of a pass takes at least local experts x GEMMs x this (a dropless
      MoE layer syncs the host on its token counts, so the host cannot run ahead of it); 0: a single grouped
      kernel, never host-bound (CUDA graphs replay the whole step: nothing is issued from the host).
    - ``expert_dispatch_saved``: how many (rows, hidden) tensors of the dispatched (token, expert) rows the
      target's expert-parallel forward keeps for the backward beyond what the model's own experts keep (the
      traced graph): tensors of one all-to-all's size (``LayerOp.dispatch_bytes``) per MoE layer and micro-batch
      on an ep rank; 0: the experts run as traced.
    - ``fp8_attention``: the fused attention kernels run in the plan's fp8 precision (Transformer Engine's FP8
      dot-product attention, Megatron-Core's ``TransformerConfig.fp8_dot_product_attention``) at that GEMM
      dtype's rate; False: in bf16.
    - ``softmax_bytes`` per attention score of unfused attention (scaled-masked softmax + dropout).
    - ``elementwise_replicated_bytes`` / ``elementwise_ffn_bytes``: norms, dropout, residuals / bias + activation
      (the closed-form oracle; a traced block has its own ops).
    - ``optimizer_bytes_per_param``: Adam's memory traffic per parameter.
    - ``loss_bytes_per_logit``: what the loss holds per logit element besides the logits themselves, at its
      peak (the start of its backward): eager cross-entropy keeps the fp32 log-softmax output and makes its
      incoming and outgoing gradients in fp32 (12); a fused vocab-parallel cross-entropy one fp32 buffer (4).
    - ``vocab_parallel_loss_bytes_per_logit``: the same for the loss over vocabulary-sharded logits (a
      tensor-parallel head whose loss reads its local shard), per local logit element: DTensor's
      ``loss_parallel`` keeps more than eager cross-entropy (16 against 12).
    - ``gradients_freed_between_steps``: the parameters' gradients are freed after each optimizer step and made
      again by the next backward (``zero_grad(set_to_none=True)``), so a step of one micro-batch peaks at the
      larger of its backward's start (no gradients) and its end (``costmodel.step._one_backward_peak``); False:
      persistent gradient buffers (Megatron's grad buffer, DeepSpeed's partitions), live all step.

    Overlaps:

    - ``overlap_slowdown`` k: an overlapped collective still slows the compute it hides behind; the exposed time
      is ``max(0, comm - window) + k min(comm, window)``.
    - ``overlap_param_gather``: the data-parallel parameter all-gather (ZeRO-1/2) overlaps the next forward, so
      a rank's window is its whole micro-batch (forward + backward) rather than its backward.
    - ``tp_comm_exposed``: fraction of a sequence-parallel tp all-gather / reduce-scatter left on the critical
      path (1: none hidden; GEMM-collective overlap hides the rest).
    - ``ep_comm_exposed``: fraction of the expert-parallel token all-to-alls (dispatch and combine) left on the
      critical path (1: none hidden; Megatron's ``--overlap-moe-expert-parallel-comm`` runs one micro-batch's
      all-to-alls behind another's compute).
    - ``last_bucket_bytes``: gradient bucket reduced after the backward ends, never overlapped.
    - ``zero3_flat_nic``: ZeRO-3 collectives across nodes run as one flat ring at each GPU's NIC rate.
    - ``zero3_passes_recompute``: a recomputed layer gathers its parameters again (four passes, not three).
    - ``zero3_collectives_per_layer``: parameter gathers / gradient reductions per layer and pass, each paying
      the ring latency.
    - ``first_bucket_bytes``: ZeRO-0 gradients are all-reduced in buckets, the first (the last layers' gradients)
      of this size, the others of ``last_bucket_bytes`` (torch DDP); 0: one all-reduce of the whole gradient.
    - ``zero12_per_unit``: ZeRO-1/2 gather the parameters and reduce-scatter the gradients unit by unit as
      ZeRO-3 does (``zero3_collectives_per_layer`` per layer plus one for the rest: FSDP2 units); False: the
      whole state in one collective each (a distributed optimizer). True also prices ZeRO-0 with tensor parallel
      as FSDP2's ``replicate`` on the same units (DTensor parameters, which DDP cannot bucket).
    - ``zero2_reduce_per_microbatch``: ZeRO-2 reduce-scatters every micro-batch's gradients (m reductions a
      step, overlapped with every backward) rather than accumulating them and reducing once.

    Pipeline (what the framework's stages send and keep between micro-batches):

    - ``p2p_boundary``: the activation a pipeline stage sends to the next one (and the gradient it gets back):
      ``full`` (every tp rank sends the whole ``(micro-batch, seq / cp, hidden)`` tensor), ``sequence_shard``
      (``/ tp`` under sequence parallelism, whole otherwise) or ``tp_slice`` (``/ tp`` always: Megatron's
      scatter / gather of the tp-replicated tensor).
    - ``recv_buffers_per_microbatch``: each stage keeps one activation and one gradient receive buffer per
      micro-batch of the step for the whole step (torch.distributed.pipelining ``PipelineStage``) rather than
      for the micro-batches in flight.
    - ``stage_outputs_kept``: a stage keeps the output of every micro-batch in flight until that micro-batch's
      backward (torch.distributed.pipelining ``PipelineStage``'s forward cache) rather than freeing it once sent.

    Communication: ``grad_reduce_bytes`` per gradient element of the data-parallel reduction,
    ``param_gather_bytes`` per parameter of the parameter all-gather (None: the workload's bytes per element,
    the dtype the parameters train in). ``precisions``: the GEMM precisions the
    target runs (``PrecisionConstants``).
    """

    sustained_compute: float
    tp_fused_input_projections: bool
    fused_memory_bound: bool
    selective_recompute: str
    expert_gemm_efficiency: float
    expert_gemm_host_s: float
    expert_dispatch_saved: float
    fp8_attention: bool
    softmax_bytes: float
    elementwise_replicated_bytes: float
    elementwise_ffn_bytes: float
    optimizer_bytes_per_param: float
    loss_bytes_per_logit: float
    vocab_parallel_loss_bytes_per_logit: float
    gradients_freed_between_steps: bool
    overlap_slowdown: float
    overlap_param_gather: bool
    tp_comm_exposed: float
    ep_comm_exposed: float
    last_bucket_bytes: float
    zero3_flat_nic: bool
    zero3_passes_recompute: bool
    zero3_collectives_per_layer: int
    zero2_reduce_per_microbatch: bool
    zero12_per_unit: bool
    first_bucket_bytes: float
    p2p_boundary: str
    recv_buffers_per_microbatch: bool
    stage_outputs_kept: bool
    grad_reduce_bytes: float | None
    param_gather_bytes: float | None
    precisions: tuple[PrecisionConstants, ...] = ()

    def __post_init__(self) -> None:
        if self.p2p_boundary not in P2P_BOUNDARIES:
            raise ConfigError(f"p2p_boundary {self.p2p_boundary!r}: choose one of {', '.join(P2P_BOUNDARIES)}")

    def boundary_divisor(self, *, tp: int, sp: bool) -> int:
        """What a pipeline boundary tensor is divided by on one rank (``p2p_boundary``)."""
        if self.p2p_boundary == "tp_slice" or (self.p2p_boundary == "sequence_shard" and sp):
            return tp
        return 1

    def precision(self, name: str) -> PrecisionConstants:
        """The target's constants for GEMM precision ``name``; ConfigError when the target does not run it."""
        for p in self.precisions:
            if p.name == name:
                return p
        raise ConfigError(f"precision={name!r} is not run by this target; it runs "
                          f"{', '.join(p.name for p in self.precisions) or 'none'}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Degrees and knobs of one configuration; ``tp * cp * pp * dp`` = devices, ``ep`` divides ``dp``."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    microbatch: int | None = None
    """Sequences per micro-batch; None: ``estimate_step`` chooses the fastest that fits."""
    global_batch: int
    """Sequences per optimizer step (all data-parallel ranks together)."""
    schedule: str = "1f1b"
    virtual_stages: int | None = 1
    """Model chunks per pipeline rank (interleaved / zero-bubble); None: chosen."""
    recompute: str = "none"
    recompute_layers: tuple[int, ...] | None = None
    """Per pipeline chunk (``pp * virtual_stages`` entries): how many of the chunk's layers (every block but the
    embedding and the head), counted from its first, run with ``recompute``; None: all of them (Megatron-LM's
    ``--recompute-num-layers`` per stage). Ignored when ``recompute`` is ``none``."""
    sequence_parallel: bool = False
    zero_stage: int = 0
    flash_attention: bool = True
    """Fused attention that never materialises the scores (False: Megatron-2021-style unfused softmax)."""
    overlap_grad_reduce: bool = True
    """Data-parallel gradient reduction overlapped with the backward (torch DDP / FSDP); False: after it
    (Megatron-LM 2021 ``local`` DDP)."""
    precision: str = "bf16"
    """GEMM precision of the linears (``PRECISIONS``)."""

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        if self.microbatch is None:
            raise ConfigError("microbatch is not chosen yet")
        return self.global_batch // (self.dp * self.microbatch)

    def summary(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages != 1 else ""
        extra = "".join(f" {k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) != 1)
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}{extra} mb={self.microbatch} {self.schedule}{v} "
                f"recompute={self.recompute}{' sp' if self.sequence_parallel else ''} zero={self.zero_stage}"
                + (f" {self.precision}" if self.precision != "bf16" else ""))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(values: list[int], target: int) -> list[int]:
    return sorted(sorted(values, key=lambda v: (abs(v - target), v))[:2])


def _positive(cfg: ParallelConfig) -> None:
    for key in ("tp", "pp", "dp", "cp", "ep", "global_batch"):
        val = getattr(cfg, key)
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ConfigError(f"{key}={val!r} must be a positive integer")
    for key in ("microbatch", "virtual_stages"):
        val = getattr(cfg, key)
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ConfigError(f"{key}={val!r} must be a positive integer or None (chosen)")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"schedule={cfg.schedule!r} is unknown; choose one of {SCHEDULES}")
    if cfg.recompute not in RECOMPUTE:
        raise ConfigError(f"recompute={cfg.recompute!r} is unknown; choose one of {RECOMPUTE}")
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={cfg.zero_stage!r} must be 0, 1, 2 or 3")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision={cfg.precision!r} is unknown; choose one of {PRECISIONS}")


def _check_model(cfg: ParallelConfig, w: Workload) -> None:
    if w.heads % cfg.tp:
        raise ConfigError(f"tp={cfg.tp} does not divide heads={w.heads}; choose tp in {_divisors(w.heads)}")
    if w.kv_heads % cfg.tp:
        raise ConfigError(
            f"tp={cfg.tp} does not divide kv_heads={w.kv_heads}; choose tp in {_divisors(w.kv_heads)}"
        )
    if w.seq % cfg.cp:
        raise ConfigError(f"cp={cfg.cp} does not divide seq={w.seq}; choose cp in {_divisors(w.seq)[:12]}")
    if cfg.ep > 1 and not w.experts:
        raise ConfigError(f"ep={cfg.ep} needs a MoE model; {w.name} has no experts: use ep=1")
    if w.experts and w.experts % cfg.ep:
        raise ConfigError(f"ep={cfg.ep} does not divide experts={w.experts}; choose ep in {_divisors(w.experts)}")
    if cfg.dp % cfg.ep:
        raise ConfigError(f"ep={cfg.ep} must divide dp={cfg.dp}; choose ep in {_divisors(cfg.dp)}")
    chunks = cfg.pp * (cfg.virtual_stages or 1)
    if chunks > len(w.layers):  # a chunk may hold the embedding or the head alone (explicit stage_layers)
        raise ConfigError(
            f"pp*virtual_stages={chunks} exceeds the {w.num_layers} transformer layers (with the embedding and the "
            f"head, {len(w.layers)} workload entries); use pp*virtual_stages <= {len(w.layers)}"
        )


def _check_batch(cfg: ParallelConfig) -> None:
    if cfg.global_batch % cfg.dp:
        lo = max(cfg.dp, cfg.global_batch - cfg.global_batch % cfg.dp)
        raise ConfigError(
            f"global_batch={cfg.global_batch} is not divisible by dp={cfg.dp}; use global_batch {lo} or "
            f"{lo + cfg.dp}, or dp in {_nearest(_divisors(cfg.global_batch), cfg.dp)}"
        )
    if cfg.microbatch is None:
        return
    per_rank = cfg.global_batch // cfg.dp
    if per_rank % cfg.microbatch:
        raise ConfigError(
            f"global_batch={cfg.global_batch} is not divisible by dp*microbatch={cfg.dp}*{cfg.microbatch}; "
            f"use microbatch in {_nearest(_divisors(per_rank), cfg.microbatch)} "
            f"(divisors of global_batch/dp={per_rank})"
        )


def validate_config(cfg: ParallelConfig, workload: Workload, num_devices: int) -> None:
    """Raise ConfigError for an invalid configuration (see the module docstring)."""
    _positive(cfg)
    _check_model(cfg, workload)
    if cfg.devices != num_devices:
        rest = cfg.tp * cfg.cp * cfg.pp
        fix = f"dp={num_devices // rest}" if num_devices % rest == 0 else f"tp*cp*pp dividing {num_devices}"
        raise ConfigError(
            f"tp*cp*pp*dp = {cfg.tp}*{cfg.cp}*{cfg.pp}*{cfg.dp} = {cfg.devices} != {num_devices} devices; use {fix}"
        )
    _check_batch(cfg)
    if cfg.microbatch is not None and cfg.virtual_stages is not None:
        check_schedule(cfg.schedule, pp=cfg.pp, num_microbatches=cfg.num_microbatches,
                       virtual_stages=cfg.virtual_stages)


def check_stage_layers(stage_layers: tuple[int, ...], workload: Workload, chunks: int) -> None:
    n = len(workload.layers)
    if len(stage_layers) != chunks or sum(stage_layers) != n or min(stage_layers) < 1:
        raise ConfigError(
            f"stage_layers={tuple(stage_layers)} must be {chunks} positive counts (pp*virtual_stages) summing "
            f"to the workload's {n} entries"
        )


def check_recompute_layers(cfg: ParallelConfig, workload: Workload, stage_layers: tuple[int, ...]) -> None:
    """``recompute_layers``: one count per chunk, each between 0 and the chunk's recomputable layers."""
    rl = cfg.recompute_layers
    if rl is None:
        return
    if len(rl) != len(stage_layers):
        raise ConfigError(
            f"recompute_layers={tuple(rl)} has {len(rl)} entries; give one per pipeline chunk "
            f"(pp*virtual_stages={len(stage_layers)})"
        )
    for c, (k, have) in enumerate(zip(rl, recomputable_per_chunk(workload, stage_layers))):
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= have:
            raise ConfigError(
                f"recompute_layers[{c}]={k!r}: chunk {c} has {have} recomputable layers; use 0..{have}"
            )


def recomputable_per_chunk(workload: Workload, stage_layers: Sequence[int]) -> tuple[int, ...]:
    """Per chunk of the cut ``stage_layers``: how many of its entries are recomputable (memoized per layer
    tuple and cut: the planner checks one cut many times)."""
    return _recomputable_cached(ByIdentity(workload.layers), tuple(stage_layers))


@functools.lru_cache(maxsize=4096)
def _recomputable_cached(layers: ByIdentity, stage_layers: tuple[int, ...]) -> tuple[int, ...]:
    out, start = [], 0
    for n in stage_layers:
        out.append(sum(1 for layer in layers.obj[start:start + n] if layer.recomputable))
        start += n
    return tuple(out)
