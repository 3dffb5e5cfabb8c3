"""The closed-form cost of a transformer layer (Narayanan et al. SC21; Korthikanti et al. 2022): a test oracle.

``ClosedFormCoster`` prices a ``LayerWork`` from the model's dimensions alone, as Megatron-style formulas do.
The step model never uses it for a traced model (those are priced from their graph by the planner's graph
coster); ``costmodel.analytic`` workloads carry it so that tests can hold the graph-derived costs against the
formulas on Megatron-style blocks. Forward: the layer's dense matmul FLOPs at the efficiency of its GEMM shapes
(q/k/v, o, MLP up/gate, down) sharded over tp (``costmodel.compute``); the attention core at the fused-attention
rate (flash, causal) or as two batched GEMMs of inner size ``head_dim`` plus the softmax / mask / dropout
traffic (unfused); the memory-bound rest from per-token byte counts (``StepConstants``). Backward: twice the
forward GEMM and memory-bound time, 2.5x the flash forward.

Collectives per layer: tp: 2 all-reduces of ``b s h`` forward (sequence parallel: 2 all-gathers + 2
reduce-scatters); backward one all-reduce per column-parallel projection (q, k, v, gate / up separately, or 2
with ``tp_fused_input_projections``), plus 2 all-gathers under sequence parallelism; cp: K/V all-gather forward,
reduce-scatter backward (all-reduce on CPU ranks); ep: dispatch + combine all-to-alls forward and backward, the two
routing all-to-alls (row counts, expert ids) forward. Memory: Korthikanti's
activation bytes (``costmodel.memory.activation_bytes_per_layer``), the logits of the head.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel import memory as mem
from costmodel.block_cost import LayerCost, LayerCtx
from costmodel.collectives import ROUTING_INDEX_BYTES
from costmodel.comm import Group, collective_time_s
from costmodel.compute import dispatch_time_s, matmul_time_s, op_time_s
from costmodel.workload import LayerWork


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerDims:
    """The dimensions the formulas need (one sequence of ``seq`` tokens)."""

    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq: int
    experts: int = 0
    topk: int = 0
    glu: bool = False
    dtype_bytes: int = 2
    attn_causal_fraction: float = 0.5


def _add(d: dict[str, float], kind: str, t: float) -> None:
    if t > 0:
        d[kind] = d.get(kind, 0.0) + t


def _gemm_time_per_flop(w: TransformerDims, c: LayerCtx, tokens: int) -> float:
    """Seconds per FLOP of the layer's GEMMs (analytic shapes sharded over tp)."""
    tp = c.tp
    h, f = w.hidden, w.ffn_hidden
    h_kv = h * w.kv_heads // w.heads
    shapes = [(tokens, max(1, (h + 2 * h_kv) // tp), h), (tokens, h, max(1, h // tp))]
    shapes += [(tokens, max(1, f // tp), h)] * (2 if w.glu else 1) + [(tokens, h, max(1, f // tp))]
    cal = c.cluster.calibration
    t = sum(matmul_time_s(m, n, k, device=c.device, calibration=cal) for m, n, k in shapes)
    return t / sum(2.0 * m * n * k for m, n, k in shapes) / c.constants.sustained_compute


def _attention_s(w: TransformerDims, c: LayerCtx, layer: LayerWork, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core, incl. its memory traffic when unfused."""
    flops = layer.attn_flops_fwd * c.microbatch / (c.tp * c.cp)
    if flops <= 0:
        return 0.0, 0.0
    cal = c.cluster.calibration
    if c.flash:
        flops *= w.attn_causal_fraction  # causal kernels skip the masked half
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


def _tp_comm(w: TransformerDims, c: LayerCtx, tokens: int) -> tuple[str, float, float]:
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
    nbytes = tokens * w.hidden * w.dtype_bytes
    g = Group(size=c.tp, stride=1)
    ar = collective_time_s("all_reduce", nbytes, g, c.cluster)
    ag = collective_time_s("all_gather", nbytes, g, c.cluster)
    rs = collective_time_s("reduce_scatter", nbytes, g, c.cluster)
    fused = c.constants.tp_fused_input_projections
    n = 3 + (2 if w.glu else 1)
    if c.sp:
        fwd = 2.0 * (ag.time_s + rs.time_s)
        bwd = fwd if fused else n * ar.time_s + 2.0 * ag.time_s
    else:
        fwd = 2.0 * ar.time_s
        bwd = fwd if fused else n * ar.time_s
    return ar.link_kind, fwd, bwd


def _activations(w: TransformerDims, c: LayerCtx, recompute: str) -> float:
    return mem.activation_bytes_per_layer(seq=w.seq, microbatch=c.microbatch, hidden=w.hidden, heads=w.heads,
                                          tp=c.tp, sp=c.sp, cp=c.cp, recompute=recompute, flash=c.flash,
                                          ffn_hidden=w.ffn_hidden, kv_heads=w.kv_heads, glu=w.glu)


def transformer_cost(w: TransformerDims, c: LayerCtx, layer: LayerWork) -> LayerCost:
    k = c.constants
    tokens = max(1, c.microbatch * w.seq // c.cp)
    # routed experts run whole on each tp rank (runtime.expert_parallel copies them over tp): not divided by tp
    expert_flops = 2.0 * w.seq * max(1, w.topk) * layer.expert_params / w.experts if w.experts else 0.0
    dense_flops = max(0.0, layer.flops_fwd - layer.attn_flops_fwd - expert_flops)
    gemm_flops = (dense_flops / c.tp + expert_flops) * c.microbatch / c.cp
    t_gemm = gemm_flops * _gemm_time_per_flop(w, c, tokens)
    t_attn_f, t_attn_b = _attention_s(w, c, layer, tokens)
    elem_bytes = tokens * (k.elementwise_replicated_bytes * w.hidden / (c.tp if c.sp else 1)
                           + k.elementwise_ffn_bytes * w.ffn_hidden * (2 if w.glu else 1) / c.tp)
    t_elem = op_time_s(flops=0.0, bytes_moved=elem_bytes, op_class="elementwise", device=c.device,
                       calibration=c.cluster.calibration)
    d_f, d_b = dispatch_time_s(part="layer", device=c.device, calibration=c.cluster.calibration,
                               tensor_parallel=c.tp > 1, sequence_parallel=c.sp)
    fwd = t_gemm + t_attn_f + t_elem + d_f
    bwd = 2.0 * t_gemm + t_attn_b + 2.0 * t_elem + d_b
    comm_f: dict[str, float] = {}
    comm_b: dict[str, float] = {}
    kind, tp_f, tp_b = _tp_comm(w, c, tokens)
    _add(comm_f, kind, tp_f)
    _add(comm_b, kind, tp_b)
    if c.cp > 1:  # K/V all-gather (fwd, kept for the bwd) and the reduction of dK/dV to this rank's slice (bwd):
        # on the critical path, as runtime.context_parallel runs them (Llama 3's all-gather CP, not a ring): a
        # reduce-scatter on NCCL, an all-reduce on CPU ranks' gloo
        nbytes = 2.0 * c.microbatch * w.seq * (w.hidden * w.kv_heads // w.heads) / c.tp * w.dtype_bytes
        group = Group(size=c.cp, stride=c.tp)
        ag = collective_time_s("all_gather", nbytes, group, c.cluster)
        rs = collective_time_s("all_reduce" if c.device.kind == "cpu" else "reduce_scatter", nbytes, group,
                               c.cluster)
        _add(comm_f, ag.link_kind, ag.time_s)
        _add(comm_b, rs.link_kind, rs.time_s)
    if c.ep > 1 and w.experts:
        rows = tokens * max(1, w.topk)
        group = Group(size=c.ep, stride=c.tp * c.cp)
        a2a = collective_time_s("all_to_all", rows * w.hidden * w.dtype_bytes, group, c.cluster)
        # the routing before the dispatch: int64 row counts per ep rank, an int64 expert id per row
        routing = sum(collective_time_s("all_to_all", n * ROUTING_INDEX_BYTES, group, c.cluster).time_s for n in (c.ep, rows))
        _add(comm_f, a2a.link_kind, 2.0 * a2a.time_s + routing)
        _add(comm_b, a2a.link_kind, 2.0 * a2a.time_s)
    rec_s, comm_r = 0.0, {}
    working = 0.0
    if c.recompute == "full":
        rec_s, comm_r = fwd, dict(comm_f)
        working = _activations(w, c, "none")
    elif c.recompute == "selective":
        rec_s = t_attn_f
        if not c.flash:  # the recomputed scores of one layer at a time
            working = 5.0 * w.heads * w.seq * w.seq * c.microbatch / (c.tp * c.cp * c.cp)
    return LayerCost(fwd_s=fwd, bwd_s=bwd, wgrad_s=t_gemm, recompute_s=rec_s, comm_fwd=comm_f, comm_bwd=comm_b,
                     comm_recompute=comm_r, activation_bytes=_activations(w, c, c.recompute), working_bytes=working,
                     params=(layer.params - layer.expert_params) / c.tp, expert_params=layer.expert_params / c.ep)


def embedding_cost(w: TransformerDims, c: LayerCtx, layer: LayerWork) -> LayerCost:
    tokens = max(1, c.microbatch * w.seq // c.cp)
    nbytes = tokens * w.hidden * w.dtype_bytes
    t = op_time_s(flops=0.0, bytes_moved=2.0 * nbytes, op_class="embedding", device=c.device,
                  calibration=c.cluster.calibration)
    comm: dict[str, float] = {}
    if c.tp > 1:  # vocabulary-parallel embedding: partial sums all-reduced (reduce-scattered with sp)
        op = "reduce_scatter" if c.sp else "all_reduce"
        cc = collective_time_s(op, nbytes, Group(size=c.tp, stride=1), c.cluster)
        _add(comm, cc.link_kind, cc.time_s)
    return LayerCost(fwd_s=t, bwd_s=2.0 * t, wgrad_s=2.0 * t, recompute_s=0.0, comm_fwd=comm,
                     params=layer.params / c.tp)


def head_cost(w: TransformerDims, c: LayerCtx, layer: LayerWork) -> LayerCost:
    """LM head (vocab-parallel) + loss: one GEMM over V / tp and the logits' memory traffic."""
    tokens = max(1, c.microbatch * w.seq // c.cp)
    flops = layer.flops_fwd * c.microbatch / (c.tp * c.cp)
    cal = c.cluster.calibration
    vt = max(1, w.vocab // c.tp)
    per_flop = matmul_time_s(tokens, vt, w.hidden, device=c.device, calibration=cal) / (
        2.0 * tokens * vt * w.hidden * c.constants.sustained_compute)
    t_mm = flops * per_flop
    logits = tokens * vt * 4.0 * 3  # fp32 softmax / cross-entropy: read, write, read again
    t_loss = op_time_s(flops=0.0, bytes_moved=logits, op_class="reduction", device=c.device, calibration=cal)
    d_f, d_b = dispatch_time_s(part="model", device=c.device, calibration=cal, tensor_parallel=c.tp > 1,
                               sequence_parallel=c.sp)
    comm: dict[str, float] = {}
    if c.tp > 1 and c.sp:  # gather the sequence-sharded hidden states before the head
        cc = collective_time_s("all_gather", tokens * w.hidden * w.dtype_bytes, Group(size=c.tp, stride=1),
                               c.cluster)
        _add(comm, cc.link_kind, cc.time_s)
    return LayerCost(fwd_s=t_mm + t_loss + d_f, bwd_s=2.0 * t_mm + t_loss + d_b, wgrad_s=t_mm, recompute_s=0.0,
                     comm_fwd=comm, comm_bwd=dict(comm),
                     working_bytes=tokens * vt * (w.dtype_bytes + c.constants.loss_bytes_per_logit),
                     params=layer.params / c.tp)


def other_cost(c: LayerCtx, layer: LayerWork) -> LayerCost:
    """Any other block: its FLOPs at the large-matmul rate, its bytes at the memory rate, replicated."""
    cal = c.cluster.calibration
    scale = c.microbatch / c.cp
    fwd = op_time_s(flops=layer.flops_fwd * scale, bytes_moved=layer.bytes_fwd * scale, op_class="matmul",
                    device=c.device, calibration=cal)
    bwd = op_time_s(flops=layer.flops_bwd * scale, bytes_moved=2.0 * layer.bytes_fwd * scale, op_class="matmul",
                    device=c.device, calibration=cal)
    return LayerCost(fwd_s=fwd, bwd_s=bwd, wgrad_s=bwd / 2, recompute_s=fwd if c.recompute == "full" else 0.0,
                     params=float(layer.params))


@dataclass(frozen=True, slots=True)
class ClosedFormCoster:
    """``BlockCoster`` from the formulas above (the oracle; see the module docstring)."""

    dims: TransformerDims

    def __call__(self, layer: LayerWork, ctx: LayerCtx) -> LayerCost:
        if layer.kind == "transformer":
            return transformer_cost(self.dims, ctx, layer)
        if layer.kind == "embedding":
            return embedding_cost(self.dims, ctx, layer)
        if layer.kind == "head":
            return head_cost(self.dims, ctx, layer)
        return other_cost(ctx, layer)
