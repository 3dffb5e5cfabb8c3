"""How one op and one collective of a block cost on a cluster: the callables the block ILP is built with.

``cluster_cost_context(cluster, mesh=, cost=)`` times an op with ``costmodel.compute.op_time_s`` (matmuls and
attention at the target's ``sustained_compute``, quantized linears at the precision's GEMM rate plus their cast
traffic, fused memory-bound kernels where the target fuses them) and a collective with ``costmodel.comm`` on the
submesh's tp / cp / ep groups; ``CostOptions`` is how the execution target runs its kernels
(``planner.search.block_cost.cost_options`` builds it from the target's constants).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from costmodel import comm, compute
from costmodel.errors import ConfigError
from planner.search.block_ops import DTYPE_BYTES
from planner.search.strategies import Collective, LayerOp, MeshShape, OpStrategy

FUSABLE = ("norm", "pointwise", "add")
"""Memory-bound ops a fusing target runs as one kernel each (``CostOptions.fused_memory_bound``)."""
QUANTIZED = ("linear", "experts")
"""Ops whose GEMMs run at the plan's precision; attention, the router and the LM head stay bf16."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CostContext:
    """How to time work and collectives: callables, so the builder stays pure and testable."""

    op_time_s: Callable[[LayerOp, OpStrategy, float, float], float]
    """(op, strategy, local flops, local bytes moved) -> seconds on one device."""
    collective: Callable[[Collective], tuple[str, float]]
    """A collective on its mesh axis -> (link kind it runs on, seconds)."""
    fused_input_projections: bool = False
    """Column-parallel linears reading one tensor (q / k / v, gate / up) run as ONE module (Megatron-LM's fused
    QKV): their input gradient is reduced once. False: as the separate modules autopar's runtime shards with
    DTensor ``ColwiseParallel``, each reducing its own input gradient."""
    flash: bool = True
    """Fused attention: backward FLOPs as traced (flash recomputes QK^T), no scores kept. False: the unfused
    softmax of Megatron-LM 2021 (backward twice the forward, the ``a s^2`` scores kept: Korthikanti et al.)."""
    scores_bytes: float = 0.0
    """Unfused attention: bytes of the scores, softmax and dropout mask one micro-batch keeps (unsharded)."""
    weight_bytes_per_param: float = 2.0
    """Bytes of one weight in the traced dtype: the part of an op's traffic that splits with its parameters."""
    selective: str = "attention"
    """What ``recompute="selective"`` recomputes: ``attention`` (the attention core, Korthikanti et al.) or
    ``op`` (op-level checkpointing: only matmul and attention outputs are kept, ``_op_checkpointed``)."""
    expert_dispatch_saved: float = 0.0
    """Tensors of one all-to-all's size (``LayerOp.dispatch_bytes``) the target's expert-parallel forward keeps
    for the backward per experts op beyond its traced ``saved_bytes`` (``StepConstants.expert_dispatch_saved``)."""

    def collective_time_s(self, c: Collective) -> float:
        return self.collective(c)[1]


def mesh_groups(mesh: MeshShape) -> dict[str, tuple[int, int]]:
    """(size, stride) of each axis inside one stage: tp innermost, then cp, then ep (``planner.plan`` order)."""
    return {"tp": (mesh.tp, 1), "cp": (mesh.cp, mesh.tp), "ep": (mesh.ep, mesh.tp * mesh.cp)}


def cluster_cost_context(cluster, *, mesh: MeshShape, device=None, dtype: str = "bf16", first_rank: int = 0,
                         sustained_compute: float = 1.0, fused_input_projections: bool = False, flash: bool = True,
                         causal_fraction: float = 1.0, attention_shape: tuple[int, int, int] | None = None,
                         softmax_bytes: float = 9.0, cost: "CostOptions | None" = None) -> CostContext:
    """Time ops with ``costmodel.compute.op_time_s`` and collectives with ``costmodel.comm`` on ``cluster``.

    ``cost`` (the target's ``CostOptions``) adds: linears and experts at ``gemm_dtype`` (fp8 / fp4 peak) plus
    ``cast_bytes`` of memory traffic per quantized GEMM input element (the forward input, the backward output
    gradient); norms, pointwise ops and residual adds as fused kernels reading their inputs and writing their
    output once (``fused_memory_bound``); sequence-parallel tp all-gathers / reduce-scatters at
    ``tp_comm_exposed`` of their time (GEMM-collective overlap); expert-parallel all-to-alls at ``ep_comm_exposed``
    of theirs (overlapped with another micro-batch's compute); the experts op at ``expert_gemm_efficiency`` of
    the dense GEMM rate (grouped GEMMs, token permutation); fused attention at ``gemm_dtype``'s rate when
    ``fp8_attention``.

    Matmuls and attention run at ``sustained_compute`` of the kernel rate (a training step's clocks and SMs
    shared with NCCL: ``costmodel.step_config.StepConstants``). Flash attention computes ``causal_fraction`` of
    the traced (dense) score FLOPs at the fused-attention rate; unfused attention (``flash=False``) runs as two
    batched GEMMs of inner size ``head_dim`` plus ``softmax_bytes`` per score (scaled-masked softmax + dropout),
    with ``attention_shape = (heads, seq, head_dim)`` for one sequence."""
    gpu = device if device is not None else cluster.node_type_of_rank(first_rank).gpu
    calibration = getattr(cluster, "calibration", None)
    groups = {axis: comm.Group(size=size, stride=stride) for axis, (size, stride) in mesh_groups(mesh).items()}

    opts = cost or CostOptions()
    attention_dtype = opts.gemm_dtype if opts.fp8_attention and opts.gemm_dtype == "fp8" else dtype
    if opts.gemm_dtype != "bf16" and not gpu.peak_tflops.get(opts.gemm_dtype):
        raise ConfigError(f"{opts.gemm_dtype} GEMMs need {opts.gemm_dtype} tensor cores; {gpu.name} has "
                          f"{', '.join(sorted(gpu.peak_tflops))}: plan with --precision bf16")

    def op_time(op: LayerOp, s: OpStrategy, flops: float, nbytes: float) -> float:
        if op.kind == "experts":  # grouped expert GEMMs at their fraction of the dense GEMM rate
            return _op_time(op, s, flops, nbytes) / opts.expert_gemm_efficiency
        return _op_time(op, s, flops, nbytes)

    def _op_time(op: LayerOp, s: OpStrategy, flops: float, nbytes: float) -> float:
        if opts.fused_memory_bound and op.kind in FUSABLE and op.bytes_fwd > 0:
            nbytes *= min(1.0, (len(op.inputs) + 1) * op.out_bytes / op.bytes_fwd)
        if op.kind in QUANTIZED and opts.gemm_dtype != "bf16" and flops > 0:
            return _quantized_time(op, s, flops, nbytes)
        if op.op_class == "attention" and not flash and attention_shape is not None:
            _, seq, hd = attention_shape
            # flops = 4 rows seq hd, rows = b (heads / tp) (seq / cp) query rows against seq keys each
            rows = flops / (4.0 * seq * hd)
            q_rows = max(1, seq // mesh.cp)
            shape = (max(1, round(rows / q_rows)), q_rows, seq, hd)  # batched QK^T / AV GEMMs
            t_mm = compute.op_time_s(flops=flops, bytes_moved=0.0, op_class="matmul", device=gpu, dtype=dtype,
                                     shape=shape, calibration=calibration)
            t_soft = compute.op_time_s(flops=0.0, bytes_moved=softmax_bytes * rows * seq, op_class="elementwise",
                                       device=gpu, calibration=calibration)
            return t_mm / sustained_compute + t_soft
        if op.op_class == "attention":
            t = compute.op_time_s(flops=flops * causal_fraction, bytes_moved=0.0, op_class="attention", device=gpu,
                                  dtype=attention_dtype, calibration=calibration)
            return t / sustained_compute
        shape = s.local_mnk(op.mnk, tp=mesh.tp, cp=mesh.cp)
        t = compute.op_time_s(flops=flops, bytes_moved=nbytes, op_class=op.op_class, device=gpu, dtype=dtype,
                              shape=shape, calibration=calibration)
        return t / sustained_compute if op.op_class == "matmul" else t

    def _quantized_time(op: LayerOp, s: OpStrategy, flops: float, nbytes: float) -> float:
        shape = s.local_mnk(op.mnk, tp=mesh.tp, cp=mesh.cp)
        t = compute.op_time_s(flops=flops, bytes_moved=nbytes, op_class="matmul", device=gpu, dtype=opts.gemm_dtype,
                              shape=shape, calibration=calibration) / sustained_compute
        frac = s.work_fraction / mesh.cp
        backward = flops > 1.5 * op.flops_fwd * frac  # backward: twice the forward's FLOPs
        if shape is not None:  # forward casts the (m, k) input, backward the (m, n) output gradient
            m, n, k = shape
            elems = m * n if backward else m * k
        else:  # grouped expert GEMMs: the dispatched tokens into gate / up, and about half as much into down
            elems = 1.5 * frac * op.dispatch_bytes / DTYPE_BYTES.get(dtype, 2)
        cast = compute.op_time_s(flops=0.0, bytes_moved=opts.cast_bytes * elems, op_class="elementwise",
                                 device=gpu, calibration=calibration)
        return t + cast

    def coll(c: Collective) -> tuple[str, float]:
        group = groups[c.axis]
        if group.size == 1 or c.nbytes <= 0:
            return "", 0.0
        cc = comm.collective_time_s(c.kind, c.nbytes, group, cluster, first_rank=first_rank)
        if c.axis == "tp" and mesh.sequence_parallel and c.kind in ("all_gather", "reduce_scatter"):
            return cc.link_kind, cc.time_s * opts.tp_comm_exposed
        if c.axis == "ep" and c.kind == "all_to_all":
            return cc.link_kind, cc.time_s * opts.ep_comm_exposed
        return cc.link_kind, cc.time_s

    scores = 0.0
    if not flash and attention_shape is not None:
        heads, seq, _ = attention_shape
        scores = 5.0 * heads * seq * seq  # Korthikanti et al.: scores + softmax (2 B each) + dropout mask (1 B)
    return CostContext(op_time_s=op_time, collective=coll, fused_input_projections=fused_input_projections,
                       flash=flash, scores_bytes=scores, weight_bytes_per_param=float(DTYPE_BYTES.get(dtype, 2)),
                       selective=opts.selective, expert_dispatch_saved=opts.expert_dispatch_saved)


@dataclass(frozen=True, kw_only=True, slots=True)
class CostOptions:
    """How kernels run on the execution target (from its ``costmodel.step_config.StepConstants`` and the plan's
    precision: ``GraphCoster.strategy``)."""

    sustained_compute: float = 1.0
    fused_input_projections: bool = False
    flash: bool = True
    softmax_bytes: float = 9.0
    fused_memory_bound: bool = False
    gemm_dtype: str = "bf16"
    cast_bytes: float = 0.0
    tp_comm_exposed: float = 1.0
    ep_comm_exposed: float = 1.0
    fp8_attention: bool = False
    selective: str = "attention"
    expert_gemm_efficiency: float = 1.0
    expert_dispatch_saved: float = 0.0
