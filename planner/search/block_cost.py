"""``GraphCoster``: the step model's block costs from a block's traced ops, under the sharding the ILP picks.

For one distinct block (``planner.graph.Block``, found by its signature) and one layer context
(``costmodel.block_cost.LayerCtx``), ``block_plan.block_strategy`` solves the intra-op ILP over the block's
traced ops: compute per op from its FLOPs and bytes, the collectives its strategy and the resharding between
neighbours imply, the activation bytes the graph keeps for backward, recomputation. The answer is both the
``LayerCost`` the step model composes and the per-module shardings the plan file records, so what is priced
is what the runtime is told to apply. Solutions are memoized per (block, context) for the planning run.

Dtype regimes: the graph is traced with bf16 parameters (``planner.workload``), as FSDP2's mixed precision runs
it. A rank computing fp32 parameters under bf16 autocast (``LayerCtx.autocast``: DDP / no wrapper on CUDA,
every mode on CPU ranks) keeps other activations: an fp32 residual stream and norms, a bf16 copy of each
linear's input. Such a context is priced over the same model traced with fp32 parameters and replayed under
autocast (``planner.trace.trace(autocast=True)``, made on first need by the ``autocast_graph`` the workload gives
and kept), node for node, under the sharding solved on the bf16 graph (``block_plan.reprice_strategy``): its
saved bytes (``activation_bytes``) and backward's working bytes, and each op's tensors at the dtype autocast
runs them in (``block_ops.TRACED``): the tp all-reduces of fp32 embedding outputs and of the gradients into the
linears reading the fp32 residual stream, the ep all-to-alls of fp32 tokens, fp32 elementwise traffic; matmuls
at the bf16 rate.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Callable, Sequence

from costmodel.block_cost import LayerCost, LayerCtx, PricedCollective
from costmodel.compute import dispatch_time_s
from costmodel.errors import ConfigError, InfeasiblePlanError
from costmodel.workload import LayerWork
from planner.search.block_ops import TRACED, layer_ops_from_block
from planner.search.block_plan import (BlockStrategy, CostOptions, StrategyCache, cluster_key, block_strategy,
                                       reprice_strategy)
from planner.search.strategies import LayerOp

log = logging.getLogger(__name__)

_DTYPES = {2: "bf16", 4: "fp32"}


def cost_options(ctx: LayerCtx) -> CostOptions:
    """How the target in ``ctx.constants`` runs this context's kernels at its precision ``ctx.precision``."""
    k = ctx.constants
    p = k.precision(ctx.precision)
    return CostOptions(sustained_compute=k.sustained_compute, fused_input_projections=k.tp_fused_input_projections,
                       flash=ctx.flash, softmax_bytes=k.softmax_bytes, fused_memory_bound=k.fused_memory_bound,
                       gemm_dtype=p.gemm_dtype, cast_bytes=p.cast_bytes_per_element, tp_comm_exposed=k.tp_comm_exposed,
                       selective=k.selective_recompute, expert_gemm_efficiency=k.expert_gemm_efficiency,
                       expert_dispatch_saved=k.expert_dispatch_saved, ep_comm_exposed=k.ep_comm_exposed,
                       fp8_attention=k.fp8_attention)


def expert_host_s(ops: Sequence[LayerOp], ctx: LayerCtx) -> tuple[float, float]:
    """(forward, backward) host seconds the block's experts take to issue: one GEMM per local expert and grouped
    linear (fc1, fc2: Transformer Engine's GroupedLinear takes the host list ``m_splits`` and runs one cuBLAS
    GEMM per expert), two per expert and linear in the backward (dgrad, wgrad), ``expert_gemm_host_s`` each.
    A dropless MoE layer reads its tokens per expert back to the host before these GEMMs, so the host cannot
    queue them ahead of the device: a pass of the block takes at least this long."""
    per_gemm = ctx.constants.expert_gemm_host_s
    local = sum(math.ceil(op.experts / ctx.ep) for op in ops if op.kind == "experts" and op.experts > 0)
    return 2 * local * per_gemm, 4 * local * per_gemm


class GraphCoster:
    """``BlockCoster`` over a traced graph (see the module docstring). One per traced model; it holds the
    memo of solved blocks, so the step model's own memo (by identity) stays valid."""

    def __init__(self, *, graph, blocks: Sequence, seq: int, dtype_bytes: int = 2,
                 autocast_graph: Callable[[], object] | None = None, traced_dtypes: bool = False) -> None:
        """``autocast_graph``: called at most once, when a bf16 context first asks for autocast (see the module
        docstring): the same model's ``OpGraph`` traced with fp32 parameters under autocast, or None.
        ``traced_dtypes``: the ops' tensors at the dtypes ``graph`` records (the autocast regime's coster), not
        all at ``dtype_bytes``."""
        self._graph = graph
        self._block_list = tuple(blocks)
        self._blocks = {b.signature: b for b in blocks}
        self._by_name = {b.name: b for b in blocks}
        self._seq = int(seq)
        self._dtype = _DTYPES.get(int(dtype_bytes), "bf16")
        self._dtype_bytes = int(dtype_bytes)
        self._ops_dtype = TRACED if traced_dtypes else self._dtype
        self.cache = StrategyCache()
        self._ops: dict[tuple[str, int], tuple] = {}
        self._other_dtypes: dict[int, GraphCoster] = {}
        self._backward: dict[str, tuple[float, float] | None] = {}
        self._autocast_graph = autocast_graph
        self._autocast: list[GraphCoster | None] = []  # the autocast regime's coster, once made
        self._repriced: dict[tuple, BlockStrategy] = {}

    @property
    def dtype_bytes(self) -> int:
        """Bytes per activation / gradient element the ops are priced with (the traced dtype's unless made by
        ``with_dtype_bytes``)."""
        return self._dtype_bytes

    def with_dtype_bytes(self, dtype_bytes: int) -> "GraphCoster":
        """The same graph priced for another compute dtype (4: fp32, as ``autopar validate`` runs on CPUs
        without native bf16): activations, tp / cp / ep messages and memory-bound traffic at ``dtype_bytes`` per
        element, matmuls at that dtype's rate. One coster per dtype (its solved blocks kept)."""
        if int(dtype_bytes) == self._dtype_bytes:
            return self
        if int(dtype_bytes) not in _DTYPES:
            raise ConfigError(f"dtype_bytes={dtype_bytes}: choose one of {sorted(_DTYPES)} (bf16, fp32)")
        if dtype_bytes not in self._other_dtypes:
            self._other_dtypes[dtype_bytes] = GraphCoster(graph=self._graph, blocks=self._block_list, seq=self._seq,
                                                          dtype_bytes=dtype_bytes, autocast_graph=self._autocast_graph)
        return self._other_dtypes[dtype_bytes]

    def block_of(self, layer: LayerWork):
        block = self._blocks.get(layer.signature) if layer.signature else None
        block = block or self._by_name.get(layer.name)
        if block is None:
            raise ConfigError(f"no traced block for workload entry {layer.name!r} (signature "
                              f"{layer.signature[:12]!r}): build the workload and its coster from the same trace")
        return block

    def _layer_ops(self, block, microbatch: int) -> tuple:
        key = (block.signature, microbatch)
        if key not in self._ops:
            self._ops[key] = layer_ops_from_block(block, self._graph, microbatch=microbatch, seq=self._seq,
                                                  dtype=self._ops_dtype)
        return self._ops[key]

    def strategy(self, layer: LayerWork, ctx: LayerCtx) -> BlockStrategy:
        """The block's solved sharding in ``ctx`` (memoized): what ``__call__`` prices."""
        cost = cost_options(ctx)
        block = self.block_of(layer)
        try:
            return block_strategy(block, graph=self._graph, tp=ctx.tp, cp=ctx.cp, ep=ctx.ep,
                                  microbatch=ctx.microbatch, seq=self._seq, sequence_parallel=ctx.sp,
                                  recompute=ctx.recompute, cluster=ctx.cluster, device=ctx.device,
                                  dtype=self._dtype, cost=cost, cache=self.cache,
                                  ops=self._layer_ops(block, ctx.microbatch))
        except InfeasiblePlanError as e:  # e.g. no executable sequence-parallel sharding: the search skips it
            raise ConfigError(str(e)) from None

    def autocast_regime(self) -> "GraphCoster | None":
        """The coster of the graph's autocast regime (see the module docstring): this graph with each node's
        saved and backward bytes and its dtypes from ``autocast_graph``, its ops at those dtypes; made once.
        None when this coster prices fp32 compute (which runs without autocast), has no ``autocast_graph``, or
        that graph has no saved bytes or other nodes (a warning)."""
        if self._dtype_bytes != 2 or self._autocast_graph is None:
            return None
        if not self._autocast:
            graph = _as_run_in(self._graph, self._autocast_graph())
            self._autocast.append(None if graph is None else GraphCoster(
                graph=graph, blocks=self._block_list, seq=self._seq, dtype_bytes=self._dtype_bytes,
                traced_dtypes=True))
        return self._autocast[0]

    def repriced(self, layer: LayerWork, ctx: LayerCtx, s: BlockStrategy) -> BlockStrategy:
        """``s`` (solved by another coster of the same blocks for ``ctx``) priced over this coster's ops
        (``block_plan.reprice_strategy``); memoized."""
        block = self.block_of(layer)
        cost = cost_options(ctx)
        key = (block.signature or block.name, s.op_strategies, ctx.tp, ctx.cp, ctx.ep, ctx.microbatch, ctx.sp,
               ctx.recompute, cluster_key(ctx.cluster), getattr(ctx.device, "name", None), cost)
        if key not in self._repriced:
            self._repriced[key] = reprice_strategy(
                block, s, ops=self._layer_ops(block, ctx.microbatch), tp=ctx.tp, cp=ctx.cp, ep=ctx.ep,
                microbatch=ctx.microbatch, seq=self._seq, sequence_parallel=ctx.sp, recompute=ctx.recompute,
                cluster=ctx.cluster, device=ctx.device, dtype=self._dtype, cost=cost)
        return self._repriced[key]

    def backward_bytes(self, layer: LayerWork, full_activation_bytes: float) -> float:
        """Bytes the block's backward holds beyond its saved activations and parameter gradients (the traced
        ops' ``backward_bytes`` at their largest), under the solved sharding and micro-batch: scaled by the
        block's saved activations there (``full_activation_bytes``, what the ILP's layouts keep per device)
        over those traced. The gradients and temporaries of a backward have the shapes of the forward's
        tensors, sharded as they are."""
        traced = self._traced_backward(self.block_of(layer))
        if traced is None:
            return 0.0
        peak, saved = traced
        return peak * full_activation_bytes / saved

    def _traced_backward(self, block) -> tuple[float, float] | None:
        """(largest ``backward_bytes``, saved bytes) over the block's traced ops; None if not measured."""
        if block.name not in self._backward:
            nodes = {n.name: n for n in self._graph.nodes if n.block == block.name}
            ops = [nodes[o] for o in block.ops if o in nodes]
            peaks = [n.backward_bytes for n in ops if n.backward_bytes is not None]
            saved = sum(n.saved_bytes or 0.0 for n in ops)
            self._backward[block.name] = (max(peaks), saved) if peaks and saved > 0 else None
        return self._backward[block.name]

    def __call__(self, layer: LayerWork, ctx: LayerCtx) -> LayerCost:
        s = self.strategy(layer, ctx)
        regime = self.autocast_regime() if ctx.autocast else None
        if regime is not None:  # the sharding solved here, priced as that dtype regime runs it
            s = regime.repriced(layer, ctx, s)
        coster = regime or self
        cal = ctx.cluster.calibration
        d_f = d_b = 0.0
        if layer.kind != "embedding":  # framework time per pass (CPU calibrations; zero on GPUs)
            part = "model" if layer.kind == "head" else "layer"
            d_f, d_b = dispatch_time_s(part=part, device=ctx.device, calibration=cal, tensor_parallel=ctx.tp > 1,
                                       sequence_parallel=ctx.sp)
        rec = s.recompute_s + (d_f if ctx.recompute == "full" else 0.0)
        act, full = s.activation_bytes, s.full_activation_bytes
        working = full - act if ctx.recompute != "none" else 0.0
        if layer.kind not in ("embedding", "head"):  # the head's backward is its logits and loss, below
            working += coster.backward_bytes(layer, full)
        if layer.kind == "head":  # the logits, and what the target's loss holds per logit element at its peak
            k = ctx.constants  # over vocabulary-sharded logits (a vocab_head), the vocab-parallel loss's bytes
            vocab_parallel = any(st == "vocab_head" for _, st in s.op_strategies)
            per = k.vocab_parallel_loss_bytes_per_logit if vocab_parallel else k.loss_bytes_per_logit
            working += s.logits_bytes * (1.0 + per / self._dtype_bytes)
        host_f, host_b = expert_host_s(coster._ops[(self.block_of(layer).signature, ctx.microbatch)], ctx)
        if ctx.recompute == "full":  # the recomputed forward issues the experts' GEMMs again
            rec = max(s.recompute_s, host_f) + d_f
        return LayerCost(
            fwd_s=max(s.compute_fwd_s, host_f) + d_f, bwd_s=max(s.compute_bwd_s, host_b) + d_b, wgrad_s=s.wgrad_s,
            recompute_s=rec,
            comm_fwd=dict(s.comm_s.get("forward", {})), comm_bwd=dict(s.comm_s.get("backward", {})),
            comm_recompute=dict(s.comm_s.get("recompute", {})),
            activation_bytes=act, working_bytes=max(0.0, working),
            params=s.params_local, expert_params=s.expert_params_local,
            collectives=tuple(PricedCollective(axis=axis, op=op, nbytes=nbytes, phase=phase, count=n)
                              for phase, axis, op, nbytes, n in s.collectives),
            solver=dict(s.solver),
        )


def _as_run_in(graph, other):
    """``graph`` with each node's ``saved_bytes``, ``backward_bytes`` and input / output dtypes those of the node
    of the same name and op in ``other`` (the same model traced in another dtype regime); None (a warning) when
    ``other`` is None, has no saved bytes, or its nodes differ."""
    if other is None:
        return None
    same = [(n.name, n.target) for n in graph.nodes] == [(n.name, n.target) for n in other.nodes]
    if not same or all(n.saved_bytes is None for n in other.nodes):
        log.warning("the autocast trace has %s: its ranks' activations are priced from the bf16 trace",
                    "other ops" if not same else "no saved bytes")
        return None
    return replace(graph, nodes=tuple(replace(n, saved_bytes=o.saved_bytes, backward_bytes=o.backward_bytes,
                                              input_dtypes=o.input_dtypes, output_dtypes=o.output_dtypes)
                                      for n, o in zip(graph.nodes, other.nodes)))
