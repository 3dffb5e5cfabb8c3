"""Time of one layer (``LayerWork``) for one micro-batch on one device: compute and per-layer collectives.

Used by ``costmodel.step``. A transformer layer's dense matmul FLOPs (``flops_fwd - attn_flops_fwd``, as traced
or counted) run at the efficiency of its GEMM shapes (q/k/v, o, MLP up/gate, down) sharded over tp, from
``costmodel.compute``; the attention core at the fused-attention rate (flash) or as two batched GEMMs of
inner size ``head_dim`` (Megatron 2021's unfused kernel) plus its softmax / mask / dropout traffic; the
memory-bound rest (norms, bias + activation, dropout, residual) from per-token byte counts (``StepConstants``).
Backward: twice the forward GEMM time (input and weight gradient), twice the memory-bound traffic.

Collectives per transformer layer: tp: 2 all-reduces of ``b s h`` in forward, or with sequence parallelism an
all-gather + reduce-scatter pair each (same volume); in backward one all-reduce per column-parallel projection
(separate q / k / v / gate / up, as the runtime applies them; Megatron's fused QKV: 2), plus under sequence
parallelism 2 all-gathers (see ``_tp_comm``); cp: K/V all-gather in forward and reduce-scatter of their gradients
in backward, on the critical path (the runtime's all-gather context parallel issues them before / after the
attention core); ep: dispatch + combine all-to-alls of ``b s h top_k`` in forward and again in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.comm import Group, collective_time_s
from costmodel.compute import dispatch_time_s, matmul_time_s, op_time_s
from costmodel.hardware import Accelerator, Cluster
from costmodel.workload import LayerWork, Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class StepConstants:
    """The step model's own constants (one set for every case; see ``benchmarks/fidelity.py`` for how they
    were set). Memory-bound traffic in bytes per token and hidden (or ffn) element, forward pass, bf16:

    - ``elementwise_replicated_bytes`` 22: two LayerNorms (read + write 4 each), two dropout + residual adds
      (read 2 x 2 + mask, write 2: 7 each): replicated over tp unless sequence parallel.
    - ``elementwise_ffn_bytes`` 4: bias + GeLU over the ``f / tp`` MLP activations (read 2, write 2).
    - ``softmax_bytes`` 9 per attention score (unfused attention): scaled-masked softmax read + write 4,
      dropout read + write 4, mask 1.
    - ``optimizer_bytes_per_param`` 32: Adam reads and writes fp32 master, momentum, variance (24), reads the
      gradient and writes the bf16 weight.
    - ``overlap_slowdown`` 0.5: an overlapped collective still slows the compute it hides behind (NCCL
      kernels take SMs and HBM bandwidth, and prefetching leaves the first and last gathers exposed; the step
      is ``max(comm, compute) + k min(comm, compute)``).
    - ``zero3_flat_nic`` True: ZeRO-3's per-parameter all-gathers / reduce-scatters across nodes run as a flat
      ring at each GPU's own NIC rate (no rail-parallel hierarchy), as DeepSpeed / FSDP issue them.
    - ``zero3_passes_recompute`` False: with full recomputation a layer's recomputed forward runs right before
      its backward, so one parameter all-gather serves both (three passes a micro-batch: gather in forward,
      gather before recompute + backward, reduce-scatter of the gradients).
    - ``zero3_collectives_per_layer`` 1: ZeRO-3 gathers and reduces parameters once per layer per pass, as
      autopar's runtime runs it (FSDP2 ``fully_shard`` on each block), each paying the ring latency
      ``(n - 1) alpha``. DeepSpeed ZeRO-3 fetches module by module (two LayerNorms, QKV, attention projection,
      two MLP linears): 6, what ``benchmarks/fidelity.py`` uses for the SC21 DeepSpeed rows.
    - ``tp_fused_input_projections`` False: the backward all-reduces the input gradient of each
      column-parallel projection separately (q, k, v, and the MLP's up or gate + up: DTensor's
      ``ColwiseParallel`` on separate modules, as autopar's runtime applies it); True: once for attention and
      once for the MLP (Megatron-LM's fused QKV, what ``benchmarks/fidelity.py`` uses).
    """

    elementwise_replicated_bytes: float = 22.0
    elementwise_ffn_bytes: float = 4.0
    softmax_bytes: float = 9.0
    optimizer_bytes_per_param: float = 32.0
    overlap_slowdown: float = 0.5
    zero3_flat_nic: bool = True
    zero3_passes_recompute: bool = False
    zero3_collectives_per_layer: int = 1
    tp_fused_input_projections: bool = False
    sustained_compute: float = 0.85
    last_bucket_bytes: float = 25e6
    """Gradient bucket reduced after the backward ends (PyTorch DDP's default bucket): never overlapped."""


DEFAULT_STEP_CONSTANTS = StepConstants()


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerTime:
    """One layer, one micro-batch, one device (seconds). ``comm`` maps link kind -> exposed seconds."""

    fwd_s: float
    bwd_s: float
    wgrad_s: float
    """Part of ``bwd_s`` that is weight-gradient work (zero-bubble's W)."""
    recompute_s: float
    """Extra forward work recomputation adds to the backward."""
    comm_fwd: dict[str, float]
    comm_bwd: dict[str, float]
    comm_recompute: dict[str, float]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCtx:
    """What every layer of one configuration shares."""

    workload: Workload
    device: Accelerator
    cluster: Cluster
    microbatch: int
    tp: int
    cp: int
    ep: int
    sp: bool
    recompute: str
    flash: bool
    constants: StepConstants


def _add(d: dict[str, float], kind: str, t: float) -> None:
    if t > 0:
        d[kind] = d.get(kind, 0.0) + t


def _gemm_time_per_flop(c: LayerCtx, tokens: int) -> float:
    """Seconds per FLOP of the layer's GEMMs (analytic shapes sharded over tp)."""
    w, tp = c.workload, c.tp
    h, f = w.hidden, w.ffn_hidden
    h_kv = h * w.kv_heads // w.heads
    shapes = [(tokens, max(1, (h + 2 * h_kv) // tp), h), (tokens, h, max(1, h // tp))]
    shapes += [(tokens, max(1, f // tp), h)] * (2 if w.glu else 1) + [(tokens, h, max(1, f // tp))]
    cal = c.cluster.calibration
    t = sum(matmul_time_s(m, n, k, device=c.device, calibration=cal) for m, n, k in shapes)
    return t / sum(2.0 * m * n * k for m, n, k in shapes) / c.constants.sustained_compute


def _attention_s(c: LayerCtx, layer: LayerWork, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core, incl. its memory traffic when unfused."""
    w = c.workload
    flops = layer.attn_flops_fwd * c.microbatch / (c.tp * c.cp)
    if flops <= 0:
        return 0.0, 0.0
    cal = c.cluster.calibration
    if c.flash:
        flops *= float(w.meta.get("attn_causal_fraction", 0.5))  # causal kernels skip the masked half
        fwd = op_time_s(flops=flops, bytes_moved=0.0, op_class="attention", device=c.device,
                        calibration=cal) / c.constants.sustained_compute
        return fwd, 2.5 * fwd  # FlashAttention-2 backward: 2x FLOPs at ~80% of the forward's rate
    heads = max(1, w.heads // c.tp)
    hd = max(1, w.hidden // w.heads)
    shape = (c.microbatch * heads, max(1, w.seq // c.cp), w.seq, hd)
    mm = op_time_s(flops=flops, bytes_moved=0.0, op_class="matmul", device=c.device, shape=shape,
                   calibration=cal) / c.constants.sustained_compute
    scores = c.microbatch * heads * (w.seq / c.cp) * w.seq
    soft = op_time_s(flops=0.0, bytes_moved=c.constants.softmax_bytes * scores, op_class="elementwise",
                     device=c.device, calibration=cal)
    return mm + soft, 2.0 * (mm + soft)


def _tp_comm(c: LayerCtx, tokens: int) -> tuple[str, float, float]:
    """Link kind and forward / backward seconds of a transformer layer's tp collectives on ``b s h`` bytes.

    Forward: 2 all-reduces (attention and MLP outputs), or under sequence parallelism 2 all-gathers (the regions'
    inputs) + 2 reduce-scatters. Backward with fused input projections (Megatron-LM): the mirror image. With
    separate q / k / v (and gate / up) ``ColwiseParallel`` modules, as autopar's runtime applies them, each
    projection all-reduces its input gradient (``n`` = 4, or 5 with a GLU), and sequence parallelism adds the
    2 all-gathers of the row-parallel outputs' gradients (counted with CommDebugMode on a 2-layer Llama at tp=2:
    19 all-reduces without SP; 14 all-reduces, 10 all-gathers, 5 reduce-scatters with SP, embedding, head and
    loss-parallel included)."""
    if c.tp == 1:
        return "", 0.0, 0.0
    nbytes = tokens * c.workload.hidden * c.workload.dtype_bytes
    g = Group(size=c.tp, stride=1)
    ar = collective_time_s("all_reduce", nbytes, g, c.cluster)
    ag = collective_time_s("all_gather", nbytes, g, c.cluster)
    rs = collective_time_s("reduce_scatter", nbytes, g, c.cluster)
    fused = c.constants.tp_fused_input_projections
    n = 3 + (2 if c.workload.glu else 1)
    if c.sp:
        fwd = 2.0 * (ag.time_s + rs.time_s)
        bwd = fwd if fused else n * ar.time_s + 2.0 * ag.time_s
    else:
        fwd = 2.0 * ar.time_s
        bwd = fwd if fused else n * ar.time_s
    return ar.link_kind, fwd, bwd


def transformer_time(c: LayerCtx, layer: LayerWork) -> LayerTime:
    w, k = c.workload, c.constants
    tokens = max(1, c.microbatch * w.seq // c.cp)
    # routed experts run whole on each tp rank (runtime.expert_parallel copies them over tp): not divided by tp
    expert_flops = 2.0 * w.seq * max(1, w.topk) * layer.expert_params / w.experts if w.experts else 0.0
    dense_flops = max(0.0, layer.flops_fwd - layer.attn_flops_fwd - expert_flops)
    gemm_flops = (dense_flops / c.tp + expert_flops) * c.microbatch / c.cp
    t_gemm = gemm_flops * _gemm_time_per_flop(c, tokens)
    t_attn_f, t_attn_b = _attention_s(c, layer, tokens)
    elem_bytes = tokens * (k.elementwise_replicated_bytes * w.hidden / (c.tp if c.sp else 1)
                           + k.elementwise_ffn_bytes * w.ffn_hidden * (2 if w.glu else 1) / c.tp)
    t_elem = op_time_s(flops=0.0, bytes_moved=elem_bytes, op_class="elementwise", device=c.device,
                       calibration=c.cluster.calibration)
    d_f, d_b = dispatch_time_s(part="layer", device=c.device, calibration=c.cluster.calibration,
                               tensor_parallel=c.tp > 1)
    fwd = t_gemm + t_attn_f + t_elem + d_f
    bwd = 2.0 * t_gemm + t_attn_b + 2.0 * t_elem + d_b
    comm_f: dict[str, float] = {}
    comm_b: dict[str, float] = {}
    kind, tp_f, tp_b = _tp_comm(c, tokens)
    _add(comm_f, kind, tp_f)
    _add(comm_b, kind, tp_b)
    if c.cp > 1:  # K/V all-gather (fwd) and reduce-scatter of dK/dV (bwd) before / after the attention core:
        # on the critical path, as runtime.context_parallel runs them (Llama 3's all-gather CP, not a ring)
        nbytes = 2.0 * c.microbatch * w.seq * (w.hidden * w.kv_heads // w.heads) / c.tp * w.dtype_bytes
        group = Group(size=c.cp, stride=c.tp)
        ag = collective_time_s("all_gather", nbytes, group, c.cluster)
        rs = collective_time_s("reduce_scatter", nbytes, group, c.cluster)
        _add(comm_f, ag.link_kind, ag.time_s)
        _add(comm_b, rs.link_kind, rs.time_s)
    if c.ep > 1 and w.experts:
        nbytes = tokens * w.hidden * max(1, w.topk) * w.dtype_bytes
        a2a = collective_time_s("all_to_all", nbytes, Group(size=c.ep, stride=c.tp * c.cp), c.cluster)
        _add(comm_f, a2a.link_kind, 2.0 * a2a.time_s)
        _add(comm_b, a2a.link_kind, 2.0 * a2a.time_s)
    rec_s, comm_r = 0.0, {}
    if c.recompute == "full":
        rec_s, comm_r = fwd, dict(comm_f)
    elif c.recompute == "selective":
        rec_s = t_attn_f
    return LayerTime(fwd_s=fwd, bwd_s=bwd, wgrad_s=t_gemm, recompute_s=rec_s, comm_fwd=comm_f, comm_bwd=comm_b,
                     comm_recompute=comm_r)


def embedding_time(c: LayerCtx, layer: LayerWork) -> LayerTime:
    w = c.workload
    tokens = max(1, c.microbatch * w.seq // c.cp)
    nbytes = tokens * w.hidden * w.dtype_bytes
    t = op_time_s(flops=0.0, bytes_moved=2.0 * nbytes, op_class="embedding", device=c.device,
                  calibration=c.cluster.calibration)
    comm: dict[str, float] = {}
    if c.tp > 1:  # vocabulary-parallel embedding: partial sums all-reduced (reduce-scattered with sp)
        op = "reduce_scatter" if c.sp else "all_reduce"
        cc = collective_time_s(op, nbytes, Group(size=c.tp, stride=1), c.cluster)
        _add(comm, cc.link_kind, cc.time_s)
    return LayerTime(fwd_s=t, bwd_s=2.0 * t, wgrad_s=2.0 * t, recompute_s=0.0, comm_fwd=comm, comm_bwd={},
                     comm_recompute={})


def head_time(c: LayerCtx, layer: LayerWork) -> LayerTime:
    """LM head (vocab-parallel) + loss: one GEMM over V / tp and the logits' memory traffic."""
    w = c.workload
    tokens = max(1, c.microbatch * w.seq // c.cp)
    flops = layer.flops_fwd * c.microbatch / (c.tp * c.cp)
    cal = c.cluster.calibration
    vt = max(1, w.vocab // c.tp)
    per_flop = matmul_time_s(tokens, vt, w.hidden, device=c.device, calibration=cal) / (
        2.0 * tokens * vt * w.hidden * c.constants.sustained_compute)
    t_mm = flops * per_flop
    logits = tokens * vt * 4.0 * 3  # fp32 softmax / cross-entropy: read, write, read again
    t_loss = op_time_s(flops=0.0, bytes_moved=logits, op_class="reduction", device=c.device, calibration=cal)
    d_f, d_b = dispatch_time_s(part="model", device=c.device, calibration=cal, tensor_parallel=c.tp > 1)
    comm: dict[str, float] = {}
    if c.tp > 1 and c.sp:  # gather the sequence-sharded hidden states before the head
        cc = collective_time_s("all_gather", tokens * w.hidden * w.dtype_bytes, Group(size=c.tp, stride=1),
                               c.cluster)
        _add(comm, cc.link_kind, cc.time_s)
    return LayerTime(fwd_s=t_mm + t_loss + d_f, bwd_s=2.0 * t_mm + t_loss + d_b, wgrad_s=t_mm, recompute_s=0.0,
                     comm_fwd=comm, comm_bwd=dict(comm), comm_recompute={})


def other_time(c: LayerCtx, layer: LayerWork) -> LayerTime:
    """Any other block: its FLOPs at the large-matmul rate, its bytes at the memory rate."""
    cal = c.cluster.calibration
    scale = c.microbatch / (c.tp * c.cp)
    fwd = op_time_s(flops=layer.flops_fwd * scale, bytes_moved=layer.bytes_fwd * scale, op_class="matmul",
                    device=c.device, calibration=cal)
    bwd = op_time_s(flops=layer.flops_bwd * scale, bytes_moved=2.0 * layer.bytes_fwd * scale, op_class="matmul",
                    device=c.device, calibration=cal)
    return LayerTime(fwd_s=fwd, bwd_s=bwd, wgrad_s=bwd / 2, recompute_s=fwd if c.recompute == "full" else 0.0,
                     comm_fwd={}, comm_bwd={}, comm_recompute={})


def layer_time(c: LayerCtx, layer: LayerWork) -> LayerTime:
    if layer.kind == "transformer":
        return transformer_time(c, layer)
    if layer.kind == "embedding":
        return embedding_time(c, layer)
    if layer.kind == "head":
        return head_time(c, layer)
    return other_time(c, layer)
