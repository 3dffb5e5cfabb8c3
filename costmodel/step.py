"""Step time, throughput and memory of one parallel configuration on one cluster.

``estimate_step(workload, config, cluster, target=)`` composes the pieces, with the execution target's constants
(``costmodel.targets.Target.constants``: kernels, overlaps, communication dtypes, precisions) and memory layout:

1. Layer times for one micro-batch on one device (``costmodel.layer_time``): compute plus the tp / cp / ep
   collectives each layer puts on the critical path; recomputation adds a forward (full: with its tp
   collectives; selective: the attention core). Pipeline rank ``r`` holds the contiguous ranks
   ``[r N / pp, (r + 1) N / pp)``; on a heterogeneous cluster each rank is priced on the node group that
   holds them (its accelerator, its intra-node links, its GPU memory; ``costmodel.rank_groups``), so a
   pipeline over an A100 and an H100 group has faster H100 stages. A rank whose devices straddle groups
   runs at the pace of the slowest of them, within the least memory.
2. Chunks: ``stage_layers`` consecutive workload entries per pipeline chunk (even by default: transformer
   layers spread evenly, the embedding on the first chunk, the head on the last). Chunk ``c`` runs on pipeline
   rank ``c % pp``. Pipeline time from ``costmodel.pipeline`` closed forms, with the p2p send/recv of
   ``b s h / tp`` activations (SC21 scatter/gather over the tp ranks' links) per hop.
3. Data parallel (over the dp x cp ranks that share weights): gradient all-reduce (ZeRO-0), reduce-scatter
   + parameter all-gather (ZeRO-1/2), or per-micro-batch parameter all-gathers in forward and before the
   backward (serving the recomputation too) plus gradient reduce-scatters (ZeRO-3), at the target's gradient and
   gather bytes per element (a quantized gather for fp8 parameters). Overlapped with the backward of the last
   micro-batch (ZeRO-1/2 with ``overlap_param_gather``: with its forward and backward; ZeRO-3: with all compute)
   when ``overlap_grad_reduce`` and the devices can overlap (not
   CPU ranks that keep every core busy, per the calibration):
   ``exposed = max(0, comm - window) + k min(comm, window)`` (``StepConstants.overlap_slowdown``).
4. Optimizer: Adam over the device's (ZeRO-sharded) parameters, memory-bound, on each rank's device.
5. Memory per pipeline rank (``costmodel.memory``) with the schedule's in-flight micro-batches, checked
   against that rank's own device memory; model states in the target's layout (``[memory.*]``) plus the
   precision's quantized weight copies.

Speed: the per-workload structure (distinct layers, one tuple per layer tuple whatever the cut, and their count
per chunk) is memoized by the identity of the immutable ``workload.layers`` tuple. The pure pieces of a call are
memoized too (``functools.lru_cache`` on hashable keys, the workload and cluster by identity): the layer table per
layer context (micro-batch, tp, cp, ep, sp, recomputation, flash; one key object per context), the per-chunk sums
per context and cut, the pipeline time per (schedule, pp, v, micro-batches, dp), the data-parallel collectives and
the concurrent-traffic slowdown per rank's parameters and position within its node, the FLOPs, the per-rank
devices, the target's memory modes per the facts they test, the model states per the ranks' parameters and the
chunk tables folded onto the ranks per (table, v, pp). Cached arrays are read-only. The GPT-3 175B search on
1,024 A100s (9,906 calls) spends ~0.45 ms CPU per call in its explore phase (block ILPs included) on the 2-core
machine.

FLOPs: ``model_tflops_per_gpu`` counts forward + backward of the workload (6N + attention, SC21 Eq. 3's 72 form
for GPT); ``hw_tflops_per_gpu`` adds what recomputation re-runs (the 96 form with full recomputation), the
figure SC21 reports. ``mfu`` = model FLOPs / (step time x the devices' summed dense bf16 peak).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from costmodel.memo import ByIdentity
from costmodel.rank_groups import rank_clusters, slowest_device
from costmodel import memory as mem
from costmodel import pipeline as pl
from costmodel.collectives import ring_terms
from costmodel.comm import CommEfficiency, DEFAULT_EFFICIENCY, Collective, Group, collective_time_s, concurrent_times_s
from costmodel.compute import fsdp_unit_time_s, op_time_s
from costmodel.errors import ConfigError
from costmodel.hardware import Cluster
from costmodel.block_cost import LayerCtx
from costmodel.step_config import (ParallelConfig, StepConstants, check_recompute_layers, check_stage_layers,
                                   validate_config)
from costmodel.targets import Target, config_facts, load_target
from costmodel.workload import Workload

__all__ = ["ParallelConfig", "StepEstimate", "StepConstants", "Target", "default_target", "estimate_step",
           "even_stage_layers", "layer_contexts", "priced_collectives"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepEstimate:
    """What one optimizer step costs. ``breakdown_s`` sums to ``step_time_s``."""

    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hw_tflops_per_gpu: float
    mfu: float
    memory_gb_per_device: float
    """The largest over pipeline ranks."""
    fits: bool
    breakdown_s: dict[str, float]
    memory_breakdown_gb: dict[str, float]
    """Of the rank with the most memory."""
    bottleneck: str
    stage_time_s: tuple[float, ...]
    """Per pipeline rank: forward + backward (+ recompute) of one micro-batch through all its chunks, on the
    rank's own accelerator."""
    stage_memory_gb: tuple[float, ...]
    config: ParallelConfig
    """The configuration priced, with chosen micro-batch / virtual stages filled in."""
    num_microbatches: int
    stage_layers: tuple[int, ...]
    memory: mem.MemoryEstimate
    chosen: dict[str, int] = field(default_factory=dict)
    """Options the caller left as None and this estimate chose (``microbatch``, ``virtual_stages``)."""
    memory_limit_gb: float = 0.0
    """The least device memory over pipeline ranks."""
    stage_memory_limit_gb: tuple[float, ...] = ()
    """Per pipeline rank: the device memory of the node group(s) its devices sit in."""
    stage_device: tuple[str, ...] = ()
    """Per pipeline rank: the accelerator its stage is priced on (the slowest of the groups it spans)."""
    pipeline_s: float = 0.0
    """The pipeline's time (every micro-batch through every stage, bubbles and p2p hops included)."""
    stage_rest_s: tuple[float, ...] = ()
    """Per pipeline rank: its exposed data-parallel traffic plus its optimizer step. ``step_time_s`` is
    ``pipeline_s`` plus the largest exposed traffic plus the largest optimizer step, so
    ``pipeline_s + max(stage_rest_s) <= step_time_s``."""


def _even_stage_layers(kinds: list[str], chunks: int) -> tuple[int, ...]:
    tr = [i for i, k in enumerate(kinds) if k == "transformer"]
    if len(tr) < chunks:
        raise ConfigError(
            f"{len(tr)} transformer layers cannot fill pp*virtual_stages={chunks} chunks; "
            f"use pp*virtual_stages <= {len(tr)}"
        )
    per, extra = divmod(len(tr), chunks)
    sizes = [per + (1 if c < extra else 0) for c in range(chunks)]
    chunk_of_tr = np.repeat(np.arange(chunks), sizes)
    owner = np.empty(len(kinds), dtype=np.int64)
    current, seen = 0, 0
    for i, kind in enumerate(kinds):
        if kind == "transformer":
            current = int(chunk_of_tr[seen])
            seen += 1
        owner[i] = current
    return tuple(int(x) for x in np.bincount(owner, minlength=chunks))


def _class_of(classes: tuple[int, ...], r: int) -> int:
    return classes[r] if classes else 0


def _layer_key(layer) -> tuple:
    return (layer.kind, layer.signature, layer.params, layer.flops_fwd, layer.flops_bwd, layer.attn_flops_fwd,
            layer.bytes_fwd, layer.expert_params)



@dataclass(frozen=True, slots=True)
class _CtxKey:
    """What a ``LayerCtx`` is made of, hashable (workload and cluster by identity): a memo key."""

    workload: ByIdentity
    cluster: ByIdentity
    microbatch: int
    tp: int
    cp: int
    ep: int
    sp: bool
    recompute: str
    flash: bool
    constants: StepConstants
    precision: str = "bf16"
    autocast: bool = False
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    """The fields' hash, computed once: every memo lookup of a call hashes its keys (the constants are ~50
    fields)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.workload, self.cluster, self.microbatch, self.tp, self.cp,
                                                 self.ep, self.sp, self.recompute, self.flash, self.constants,
                                                 self.precision, self.autocast)))

    def __hash__(self) -> int:
        return self._hash

    def ctx(self) -> LayerCtx:
        cluster = self.cluster.obj
        return LayerCtx(device=slowest_device(cluster), cluster=cluster, microbatch=self.microbatch, tp=self.tp,
                        cp=self.cp, ep=self.ep, sp=self.sp, recompute=self.recompute, flash=self.flash,
                        constants=self.constants, precision=self.precision, autocast=self.autocast)


@functools.lru_cache(maxsize=64)
def _distinct_cached(layers: ByIdentity) -> tuple[tuple, np.ndarray]:
    """The distinct layers of a layer tuple (first seen first) and each entry's index among them: one tuple
    per workload, whatever the cut, so the memos keyed by it (``_layer_columns``) serve every cut."""
    index: dict[tuple, int] = {}
    uniques, ids = [], []
    for layer in layers.obj:
        key = _layer_key(layer)
        if key not in index:
            index[key] = len(uniques)
            uniques.append(layer)
        ids.append(index[key])
    out = np.asarray(ids, dtype=np.int64)
    out.setflags(write=False)
    return tuple(uniques), out


@functools.lru_cache(maxsize=256)
def _structure_cached(layers: ByIdentity, stage_layers: tuple[int, ...]) -> tuple[tuple, np.ndarray]:
    uniques, ids = _distinct_cached(layers)
    owner = np.repeat(np.arange(len(stage_layers)), stage_layers)
    counts = np.zeros((len(stage_layers), len(uniques)))
    np.add.at(counts, (owner, ids), 1.0)
    counts.setflags(write=False)
    return uniques, counts


def _structure(workload: Workload, stage_layers: tuple[int, ...]) -> tuple[tuple, np.ndarray]:
    """Distinct layers and how many of each every chunk holds: (layers, counts (chunks, distinct)).

    Memoized per layer tuple (immutable) and cut: the planner prices one workload 10^4 times."""
    return _structure_cached(ByIdentity(workload.layers), tuple(stage_layers))


@functools.lru_cache(maxsize=4096)
def _recompute_mask_cached(layers: ByIdentity, stage_layers: tuple[int, ...],
                           recompute_layers: tuple[int, ...] | None) -> tuple[bool, ...]:
    entries = layers.obj
    mask, start = [], 0
    for c, n in enumerate(stage_layers):
        left = None if recompute_layers is None else recompute_layers[c]
        for layer in entries[start:start + n]:
            on = layer.recomputable and (left is None or left > 0)
            if on and left is not None:
                left -= 1
            mask.append(on)
        start += n
    return tuple(mask)


def recompute_mask(workload: Workload, stage_layers: tuple[int, ...], cfg: ParallelConfig) -> tuple[bool, ...]:
    """Per workload entry: whether it runs with ``cfg.recompute`` (the first ``recompute_layers[c]`` recomputable
    entries of chunk ``c``; all of them when ``recompute_layers`` is None; none when the mode is ``none``)."""
    if cfg.recompute == "none":
        return (False,) * len(workload.layers)
    rl = None if cfg.recompute_layers is None else tuple(int(x) for x in cfg.recompute_layers)
    return _recompute_mask_cached(ByIdentity(workload.layers), tuple(stage_layers), rl)


@functools.lru_cache(maxsize=4096)
def _split_cached(layers: ByIdentity, stage_layers: tuple[int, ...], mask: tuple[bool, ...]
                  ) -> tuple[np.ndarray, np.ndarray]:
    uniques, counts = _structure_cached(layers, stage_layers)
    _, ids = _distinct_cached(layers)
    owner = np.repeat(np.arange(len(stage_layers)), stage_layers)
    on = np.asarray(mask, dtype=bool)
    rec = np.zeros_like(counts)
    np.add.at(rec, (owner[on], ids[on]), 1.0)
    plain = counts - rec
    for a in (plain, rec):
        a.setflags(write=False)
    return plain, rec


def _split(workload: Workload, stage_layers: tuple[int, ...], mask: tuple[bool, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(plain, recomputed) counts (chunks, distinct layers): how many of each distinct layer every chunk runs
    without and with recomputation."""
    return _split_cached(ByIdentity(workload.layers), tuple(stage_layers), mask)


@functools.lru_cache(maxsize=256)
def _even_cached(layers: ByIdentity, chunks: int) -> tuple[int, ...]:
    return _even_stage_layers([layer.kind for layer in layers.obj], chunks)


def even_stage_layers(workload: Workload, chunks: int) -> tuple[int, ...]:
    """Workload entries per chunk: transformer layers spread evenly (earlier chunks take the remainder), the
    entries before the first transformer layer on chunk 0, the others with the transformer layer before them."""
    return _even_cached(ByIdentity(workload.layers), int(chunks))


_MAX_COLUMNS = ("work", "head_work", "maxparams", "maxxparams", "maxact")
"""Columns a chunk takes the largest of (transient bytes, the largest block's parameters and activations), not
the sum."""


@functools.lru_cache(maxsize=4096)
def _layer_columns(uniques: ByIdentity, ctx_key: _CtxKey) -> tuple[tuple[str, ...], np.ndarray]:
    """Column names and the (columns, distinct layers) table of one layer context, from the workload's coster
    (pure: memoized): seconds (fwd, bwd, wgrad, rec, cf:/cb: comm per link kind), bytes (act: kept for the
    backward; work / head_work: transient) and parameters per device (params, xparams: experts)."""
    workload = ctx_key.workload.obj
    if workload.coster is None:
        raise ConfigError(f"workload {workload.name!r} has no block coster: build it with planner.workload "
                          "(traced) or costmodel.analytic (closed-form oracle)")
    ctx = ctx_key.ctx()
    rows = [workload.coster(layer, ctx) for layer in uniques.obj]
    kinds = sorted({k for r in rows for d in (r.comm_fwd, r.comm_bwd, r.comm_recompute) for k in d})
    is_head = [layer.kind == "head" for layer in uniques.obj]
    cols = {
        "fwd": [r.fwd_s for r in rows], "bwd": [r.bwd_s for r in rows],
        "wgrad": [r.wgrad_s for r in rows], "rec": [r.recompute_s for r in rows],
        "act": [r.activation_bytes for r in rows],
        "work": [0.0 if h else r.working_bytes for r, h in zip(rows, is_head)],
        "head_work": [r.working_bytes if h else 0.0 for r, h in zip(rows, is_head)],
        "params": [r.params for r in rows], "xparams": [r.expert_params for r in rows],
        "maxparams": [0.0 if layer.kind in ("embedding", "head") else r.params
                      for r, layer in zip(rows, uniques.obj)],
        "maxxparams": [0.0 if layer.kind in ("embedding", "head") else r.expert_params
                       for r, layer in zip(rows, uniques.obj)],
        "rootparams": [r.params if layer.kind in ("embedding", "head") else 0.0
                       for r, layer in zip(rows, uniques.obj)],
        # the parameters autocast casts for its matmuls: all but the token embedding's (a lookup, not cast)
        "castparams": [0.0 if layer.kind == "embedding" else r.params + r.expert_params
                       for r, layer in zip(rows, uniques.obj)],
        "maxact": [0.0 if layer.kind in ("embedding", "head") else r.activation_bytes
                   for r, layer in zip(rows, uniques.obj)],
        # a vocab-sharded embedding's gradient is the whole table (DTensor's embedding backward under
        # RowwiseParallel, torch 2.13): the parameters its gradient holds beyond the rank's shard
        "embgrad": [max(0.0, layer.params - r.params) if layer.kind == "embedding" else 0.0
                    for r, layer in zip(rows, uniques.obj)],
    }
    for k in kinds:
        cols[f"cf:{k}"] = [r.comm_fwd.get(k, 0.0) for r in rows]
        cols[f"cb:{k}"] = [r.comm_bwd.get(k, 0.0) + r.comm_recompute.get(k, 0.0) for r in rows]
    names = tuple(cols)
    table = np.array([cols[n] for n in names], dtype=float)
    table.setflags(write=False)
    return names, table


@functools.lru_cache(maxsize=4096)
def _plain_key(ctx_key: _CtxKey) -> _CtxKey:
    """``ctx_key`` without recomputation (memoized: one key object per context, hashed once)."""
    return ctx_key if ctx_key.recompute == "none" else dataclasses.replace(ctx_key, recompute="none")


@functools.lru_cache(maxsize=4096)
def _column_plan(uniques: ByIdentity, ctx_key: _CtxKey) -> tuple[tuple[str, ...], np.ndarray, tuple[bool, ...],
                                                                   tuple[int, ...], np.ndarray]:
    """``_layer_columns`` with what ``_chunk_cached`` reads of it: names, table, per column whether it is one of
    the ``_MAX_COLUMNS``, their indices and their rows broadcast over chunks (memoized: one per context)."""
    names, cols = _layer_columns(uniques, ctx_key)
    is_max = tuple(n in _MAX_COLUMNS for n in names)
    at = tuple(i for i, m in enumerate(is_max) if m)
    rows = cols[list(at)][:, None, :]
    rows.setflags(write=False)
    return names, cols, is_max, at, rows


@functools.lru_cache(maxsize=4096)
def _chunk_cached(ctx_key: _CtxKey, stage_layers: tuple[int, ...], mask: tuple[bool, ...]) -> dict[str, np.ndarray]:
    uniques, _ = _structure(ctx_key.workload.obj, stage_layers)
    plain, rec = _split(ctx_key.workload.obj, stage_layers, mask)
    parts = [(plain, _plain_key(ctx_key))]
    if rec.any():
        parts.append((rec, ctx_key))
    out: dict[str, np.ndarray] = {}
    for counts, key in parts:
        names, cols, is_max, at, rows = _column_plan(ByIdentity(uniques), key)
        table = (counts @ cols.T).T  # (columns, chunks)
        # the _MAX_COLUMNS take the largest of the distinct layers the chunk holds (all at once: (max columns, chunks))
        largest = dict(zip(at, np.where(counts[None, :, :] > 0, rows, 0.0).max(axis=2)))
        for i, n in enumerate(names):
            if is_max[i]:
                out[n] = np.maximum(out[n], largest[i]) if n in out else largest[i]
            else:
                out[n] = out[n] + table[i] if n in out else table[i]
    for a in out.values():
        a.setflags(write=False)
    return out


def _chunk_arrays(ctx_key: _CtxKey, stage_layers: tuple[int, ...], mask: tuple[bool, ...]) -> dict[str, np.ndarray]:
    """Per chunk: fwd, bwd, wgrad, recompute seconds and exposed comm seconds per link kind (cf:/cb:), the
    entries of ``mask`` priced with the context's recomputation, the others without.

    Read-only arrays, memoized per layer context, cut and recompute mask (the planner prices one context many
    times)."""
    return _chunk_cached(ctx_key, stage_layers, mask)


def p2p_boundary_bytes(workload: Workload, *, mb: int, tp: int, cp: int, sp: bool, k: StepConstants) -> float:
    """Bytes of the activation one rank sends from a pipeline stage to the next (and of the gradient it gets
    back, and of each receive buffer): ``(mb, seq / cp, hidden)`` divided as the target's ``p2p_boundary`` says."""
    return mb * workload.seq / cp * workload.hidden * workload.dtype_bytes / k.boundary_divisor(tp=tp, sp=sp)


def _p2p_s(workload: Workload, cluster: Cluster, *, pp: int, mb: int, tp: int, cp: int, sp: bool, dp: int,
           k: StepConstants) -> tuple[str, float]:
    if pp == 1:
        return "", 0.0
    nbytes = p2p_boundary_bytes(workload, mb=mb, tp=tp, cp=cp, sp=sp, k=k)
    cc = collective_time_s("send_recv", nbytes, Group(size=2, stride=tp * cp * dp), cluster)
    return cc.link_kind, cc.time_s


def _per_rank(a: np.ndarray, v: int, pp: int, how: str = "sum") -> np.ndarray:
    """A per-chunk array folded onto the pipeline ranks (chunk ``c`` runs on rank ``c % pp``)."""
    a = np.asarray(a)
    if v == 1 and a.ndim == 1 and a.dtype == np.float64:  # one chunk per rank: a reduction over one row is the row
        if not a.flags.writeable:
            return a
        out = a.copy()
    else:
        grid = a.reshape(v, pp)
        out = grid.max(axis=0) if how == "max" else grid.sum(axis=0)
    out.setflags(write=False)
    return out


def _flat_nic_time_s(op: str, nbytes: float, n: int, cluster: Cluster, eff: CommEfficiency) -> tuple[str, float]:
    """A flat ring at each GPU's own NIC rate (ZeRO-3 across nodes, ``StepConstants.zero3_flat_nic``)."""
    node = min((g.node for g in cluster.groups), key=lambda t: t.nic_gbps_per_gpu * eff.of(t.nic.kind))
    steps, factor = ring_terms(op, n)
    bw = node.nic_gbps_per_gpu * eff.of(node.nic.kind) * 1e9
    return node.nic.kind, steps * node.nic.latency_s + factor * nbytes / bw


def _dp_collective(op: str, nbytes: float, group: Group, cluster: Cluster, *, flat: bool) -> tuple[str, float]:
    if group.size == 1 or nbytes <= 0:
        return "", 0.0
    spans_nodes = group.size * group.stride > cluster.gpus_per_node
    if flat and spans_nodes:
        return _flat_nic_time_s(op, nbytes, group.size, cluster, DEFAULT_EFFICIENCY)
    cc = collective_time_s(op, nbytes, group, cluster)
    return cc.link_kind, cc.time_s


def dp_collectives(*, params: float, expert_params: float, bytes_per_param: float, m: int, k: StepConstants,
                   zero_stage: int, recompute: str, layers: int, gather_bytes_per_param: float | None = None,
                   tensor_parallel: bool = False) -> tuple[tuple[str, str, float, int], ...]:
    """The data-parallel collectives one pipeline rank issues per step: ``(group, op, bytes each, count)``
    with ``group`` ``dense`` (over dp x cp) or ``expert`` (over dp / ep x cp). What ``_dp_comm`` times and
    ``priced_collectives`` lists. ``bytes_per_param``: of the gradient reductions; ``gather_bytes_per_param``:
    of the parameter all-gathers (None: the same; a quantized gather moves fewer, ``dp_bytes``).

    ZeRO-1 / 2 gather once a step and reduce once (ZeRO-2 ``m`` times where the target reduces every
    micro-batch, ``StepConstants.zero2_reduce_per_microbatch``).
    ZeRO-3 gathers and reduces parameters module by module: ``layers`` transformer layers on the rank times
    ``StepConstants.zero3_collectives_per_layer`` collectives per pass, plus one for the rank's other entries
    (embedding, head; not for the expert parameters, which sit in their layers), each on its share of the bytes;
    ZeRO-1/2 too where the target shards in units
    (``StepConstants.zero12_per_unit``: FSDP2). ZeRO-0 all-reduces once per step, in ``ddp_buckets``; with
    ``tensor_parallel`` under that FSDP2 runtime, once per unit (DTensor parameters: FSDP2's ``replicate``
    instead of DDP, which reduces on the step's last micro-batch as ZeRO-1 does). Where no wrapper runs (ZeRO-0
    in a pipeline or with expert parallel) the runtime averages by hand in the same buckets as DDP
    (``runtime.data_parallel.average_gradients``)."""
    out = []
    for group, n in (("dense", params), ("expert", expert_params)):
        if n <= 0:
            continue
        per_unit = zero_stage == 3 or (zero_stage in (1, 2) and k.zero12_per_unit)
        # the root unit (embedding, head) holds no experts: expert parameters are in their layers' units
        units = max(1, layers * k.zero3_collectives_per_layer + (1 if group == "dense" else 0)) if per_unit else 1
        if zero_stage == 0 and tensor_parallel and k.zero12_per_unit:
            units, parts = layers * k.zero3_collectives_per_layer + 1, [("all_reduce", 1)]
        elif zero_stage == 0:
            units, parts = ddp_buckets(n * bytes_per_param, k), [("all_reduce", 1)]
        elif zero_stage in (1, 2):
            reduces = m if zero_stage == 2 and k.zero2_reduce_per_microbatch else 1
            parts = [("reduce_scatter", reduces), ("all_gather", 1)]
        else:
            gathers = 2 + (1 if recompute == "full" and k.zero3_passes_recompute else 0)
            parts = [("all_gather", gathers * m), ("reduce_scatter", m)]
        per = {"all_gather": bytes_per_param if gather_bytes_per_param is None else gather_bytes_per_param}
        out += [(group, op, n * per.get(op, bytes_per_param) / units, units * times) for op, times in parts]
    return tuple(out)


def _tp_sharded(workload: Workload, cfg: ParallelConfig, dense_per_device: float) -> bool:
    """Whether the ZeRO-0 gradients are reduced per FSDP2 unit (``dp_collectives`` ``tensor_parallel``): tensor
    parallelism splits a dense parameter (``dense_per_device``: the devices' dense parameters summed over pipeline
    ranks, below the model's), so the runtime's parameters are DTensors, and a wrapper reduces them: not where
    the runtime averages by hand in DDP's buckets (ZeRO-0 in a pipeline or with expert parallel:
    ``runtime.data_parallel.averages_by_hand``)."""
    if cfg.zero_stage == 0 and (cfg.pp > 1 or cfg.ep > 1):
        return False
    return cfg.tp > 1 and dense_per_device < _dense_params(ByIdentity(workload.layers)) * (1.0 - 1e-9)


@functools.lru_cache(maxsize=64)
def _dense_params(layers: ByIdentity) -> float:
    """The model's dense (non-expert) parameters (memoized per layer tuple)."""
    return sum(layer.params - layer.expert_params for layer in layers.obj)


def ddp_buckets(nbytes: float, k: StepConstants) -> int:
    """All-reduces of ``nbytes`` of ZeRO-0 gradients: a first bucket of ``k.first_bucket_bytes`` and the rest in
    buckets of ``k.last_bucket_bytes`` (torch DDP fills each until it reaches its cap: parameter boundaries make
    real buckets a little larger, so this counts at most one too many); one without ``first_bucket_bytes``."""
    rest = nbytes - k.first_bucket_bytes
    if k.first_bucket_bytes <= 0 or rest <= 0 or k.last_bucket_bytes <= 0:
        return 1
    return 1 + math.ceil(rest / k.last_bucket_bytes)


def dp_bytes(workload: Workload, cfg: ParallelConfig, k: StepConstants) -> tuple[float, float]:
    """Bytes per element of the data-parallel gradient reduction and of the parameter all-gather: the target's
    (None there: the workload's own), the precision's quantized gather where it has one."""
    own = float(workload.dtype_bytes)
    gather = k.precision(cfg.precision).param_gather_bytes or k.param_gather_bytes
    return k.grad_reduce_bytes or own, gather or own


@functools.lru_cache(maxsize=16384)
def _dp_comm(wb: tuple[float, float], cluster: ByIdentity, dense: float, expert: float, m: int, k: StepConstants, *,
             dp: int, cp: int, tp: int, ep: int, zero_stage: int, recompute: str, layers: int,
             tp_sharded: bool = False) -> tuple[str, float]:
    """Seconds of data-parallel traffic per step for one pipeline rank (``dp_collectives``), and its link kind
    (pure: memoized)."""
    groups = {"dense": Group(size=dp * cp, stride=tp), "expert": Group(size=max(1, dp // ep) * cp, stride=tp * ep)}
    total, kind, largest = 0.0, "", 0.0
    for group, op, nbytes, count in dp_collectives(params=dense, expert_params=expert, bytes_per_param=wb[0], m=m,
                                                    k=k, zero_stage=zero_stage, recompute=recompute, layers=layers,
                                                    gather_bytes_per_param=wb[1], tensor_parallel=tp_sharded):
        lk, t = _dp_collective(op, nbytes, groups[group], cluster.obj, flat=zero_stage == 3 and k.zero3_flat_nic)
        if t * count > largest:  # the link kind of the largest contribution names the traffic
            kind, largest = lk, t * count
        total += t * count
    return kind, total


def _exposed(comm_s: float, window_s: float, k: StepConstants) -> float:
    return max(0.0, comm_s - window_s) + k.overlap_slowdown * min(comm_s, window_s)


def _merged_chunk_arrays(parts: tuple[_CtxKey, ...], classes: tuple[int, ...],
                         stage_layers: tuple[int, ...], mask: tuple[bool, ...]) -> dict[str, np.ndarray]:
    """Chunk arrays when pipeline ranks sit on different node groups: chunk ``c`` takes its values from the
    layer context of rank ``c % pp``'s group (link kinds missing from a group's table are zero there)."""
    n, pp = len(stage_layers), len(classes)
    tables = [_chunk_arrays(k, stage_layers, mask) for k in parts]
    owner = np.array([classes[c % pp] for c in range(n)])
    names = list(tables[0]) + sorted({key for t in tables[1:] for key in t} - set(tables[0]))
    zero = np.zeros(n)
    return {key: np.stack([t.get(key, zero) for t in tables])[owner, np.arange(n)] for key in names}


@functools.lru_cache(maxsize=4096)
def _chunk_sums(parts: tuple[_CtxKey, ...], classes: tuple[int, ...], stage_layers: tuple[int, ...],
                mask: tuple[bool, ...]) -> tuple:
    """The chunk arrays, per chunk F and B (+ recompute) seconds with their comm, compute seconds and the
    comm seconds per link kind (F + B): what ``_pipeline`` needs of the layers, whatever the schedule.

    ``parts``: one layer context per node-group part of the cluster; ``classes``: per pipeline rank, its part
    (``()``: all in part 0)."""
    if classes:
        ch = _merged_chunk_arrays(parts, classes, stage_layers, mask)
    else:
        ch = _chunk_arrays(parts[0], stage_layers, mask)
    n = len(stage_layers)
    kinds = sorted({key[3:] for key in ch if key.startswith(("cf:", "cb:"))})
    comm_f = {kd: ch.get(f"cf:{kd}", np.zeros(n)) for kd in kinds}
    comm_b = {kd: ch.get(f"cb:{kd}", np.zeros(n)) for kd in kinds}
    tf = ch["fwd"] + sum(comm_f.values(), np.zeros(n))
    tb = ch["bwd"] + ch["rec"] + sum(comm_b.values(), np.zeros(n))
    compute = ch["fwd"] + ch["bwd"] + ch["rec"]
    comm = {kd: comm_f[kd] + comm_b[kd] for kd in kinds}
    for a in (tf, tb, compute, *comm.values()):
        a.setflags(write=False)
    return ch, tf, tb, compute, comm


@functools.lru_cache(maxsize=4096)
def _pipeline(parts: tuple[_CtxKey, ...], classes: tuple[int, ...], cluster: ByIdentity,
              stage_layers: tuple[int, ...], mask: tuple[bool, ...], *, schedule: str, pp: int, v: int, m: int,
              dp: int) -> dict:
    """Per-chunk F / B / W seconds, the pipeline time and the busiest rank's split of its work.

    Memoized (pure); callers copy ``parts`` before changing it and never write to the arrays. The p2p hops
    between ranks are priced on the whole ``cluster`` (they may cross node groups)."""
    ctx_key = parts[0]
    ch, tf, tb, compute, comm = _chunk_sums(parts, classes, stage_layers, mask)
    tw = np.zeros(pp * v)
    if schedule == "zero-bubble":
        tw = ch["wgrad"]
        tb = tb - tw
    p2p_kind, p2p = _p2p_s(ctx_key.workload.obj, cluster.obj, pp=pp, mb=ctx_key.microbatch, tp=ctx_key.tp,
                           cp=ctx_key.cp, sp=ctx_key.sp, dp=dp, k=ctx_key.constants)
    no_p2p, hops = pl._closed_form_terms(schedule, pp=pp, m=m, v=v, tf=tf, tb=tb, tw=tw)
    per_rank = (tf + tb + tw).reshape(v, pp).sum(axis=0)
    r = int(np.argmax(per_rank))
    # the bubble's work runs on fewer busy ranks: on shared CPU cores, faster (bubble_rate_factor)
    no_p2p = m * float(per_rank[r]) + (no_p2p - m * float(per_rank[r])) * bubble_rate_factor(cluster.obj, pp)
    total = no_p2p + hops * p2p  # = pl._closed_form_s(..., p2p_s=p2p) on dedicated devices
    on_rank = lambda a: float(a.reshape(v, pp)[:, r].sum())  # noqa: E731
    parts = {"compute": m * on_rank(compute)}
    for kd, a in comm.items():
        parts[f"comm_{kd}"] = m * on_rank(a)
    parts["bubble"] = no_p2p - m * float(per_rank[r])
    if p2p_kind:
        parts[f"comm_{p2p_kind}"] = parts.get(f"comm_{p2p_kind}", 0.0) + total - no_p2p
    bwd_rank = (tb + tw).reshape(v, pp).sum(axis=0)
    per_rank.setflags(write=False)
    bwd_rank.setflags(write=False)
    return {"total_s": total, "per_rank_s": per_rank, "parts": parts, "p2p_kind": p2p_kind, "bwd_rank_s": bwd_rank,
            "chunks": ch}


# --- concurrent traffic (costmodel.comm.concurrent_times_s): the overlapped gradient reduction shares links
# with the pipeline sends of the same backward window.
def _pipeline_traffic_slowdown(workload: Workload, cfg: ParallelConfig, parts: tuple[Cluster, ...], rank: int, *,
                               dense: float, k: StepConstants) -> float:
    """How much longer pipeline rank ``rank``'s data-parallel gradient reduction takes because the pipeline
    sends of the backward it overlaps (one per chunk of the rank, to the next rank) run on the same links at
    the same time: the reduction of the dense gradient priced alone and beside those sends. 1 without a
    pipeline, on the last rank, or on clusters of several node groups."""
    if cfg.pp == 1 or cfg.dp * cfg.cp == 1 or rank == cfg.pp - 1 or len(parts) != 1 or len(parts[0].groups) != 1:
        return 1.0
    send = p2p_boundary_bytes(workload, mb=cfg.microbatch, tp=cfg.tp, cp=cfg.cp,
                              sp=cfg.sequence_parallel and cfg.tp > 1, k=k)
    op = "all_reduce" if cfg.zero_stage == 0 else "reduce_scatter"
    return _traffic_slowdown_at(ByIdentity(parts[0]), op, dense * workload.dtype_bytes, cfg.virtual_stages * send,
                                cfg.tp, cfg.cp, cfg.dp, rank)


def _traffic_slowdown_at(cluster_id: ByIdentity, op: str, grad_bytes: float, send_bytes: float, tp: int, cp: int,
                         dp: int, rank: int) -> float:
    """``_traffic_slowdown_cached`` with the rank's first device moved down by whole nodes: on one node group
    (the only case priced) ranks ``first`` and ``first - q * gpus_per_node`` lie alike on their nodes (the
    same placements, the same overlaps between the two collectives), so every rank of a stride that is a
    multiple of the node shares one entry. The caller keeps ``rank < pp - 1``, so ``first + stride`` is within
    the cluster for the shifted rank too."""
    stride = tp * cp * dp
    return _traffic_slowdown_cached(cluster_id, op, grad_bytes, send_bytes, tp, cp, dp,
                                    (rank * stride) % cluster_id.obj.gpus_per_node)


@functools.lru_cache(maxsize=16384)
def _traffic_slowdown_cached(cluster_id: ByIdentity, op: str, grad_bytes: float, send_bytes: float, tp: int,
                             cp: int, dp: int, first: int) -> float:
    """``_pipeline_traffic_slowdown`` past its trivial cases for the pipeline rank whose first device is
    ``first`` (pure: memoized, the cluster by identity)."""
    cluster = cluster_id.obj
    stride = tp * cp * dp
    grads = Collective(op=op, nbytes=grad_bytes, group=Group(size=dp * cp, stride=tp), first_rank=first)
    sends = Collective(op="send_recv", nbytes=send_bytes, group=Group(size=2, stride=stride), first_rank=first)
    if grads.nbytes <= 0 or first + stride >= cluster.num_devices:
        return 1.0
    alone = collective_time_s(grads.op, grads.nbytes, grads.group, cluster, first_rank=first).time_s
    shared = concurrent_times_s((grads, sends), cluster)[0].time_s
    return shared / alone if alone > 0 else 1.0


def bubble_rate_factor(cluster: Cluster, pp: int) -> float:
    """How long the pipeline bubble takes relative to its work priced at the all-ranks-busy rate.

    Each chunk's F / B is priced at the rate of a rank with all ``R`` local ranks busy
    (``costmodel.calibration.shared_by``). In the fill and drain only some stages work: in the j-th of the
    ``pp - 1`` slots the critical rank waits, ``j`` of ``pp`` stages (of every data-parallel replica) are busy,
    and where ranks outnumber the cores (processor sharing) the idle ranks leave their cores to them, so that
    slot's work runs at ``rank_share(ceil(R j / pp))`` rather than ``rank_share(R)``. The factor is the mean over
    the slots of ``rank_share(R) / rank_share(busy_j)``: 1 on accelerators and where the cores suffice; 0.5 for
    pp=2 with 4 ranks on 2 cores. Measured: ``autopar validate --calibrate --in-turns`` on 4 gloo ranks on 2
    cores (llama layers=2 hidden=256, pp2 x dp2 1F1B mb2x2): step 0.085 s with a bubble priced at 25 ms at the
    all-busy rate and 0.104 s predicted (+23%) before this factor."""
    cal = cluster.calibration
    if cal is None or cal.cpu_cores <= 0 or pp <= 1:
        return 1.0
    ranks = max(g.node.gpus_per_node for g in cluster.groups)
    every = cal.rank_share(ranks)
    slots = [every / cal.rank_share(max(1, math.ceil(ranks * j / pp))) for j in range(1, pp)]
    return float(sum(slots) / len(slots))


def _can_overlap(cluster: Cluster) -> bool:
    """False where a CPU calibration says the local ranks keep every core busy: nothing runs the collectives
    beside the compute, so overlapped gradient traffic is exposed whole."""
    cal = cluster.calibration
    ranks = max(g.node.gpus_per_node for g in cluster.groups)
    return cal is None or cal.overlaps_communication(ranks)


@functools.lru_cache(maxsize=256)
def _can_overlap_cached(cluster_id: ByIdentity) -> bool:
    """``_can_overlap`` (memoized, the cluster by identity)."""
    return _can_overlap(cluster_id.obj)


@functools.lru_cache(maxsize=16384)
def _optimizer_s(part_id: ByIdentity, params: float, bytes_per_param: float) -> float:
    """Adam's step over ``params`` parameters on the slowest device of the node-group part: memory-bound
    (memoized, the part by identity)."""
    part = part_id.obj
    return op_time_s(flops=0.0, bytes_moved=params * bytes_per_param, op_class="elementwise",
                     device=slowest_device(part), calibration=part.calibration)


def _data_parallel(workload: Workload, cfg: ParallelConfig, parts: tuple[Cluster, ...], classes: tuple[int, ...],
                   dense: np.ndarray, expert: np.ndarray, layers: tuple[int, ...], pipe: dict, m: int,
                   k: StepConstants, tp_sharded: bool = False, *, wb: tuple[float, float] | None = None,
                   send: float | None = None) -> dict:
    """Exposed dp seconds and optimizer seconds: the slowest pipeline rank of each, each rank's dp groups on
    its own node groups (``parts[classes[r]]``) and its optimizer on its own device. ``layers``: repeated
    blocks per rank; ``wb``: ``dp_bytes``; ``send``: ``p2p_boundary_bytes`` (None: computed here)."""
    memo: dict[tuple[float, float, int, int], tuple[str, float]] = {}
    exposed, kind = 0.0, ""
    per_rank = [0.0] * cfg.pp
    dense_l, expert_l, bwd_l = dense.tolist(), expert.tolist(), pipe["bwd_rank_s"].tolist()
    rank_l = pipe["per_rank_s"].tolist()
    if wb is None:
        wb = dp_bytes(workload, cfg, k)
    layers_l = layers
    overlaps: dict[int, bool] = {}  # per node-group part: whether its ranks overlap the reduction
    slow = None  # (cluster, op, send bytes): the pipeline sends share the reduction's links (one node group)
    if cfg.pp > 1 and cfg.dp * cfg.cp > 1 and len(parts) == 1 and len(parts[0].groups) == 1:
        if send is None:
            send = p2p_boundary_bytes(workload, mb=cfg.microbatch, tp=cfg.tp, cp=cfg.cp,
                                      sp=cfg.sequence_parallel and cfg.tp > 1, k=k)
        slow = (ByIdentity(parts[0]), "all_reduce" if cfg.zero_stage == 0 else "reduce_scatter",
                cfg.virtual_stages * send)
    slow_memo: dict[tuple[float, int], float] = {}
    stride, gpn = cfg.tp * cfg.cp * cfg.dp, parts[0].gpus_per_node
    for r in range(cfg.pp):
        key = (dense_l[r], expert_l[r], layers_l[r], _class_of(classes, r))
        if key not in memo:
            memo[key] = _dp_comm(wb, ByIdentity(parts[key[3]]), key[0], key[1], m, k, dp=cfg.dp,
                                 cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, zero_stage=cfg.zero_stage,
                                 recompute=cfg.recompute, layers=key[2], tp_sharded=tp_sharded)
        lk, t = memo[key]
        if key[3] not in overlaps:
            overlaps[key[3]] = cfg.overlap_grad_reduce and _can_overlap_cached(ByIdentity(parts[key[3]]))
        if not overlaps[key[3]]:
            window = 0.0
        elif cfg.zero_stage == 3 or (cfg.zero_stage == 2 and k.zero2_reduce_per_microbatch and m > 1):
            window = pipe["total_s"]  # reductions spread over every micro-batch's backward
        elif cfg.zero_stage > 0 and k.overlap_param_gather:  # the gather overlaps the next step's forward
            window = rank_l[r]
        else:
            window = bwd_l[r]
        if window > 0 and cfg.zero_stage < 3 and slow is not None and r != cfg.pp - 1:
            # _pipeline_traffic_slowdown (1 in the cases skipped), its rank's first device moved down by whole
            # nodes as _traffic_slowdown_at does
            sk = (key[0], (r * stride) % gpn)
            if sk not in slow_memo:
                slow_memo[sk] = _traffic_slowdown_cached(slow[0], slow[1], key[0] * workload.dtype_bytes, slow[2],
                                                         cfg.tp, cfg.cp, cfg.dp, sk[1])
            t *= slow_memo[sk]
        e = _exposed(t, window, k)
        if window > 0 and cfg.zero_stage < 3:  # the last bucket starts when the backward ends
            grad_bytes = (key[0] + key[1]) * wb[0]
            e = max(e, t * min(1.0, k.last_bucket_bytes / grad_bytes) if grad_bytes > 0 else 0.0)
        if cfg.zero_stage >= 1:  # FSDP2's host time per unit (each layer and the root) and micro-batch pass
            e += (key[2] + 1) * m * fsdp_unit_time_s(device=slowest_device(parts[key[3]]),
                                                     calibration=parts[key[3]].calibration)
        per_rank[r] = e
        if e >= exposed:
            exposed, kind = e, lk
    sharded = cfg.zero_stage >= 1
    shard = dense / (cfg.dp * cfg.cp if sharded else 1) + expert / (
        max(1, cfg.dp // cfg.ep) * cfg.cp if sharded else 1)
    opt_memo: dict[tuple[float, int], float] = {}  # ranks that hold equal shards on equal parts: one roofline
    opt_rank = []
    for r, x in enumerate(shard.tolist()):
        key = (x, _class_of(classes, r))
        if key not in opt_memo:
            opt_memo[key] = _optimizer_s(ByIdentity(parts[key[1]]), x, k.optimizer_bytes_per_param)
        opt_rank.append(opt_memo[key])
    return {"exposed_s": exposed, "kind": kind, "optimizer_s": max(opt_rank),
            "rest_s": tuple(e + o for e, o in zip(per_rank, opt_rank))}


@functools.lru_cache(maxsize=4096)
def _blocks_per_rank(uniques: ByIdentity, counts: ByIdentity, v: int, pp: int) -> tuple[int, ...]:
    """Repeated blocks (every entry but the embedding and the head) per pipeline rank: the units ZeRO-3 gathers
    and reduces one at a time."""
    is_block = np.array([1.0 if l.recomputable else 0.0 for l in uniques.obj])
    out = (counts.obj @ is_block).reshape(v, pp).sum(axis=0)
    return tuple(int(x) for x in out.tolist())


_FOLD_SUM = ("params", "xparams", "embgrad", "act", "rootparams", "castparams")
_FOLD_MAX = ("head_work", "work", "maxparams", "maxxparams", "maxact")
"""The chunk columns ``_estimate`` and ``_memory`` read per pipeline rank: summed over the rank's chunks, or the
largest of them."""


@functools.lru_cache(maxsize=4096)
def _folded(chunks: ByIdentity, v: int, pp: int) -> dict:
    """The chunk arrays (``_chunk_sums``'s, memoized: by identity) folded onto the pipeline ranks
    (``_per_rank``), read-only, and the ranks' dense parameters summed (``params_total``)."""
    ch = chunks.obj
    out: dict = {n: _per_rank(ch[n], v, pp) for n in _FOLD_SUM}
    out.update({n: _per_rank(ch[n], v, pp, "max") for n in _FOLD_MAX})
    out["params_total"] = float(out["params"].sum())
    return out


@functools.lru_cache(maxsize=1024)
def _boundary_counts(pp: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """Per pipeline rank: its chunks that keep their output for the backward (all but the last chunk) and its
    receive buffers (an activation on every chunk but the first, a gradient on every chunk but the last),
    read-only."""
    chunks = np.arange(pp * v)
    holds = _per_rank((chunks < pp * v - 1).astype(float), v, pp)
    receives = _per_rank((chunks > 0).astype(float) + (chunks < pp * v - 1).astype(float), v, pp)
    return holds, receives


@dataclass(frozen=True, slots=True)
class _ModeRates:
    """Per pipeline rank, what ``_memory`` reads of the rank's memory mode over a data-parallel degree."""

    gradients: np.ndarray
    """Bytes per parameter of the gradients."""
    autocast: np.ndarray
    """``MemoryMode.autocast_weight_copies``."""
    gradient_buffer: np.ndarray
    """``MemoryMode.gradient_buffer``."""
    fsdp2: tuple[bool, ...]


@functools.lru_cache(maxsize=4096)
def _mode_rates(target_id: ByIdentity, mode_ids: tuple[int, ...], d: int) -> _ModeRates:
    """``_ModeRates`` of the ranks' modes (by identity: the target, in the key, holds them) over ``d``."""
    by_id = {id(m): m for m in target_id.obj.modes}
    modes = [by_id[i] for i in mode_ids]
    out = _ModeRates(gradients=np.array([mode.term_bytes_per_param(d)["gradients"] for mode in modes]),
                     autocast=np.array([mode.autocast_weight_copies for mode in modes]),
                     gradient_buffer=np.array([mode.gradient_buffer for mode in modes]),
                     fsdp2=tuple(bool(mode.fsdp2) for mode in modes))
    for a in (out.gradients, out.autocast, out.gradient_buffer):
        a.setflags(write=False)
    return out


@functools.lru_cache(maxsize=4096)
def _inflight(schedule: str, pp: int, m: int, v: int) -> np.ndarray:
    out = pl.inflight_array(schedule, pp=pp, num_microbatches=m, virtual_stages=v)
    out.setflags(write=False)
    return out


def _rank_modes(workload: Workload, cfg: ParallelConfig, target: Target, gpu: np.ndarray) -> tuple:
    """Per pipeline rank, the target's ``[memory.*]`` mode for ``cfg`` on that rank's device kind (memoized on
    the facts of ``targets.config_facts`` the target's modes test, the target and the per-rank device kinds by
    identity)."""
    w = workload
    facts = config_facts(cfg, experts=w.experts, tied_embeddings=w.tied_embeddings, glu=w.glu)
    key = tuple(facts[f] for f in _mode_facts(ByIdentity(target)))
    found = _rank_modes_cached(ByIdentity(target), ByIdentity(gpu), key)
    if found is None:  # no mode holds: the target's own error, naming the configuration
        for g in sorted({bool(x) for x in gpu.tolist()}):
            target.memory_mode(cfg, experts=w.experts, tied_embeddings=w.tied_embeddings, glu=w.glu, gpu=g)
    return found


@functools.lru_cache(maxsize=64)
def _mode_facts(target_id: ByIdentity) -> tuple[str, ...]:
    """The facts the target's modes test, less ``gpu`` (per rank: ``_rank_modes_cached`` adds it)."""
    return tuple(f for f in target_id.obj.mode_facts() if f != "gpu")


@functools.lru_cache(maxsize=16384)
def _rank_modes_cached(target_id: ByIdentity, gpu_id: ByIdentity, values: tuple) -> tuple | None:
    """``_rank_modes`` where the facts ``_mode_facts`` names take ``values``; None when no mode holds for some
    rank."""
    target, gpu = target_id.obj, gpu_id.obj.tolist()
    base = dict(zip(_mode_facts(target_id), values))
    modes = {g: target.mode_for({**base, "gpu": g}) for g in sorted({bool(x) for x in gpu})}
    if any(mode is None for mode in modes.values()):
        return None
    return tuple(modes[bool(x)] for x in gpu)


def _model_states(workload: Workload, cfg: ParallelConfig, target: Target, dense: np.ndarray,
                  expert: np.ndarray, modes: tuple) -> dict[str, np.ndarray]:
    """Weights, gradients and optimizer states per pipeline rank under the target's layout for ``cfg`` (each
    rank's ``[memory.*]`` mode, ``modes``), plus the precision's quantized weight copies (sharded with the
    weights under ZeRO-3). Memoized on the ranks' parameters and what the layout reads of ``cfg`` (a fresh dict
    of read-only arrays)."""
    return dict(_model_states_cached(ByIdentity(target), tuple(map(id, modes)), tuple(dense.tolist()),
                                     tuple(expert.tolist()), cfg.pp, cfg.dp * cfg.cp,
                                     expert_shard_degree(workload, cfg), cfg.zero_stage, cfg.precision))


@functools.lru_cache(maxsize=16384)
def _model_states_cached(target_id: ByIdentity, mode_ids: tuple[int, ...], dense_t: tuple, expert_t: tuple,
                         pp: int, dense_d: int, expert_d: float, zero_stage: int,
                         precision: str) -> dict[str, np.ndarray]:
    """``mode_ids``: the ranks' modes by identity (the target, in the key, holds them); ``dense_d`` /
    ``expert_d``: the degrees the dense and the expert parameters' sharded states are divided by."""
    target = target_id.obj
    by_id = {id(m): m for m in target.modes}
    modes = [by_id[i] for i in mode_ids]
    dense, expert = np.array(dense_t, dtype=float), np.array(expert_t, dtype=float)
    extra = target.constants.precision(precision).weight_bytes_per_param
    terms = {t: np.zeros(pp) for t in ("weights", "gradients", "optimizer")}
    for params, d in ((dense, dense_d), (expert, expert_d)):
        per = [mode.term_bytes_per_param(d) for mode in modes]
        for key in terms:
            b = np.array([p[key] + (extra / (d if zero_stage == 3 else 1) if key == "weights" else 0.0)
                          for p in per])
            terms[key] = terms[key] + params * b
    for a in terms.values():
        a.setflags(write=False)
    return terms


def expert_shard_degree(workload: Workload, cfg: ParallelConfig) -> float:
    """The degree the expert parameters' sharded states are divided by: the ranks holding the same experts
    (dp / ep, times cp). Experts stored stacked (one ``(experts, ...)`` parameter per projection,
    ``workload.meta["stacked_experts"]``) are sharded by FSDP2 along the expert dimension in whole rows, each
    rank's shard padded to ``ceil(local experts / ranks)`` of them: with fewer local experts than ranks (or a
    remainder) a shard is more than 1 / ranks of them, as if divided by ``local / ceil(local / ranks)``."""
    d = max(1, cfg.dp // cfg.ep) * cfg.cp
    local = workload.experts // max(1, cfg.ep) if workload.experts else 0
    if not workload.meta.get("stacked_experts") or local < 1:
        return float(d)
    return local / math.ceil(local / d)


def fsdp_buffer_bytes(*, zero_stage: int, dp: int, block_params: float, root_params: float,
                      grad_bytes: float, gather_bytes: float, reduce_per_microbatch: bool, gpu: bool = True,
                      expert_params: float = 0.0) -> tuple[float, float]:
    """``(gathered, reducing)``: bytes FSDP2 holds beyond the model states on one rank (``dp``: the sharding
    degree; nothing when it is 1), measured on a live-storage counter (``tests/test_memory_truth.py``):

    - ``gathered``, held whenever a block computes: at ZeRO-3 the parameters of the root module (FSDP2 does not
      reshard the root after forward: the embedding, final norm and head of the rank, ``root_params``) and of the
      block computing, and on a GPU of the next one too (FSDP2 prefetches one module ahead; CPU collectives are
      synchronous), in the gathered dtype (``gather_bytes``), and the block's experts (``expert_params``, this
      rank's local experts of its largest MoE block: ``runtime.data_parallel`` makes each experts module its own
      FSDP2 unit, gathered inside its layer's unit while it computes; one at a time: the next block's dense unit is
      what FSDP2 prefetches during an experts unit's backward, measured by ``autopar check`` on the Mixtral 8x7B
      plan: 2 dense blocks and 1 experts module gathered at the peak; gathered in the gathered dtype even when
      their shard degree is 1, a bf16 copy of fp32 shards);
    - ``reducing``, held while a block's gradients are reduced in a backward that reduce-scatters (ZeRO-3, and
      ZeRO-1 / 2 when ``reduce_per_microbatch``: the target's ZeRO-2 reduces every micro-batch, or there is one
      micro-batch): the unsharded gradients of that block and of the root module (FSDP2 reduces the root's group
      when the whole backward is done) in the gathered dtype, and the flat reduce-scatter input of the block in
      the reduction dtype (``grad_bytes``): one, or two at ZeRO-3 (one in flight while the next is filled:
      ``reduce_scatter_max_input_buffers`` = 1).

    ``block_params``: the rank's largest block."""
    if dp <= 1 or zero_stage == 0 or (zero_stage in (1, 2) and not reduce_per_microbatch):
        return 0.0, 0.0
    staging = (2.0 if zero_stage == 3 else 1.0) * block_params * grad_bytes
    reducing = staging + (block_params + root_params) * gather_bytes
    if zero_stage < 3:
        return 0.0, reducing
    return (root_params + (2.0 if gpu else 1.0) * block_params + expert_params) * gather_bytes, reducing


def recv_buffer_bytes(workload: Workload, cfg: ParallelConfig, k: StepConstants, m: int) -> np.ndarray:
    """Pipeline receive buffers per rank kept for the whole step where the target allocates them per
    micro-batch (``recv_buffers_per_microbatch``): every chunk but the first gets one activation per micro-batch,
    every chunk but the last one gradient. (Otherwise a stage holds the activations of the micro-batches in
    flight, priced with them, and a gradient for as long as its backward runs.)"""
    pp, v = cfg.pp, cfg.virtual_stages or 1
    if pp == 1 or not k.recv_buffers_per_microbatch:
        return np.zeros(pp)
    each = p2p_boundary_bytes(workload, mb=cfg.microbatch, tp=cfg.tp, cp=cfg.cp,
                              sp=cfg.sequence_parallel and cfg.tp > 1, k=k)
    return _recv_buffers(pp, v, k, each, m)


def _recv_buffers(pp: int, v: int, k: StepConstants, each: float, m: int) -> np.ndarray:
    """``recv_buffer_bytes`` with the boundary bytes ``each`` given."""
    if pp == 1 or not k.recv_buffers_per_microbatch:
        return np.zeros(pp)
    return m * each * _boundary_counts(pp, v)[1]


def stage_output_bytes(workload: Workload, cfg: ParallelConfig, k: StepConstants, inflight: np.ndarray) -> np.ndarray:
    """Per rank: the stage outputs kept for the micro-batches in flight until their backward where the target
    keeps them (``stage_outputs_kept``): one boundary tensor per micro-batch in flight on each chunk but the last
    (whose output is the loss). A block's output is no tensor its own backward saves, so the block's activation
    bytes do not hold it."""
    pp, v = cfg.pp, cfg.virtual_stages or 1
    if pp == 1 or not k.stage_outputs_kept:
        return np.zeros(pp)
    each = p2p_boundary_bytes(workload, mb=cfg.microbatch, tp=cfg.tp, cp=cfg.cp,
                              sp=cfg.sequence_parallel and cfg.tp > 1, k=k)
    return _stage_outputs(pp, v, k, each, inflight)


def _stage_outputs(pp: int, v: int, k: StepConstants, each: float, inflight: np.ndarray) -> np.ndarray:
    """``stage_output_bytes`` with the boundary bytes ``each`` given."""
    if pp == 1 or not k.stage_outputs_kept:
        return np.zeros(pp)
    return each * _boundary_counts(pp, v)[0] * inflight


def _one_backward_peak(terms: dict[str, np.ndarray], reduce_extra: np.ndarray, grad_buffer: np.ndarray) -> None:
    """With one micro-batch a step each rank runs one backward. It begins (at the loss, or with the gradient the
    next stage sends) before any parameter gradient exists (``optimizer.zero_grad(set_to_none=True)`` frees them
    after each step; autograd makes each at its first accumulation; only a buffer made in the forward, DDP's
    bucket, ``grad_buffer``, is there) and with every activation of the micro-batch live, and it ends with
    every gradient made and the activations freed. ``terms`` (per rank, changed in place) become those of the
    larger of the two: at the start, gradients are the buffer only and no reduction is running
    (``reduce_extra``); at the end, no activations, logits or (backward-made) reduction staging is left but
    the gradients (measured on the runtime: ``tests/test_memory_truth.py``)."""
    grads = terms["gradients"]
    start = sum(terms.values()) - grads - reduce_extra + grad_buffer
    live_at_end = ("weights", "gradients", "optimizer", "comm_buffers", "weight_casts")
    end = sum(terms[k] for k in live_at_end if k in terms)
    at_start = start >= end
    terms["gradients"] = np.where(at_start, grad_buffer, grads)
    terms["comm_buffers"] = terms["comm_buffers"] - np.where(at_start, reduce_extra, 0.0)
    for key in ("activations", "logits"):
        terms[key] = np.where(at_start, terms[key], 0.0)


def _memory(workload: Workload, cfg: ParallelConfig, folded: dict, dense: np.ndarray, expert: np.ndarray, m: int,
            mc: mem.MemoryConstants, gpu: np.ndarray, target: Target, *, wb: tuple[float, float], send: float
            ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Memory terms per pipeline rank (arrays of bytes) and the totals with the allocator reserve (on the
    ranks whose device is a GPU: ``gpu``), from the chunk arrays folded onto the ranks (``_folded``: the coster's
    bytes per block, summed or maxed per chunk). ``wb``: ``dp_bytes``; ``send``: ``p2p_boundary_bytes``."""
    w, pp, v = workload, cfg.pp, cfg.virtual_stages
    k = target.constants
    inflight = _inflight(cfg.schedule, pp, m, v)
    modes = _rank_modes(w, cfg, target, gpu)
    terms = _model_states(w, cfg, target, dense, expert, modes)
    rates = _mode_rates(ByIdentity(target), tuple(map(id, modes)), cfg.dp * cfg.cp)
    terms["gradients"] = terms["gradients"] + folded["embgrad"] * rates.gradients
    tokens = cfg.microbatch * w.seq / cfg.cp
    # transient bytes: a block's backward working bytes, and on the head's rank the logits and the loss's
    # buffers, which the head's backward frees before any block's backward starts: the larger of the two
    head = folded["head_work"]
    terms["activations"] = (folded["act"] * inflight
                            + np.maximum(folded["work"] - head, 0.0)
                            + _stage_outputs(pp, v, k, send, inflight))
    terms["logits"] = head
    # tensor-parallel collective buffers; DDP's gradient buckets are in the layout's gradient bytes
    buffers = 2.0 * tokens * w.hidden * w.dtype_bytes if cfg.tp > 1 else 0.0
    buffers = np.full(pp, buffers)
    grad_b, gather_b = wb
    each = (cfg.zero_stage == 2 and k.zero2_reduce_per_microbatch) or m == 1
    reduce_extra = np.zeros(pp)  # the reduction buffers beyond what the loss and a block's backward freed
    if cfg.zero_stage == 3 or any(rates.fsdp2):
        block, block_act = folded["maxparams"].tolist(), folded["maxact"].tolist()
        block_experts = folded["maxxparams"].tolist()
        root, logits, on_gpu = folded["rootparams"].tolist(), head.tolist(), gpu.tolist()
        buf, extra = buffers.tolist(), [0.0] * pp
        for r, fsdp2 in enumerate(rates.fsdp2):
            if fsdp2:
                gathered, reducing = fsdp_buffer_bytes(
                    zero_stage=cfg.zero_stage, dp=cfg.dp * cfg.cp, block_params=block[r], root_params=root[r],
                    grad_bytes=grad_b, gather_bytes=gather_b, reduce_per_microbatch=each, gpu=bool(on_gpu[r]),
                    expert_params=block_experts[r])
                # a block's reduction starts once the loss and that block have run their backward: the peak
                # holds the larger of the logits (+ loss) and the reduction buffers less what those two freed
                extra[r] = max(0.0, reducing - logits[r] - block_act[r])
                buf[r] += gathered + extra[r]
            elif cfg.zero_stage == 3:  # two layers' gathered parameters (prefetch)
                buf[r] += 2.0 * block[r] * mc.weight_bytes
        buffers, reduce_extra = np.array(buf), np.array(extra)
    buffers = buffers + _recv_buffers(pp, v, k, send, m)
    terms["comm_buffers"] = buffers
    # fp32 parameters computed under autocast: its cached bf16 copy of every matmul weight, for the whole step
    terms["weight_casts"] = rates.autocast * folded["castparams"]
    if m == 1 and k.gradients_freed_between_steps:
        _one_backward_peak(terms, reduce_extra, rates.gradient_buffer * (dense + expert))
    subtotal = sum(terms.values())
    terms["allocator_reserve"] = np.where(gpu, mem.allocator_reserve_bytes(subtotal, mc), 0.0)
    return terms, subtotal + terms["allocator_reserve"]


def _flops(workload: Workload, stage_layers: tuple[int, ...], cfg: ParallelConfig,
           mask: tuple[bool, ...]) -> tuple[float, float]:
    """(model, hardware) FLOPs of one step: 6N + attention, plus what recomputation re-runs (memoized)."""
    return _flops_cached(ByIdentity(workload.layers), stage_layers, mask, cfg.recompute, cfg.global_batch)


@functools.lru_cache(maxsize=4096)
def _flops_cached(layers: ByIdentity, stage_layers: tuple[int, ...], mask: tuple[bool, ...], recompute: str,
                  global_batch: int) -> tuple[float, float]:
    uniques, counts = _structure_cached(layers, stage_layers)
    n = counts.sum(axis=0)  # entries of each distinct layer
    model = global_batch * float(n @ np.array([l.flops_fwd + l.flops_bwd for l in uniques]))
    rec = _split_cached(layers, stage_layers, mask)[1].sum(axis=0)  # recomputed entries of each distinct layer
    if recompute == "full":
        extra = float(rec @ np.array([l.flops_fwd for l in uniques]))
    elif recompute == "selective":
        extra = float(rec @ np.array([l.attn_flops_fwd for l in uniques]))
    else:
        extra = 0.0
    return model, model + global_batch * extra


def _ctx_keys(workload: Workload, cfg: ParallelConfig, cluster: Cluster, clusters: tuple[Cluster, ...],
              classes: tuple[int, ...], target: Target, *, autocast: bool = True) -> tuple[_CtxKey, ...]:
    """The layer context of each of the ranks' node groups ``clusters`` (``rank_clusters``): autocast where the
    target's ``[memory.*]`` mode of the ranks on it computes fp32 parameters under bf16 autocast
    (``MemoryMode.autocast_weight_copies``; a mode is per device kind, and so per node group): those ranks'
    blocks are priced, time, collectives and memory, as that dtype regime runs them
    (``planner.search.block_cost``); ``autocast=False``: none (``estimate_step``)."""
    on = [False] * len(clusters)
    modes = _rank_modes(workload, cfg, target, _rank_devices(ByIdentity(cluster), cfg.pp)[0]) if autocast else ()
    for r, mode in enumerate(modes or ()):
        on[_class_of(classes, r)] = mode.autocast_weight_copies > 0
    return _ctx_keys_cached(ByIdentity(workload), tuple(ByIdentity(part) for part in clusters), cfg.microbatch,
                            cfg.tp, cfg.cp, cfg.ep, cfg.sequence_parallel and cfg.tp > 1, cfg.recompute,
                            cfg.flash_attention, ByIdentity(target.constants), cfg.precision, tuple(on))


@functools.lru_cache(maxsize=4096)
def _ctx_keys_cached(workload: ByIdentity, parts: tuple[ByIdentity, ...], microbatch: int, tp: int, cp: int, ep: int,
                     sp: bool, recompute: str, flash: bool, k: ByIdentity, precision: str,
                     autocast: tuple[bool, ...]) -> tuple[_CtxKey, ...]:
    """One key object per layer context (memoized, the constants by identity), so the memos keyed by it hash
    it once."""
    return tuple(_CtxKey(workload=workload, cluster=part, microbatch=microbatch, tp=tp, cp=cp, ep=ep, sp=sp,
                         recompute=recompute, flash=flash, constants=k.obj, precision=precision, autocast=on)
                 for part, on in zip(parts, autocast))


def layer_contexts(workload: Workload, config: ParallelConfig, cluster: Cluster, *,
                   stage_layers: tuple[int, ...] | None = None,
                   target: Target | None = None) -> tuple[LayerCtx, ...]:
    """The layer context every workload entry is priced in under ``config`` (its pipeline rank's node group,
    its recomputation): what the coster was asked, so the caller can read back the shardings it chose."""
    chunks = config.pp * config.virtual_stages
    stage_layers = even_stage_layers(workload, chunks) if stage_layers is None else tuple(stage_layers)
    mask = recompute_mask(workload, stage_layers, config)
    clusters, classes = rank_clusters(cluster, config.pp)
    keys = _ctx_keys(workload, config, cluster, clusters, classes, target or default_target())
    owner = np.repeat(np.arange(len(stage_layers)), stage_layers)
    out = []
    for e, on in enumerate(mask):
        key = keys[_class_of(classes, int(owner[e]) % config.pp)]
        out.append((key if on else dataclasses.replace(key, recompute="none")).ctx())
    return tuple(out)


def priced_collectives(workload: Workload, config: ParallelConfig, cluster: Cluster, *,
                       stage_layers: tuple[int, ...] | None = None,
                       target: Target | None = None) -> tuple[dict[tuple[str, str], list], ...]:
    """Per pipeline rank, the collectives one step issues as the step model prices them:
    ``{(axis, op): [count, total bytes]}`` with axis ``tp`` / ``cp`` / ``ep`` (the blocks' own, per micro-batch,
    from their costers), ``pp`` (``send_recv``: each chunk's sends and receives to its neighbours, forward and
    backward, per micro-batch) or ``dp`` (gradient and parameter traffic, ``dp_collectives``). For checking against
    what the runtime issues (``tests/test_priced_collectives.py``, runtime.measure.comm_trace on gloo ranks)."""
    chunks = config.pp * config.virtual_stages
    stage_layers = even_stage_layers(workload, chunks) if stage_layers is None else tuple(stage_layers)
    target = target or default_target()
    contexts = layer_contexts(workload, config, cluster, stage_layers=stage_layers, target=target)
    wb = dp_bytes(workload, config, target.constants)
    owner = np.repeat(np.arange(len(stage_layers)), stage_layers) % config.pp
    m = config.num_microbatches
    out: list[dict[tuple[str, str], list]] = [{} for _ in range(config.pp)]
    dense, expert, blocks = [0.0] * config.pp, [0.0] * config.pp, [0] * config.pp

    def add(r: int, axis: str, op: str, count: float, nbytes: float) -> None:
        row = out[r].setdefault((axis, op), [0, 0.0])
        row[0] += count
        row[1] += count * nbytes

    for layer, ctx, r in zip(workload.layers, contexts, owner.tolist()):
        cost = workload.coster(layer, ctx)
        for c in cost.collectives:
            add(r, c.axis, c.op, c.count * m, c.nbytes)
        dense[r] += cost.params
        expert[r] += cost.expert_params
        blocks[r] += 1 if layer.recomputable else 0
    if config.pp > 1:  # the pipeline's sends and receives (``_p2p_s``): one activation / gradient per hop
        hop = p2p_boundary_bytes(workload, mb=config.microbatch, tp=config.tp, cp=config.cp,
                                 sp=config.sequence_parallel and config.tp > 1, k=target.constants)
        n = len(stage_layers)
        for c in range(n):
            sides = (1 if c < n - 1 else 0) + (1 if c > 0 else 0)  # next and previous neighbour
            add(c % config.pp, "pp", "send_recv", 2 * sides * m, hop)  # forward and backward each way
    for r in range(config.pp):
        for group, op, nbytes, count in dp_collectives(
                params=dense[r], expert_params=expert[r], bytes_per_param=wb[0], m=m, k=target.constants,
                zero_stage=config.zero_stage, recompute=config.recompute, layers=blocks[r],
                gather_bytes_per_param=wb[1], tensor_parallel=_tp_sharded(workload, config, sum(dense))):
            if (config.dp * config.cp if group == "dense" else max(1, config.dp // config.ep) * config.cp) > 1:
                add(r, "dp", op, count, nbytes)
    return tuple(out)


def _estimate(workload: Workload, cfg: ParallelConfig, cluster: Cluster, stage_layers: tuple[int, ...] | None,
              target: Target, mc: mem.MemoryConstants, autocast: bool = True) -> StepEstimate:
    k = target.constants
    m, chunks = cfg.num_microbatches, cfg.pp * cfg.virtual_stages
    pl.check_schedule(cfg.schedule, pp=cfg.pp, num_microbatches=m, virtual_stages=cfg.virtual_stages)
    if stage_layers is None:
        stage_layers = even_stage_layers(workload, chunks)
    else:
        stage_layers = tuple(map(int, stage_layers))
        check_stage_layers(stage_layers, workload, chunks)
    check_recompute_layers(cfg, workload, stage_layers)
    mask = recompute_mask(workload, stage_layers, cfg)
    clusters, classes = rank_clusters(cluster, cfg.pp)
    parts = _ctx_keys(workload, cfg, cluster, clusters, classes, target, autocast=autocast)
    uniques, counts = _structure(workload, stage_layers)
    pipe = _pipeline(parts, classes, ByIdentity(cluster), stage_layers, mask, schedule=cfg.schedule, pp=cfg.pp,
                     v=cfg.virtual_stages, m=m, dp=cfg.dp)
    folded = _folded(ByIdentity(pipe["chunks"]), cfg.virtual_stages, cfg.pp)
    dense, expert = folded["params"], folded["xparams"]
    tr_per_rank = _blocks_per_rank(ByIdentity(uniques), ByIdentity(counts), cfg.virtual_stages, cfg.pp)
    wb = dp_bytes(workload, cfg, k)
    send = p2p_boundary_bytes(workload, mb=cfg.microbatch, tp=cfg.tp, cp=cfg.cp,
                              sp=cfg.sequence_parallel and cfg.tp > 1, k=k)
    dp = _data_parallel(workload, cfg, clusters, classes, dense, expert, tr_per_rank, pipe, m, k,
                        tp_sharded=_tp_sharded(workload, cfg, folded["params_total"]), wb=wb, send=send)
    breakdown = dict(pipe["parts"])
    if dp["exposed_s"] > 0:
        key = f"comm_{dp['kind']}"
        breakdown[key] = breakdown.get(key, 0.0) + dp["exposed_s"]
    breakdown["optimizer"] = dp["optimizer_s"]
    step_s = pipe["total_s"] + dp["exposed_s"] + dp["optimizer_s"]
    gpu, limits_gb, stage_device = _rank_devices(ByIdentity(cluster), cfg.pp)
    terms, totals = _memory(workload, cfg, folded, dense, expert, m, mc, gpu, target, wb=wb, send=send)
    worst = int(np.argmax(totals))
    worst_mem = mem.MemoryEstimate(terms={key: float(val[worst]) for key, val in terms.items()})
    stage_gb = tuple(x / mem.GB for x in totals.tolist())
    fits = all(t <= lim for t, lim in zip(stage_gb, limits_gb))  # each rank within its own
    model_f, hw_f = _flops(workload, stage_layers, cfg, mask)
    n = cluster.num_devices
    peak = _peak_tflops(ByIdentity(cluster))
    return StepEstimate(
        step_time_s=step_s,
        tokens_per_s=cfg.global_batch * workload.seq / step_s,
        model_tflops_per_gpu=model_f / step_s / n / 1e12,
        hw_tflops_per_gpu=hw_f / step_s / n / 1e12,
        mfu=model_f / step_s / (peak * 1e12),
        memory_gb_per_device=worst_mem.total_gb,
        fits=fits,
        breakdown_s=breakdown,
        memory_breakdown_gb=worst_mem.terms_gb(),
        bottleneck=max(breakdown, key=breakdown.__getitem__),
        stage_time_s=tuple(pipe["per_rank_s"].tolist()),
        stage_memory_gb=stage_gb,
        config=cfg,
        num_microbatches=m,
        stage_layers=stage_layers,
        memory=worst_mem,
        memory_limit_gb=min(limits_gb),
        stage_memory_limit_gb=limits_gb,
        stage_device=stage_device,
        pipeline_s=float(pipe["total_s"]),
        stage_rest_s=dp["rest_s"],
    )


@functools.lru_cache(maxsize=256)
def _rank_devices(cluster_id: ByIdentity, pp: int) -> tuple[np.ndarray, tuple[float, ...], tuple[str, ...]]:
    """Per pipeline rank: whether its device is a GPU, the device memory of its node groups (GB) and the
    accelerator its stage is priced on (memoized, the cluster by identity)."""
    clusters, classes = rank_clusters(cluster_id.obj, pp)
    devices = [slowest_device(clusters[_class_of(classes, r)]) for r in range(pp)]
    gpu = np.array([d.kind == "gpu" for d in devices])
    gpu.setflags(write=False)
    part_gb = [min(g.node.gpu.memory_bytes for g in part.groups) / mem.GB for part in clusters]
    return gpu, tuple(part_gb[_class_of(classes, r)] for r in range(pp)), tuple(d.name for d in devices)


@functools.lru_cache(maxsize=256)
def _peak_tflops(cluster_id: ByIdentity) -> float:
    """The cluster's summed dense bf16 peak TFLOP/s (memoized, the cluster by identity)."""
    return sum(g.node.gpu.tflops("bf16") * g.node.gpus_per_node * g.count for g in cluster_id.obj.groups)


def _virtual_choices(workload: Workload, cfg: ParallelConfig, stage_layers) -> list[int]:
    if stage_layers is not None:
        return [max(1, len(stage_layers) // cfg.pp)]
    if cfg.schedule in ("gpipe", "1f1b") or cfg.pp == 1:
        return [1]
    per_rank = workload.num_layers // cfg.pp
    return [v for v in range(1, per_rank + 1) if per_rank % v == 0] or [1]


def _choose(workload: Workload, cfg: ParallelConfig, cluster: Cluster, stage_layers, target, mc,
            autocast: bool = True) -> StepEstimate:
    """Fill in a None micro-batch / virtual_stages: the fastest that fits, else the smallest memory."""
    per_rank = cfg.global_batch // cfg.dp
    mbs = [cfg.microbatch] if cfg.microbatch else [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    vs = [cfg.virtual_stages] if cfg.virtual_stages else _virtual_choices(workload, cfg, stage_layers)
    best, errors = None, []
    for mb in mbs:
        for v in vs:
            trial = dataclasses.replace(cfg, microbatch=mb, virtual_stages=v)
            try:
                est = _estimate(workload, trial, cluster, stage_layers, target, mc, autocast)
            except ConfigError as e:
                errors.append(str(e))
                continue
            key = (not est.fits, est.step_time_s if est.fits else est.memory_gb_per_device)
            if best is None or key < best[0]:
                best = (key, est)
    if best is None:
        raise ConfigError(f"no micro-batch in {mbs} / virtual_stages in {vs} is valid: {errors[0]}")
    est = best[1]
    chosen = {}
    if cfg.microbatch is None:
        chosen["microbatch"] = est.config.microbatch
    if cfg.virtual_stages is None:
        chosen["virtual_stages"] = est.config.virtual_stages
    return dataclasses.replace(est, chosen=chosen)


def estimate_step(
    workload: Workload,
    config: ParallelConfig,
    cluster: Cluster,
    *,
    stage_layers: tuple[int, ...] | None = None,
    target: Target | None = None,
    memory_constants: mem.MemoryConstants = mem.DEFAULT_MEMORY,
    autocast: bool = True,
) -> StepEstimate:
    """Step time, FLOP rates, memory and breakdown of ``config`` (see the module docstring).

    ``stage_layers``: workload entries per pipeline chunk (``pp * virtual_stages`` counts); None: even.
    ``autocast=False``: every rank priced as computing bf16 parameters, also where the target's memory mode
    computes fp32 parameters under autocast (``_ctx_keys``), which moves more bytes and is never faster: the
    layer costs a search's lower bounds read (``planner.search.driver``), not what runs.
    Raises ConfigError for invalid configurations, with the numbers and the nearest valid values.
    """
    validate_config(config, workload, cluster.num_devices)
    target = target or default_target()
    target.check_precision(config.precision, cluster)
    if config.microbatch is None or config.virtual_stages is None:
        return _choose(workload, config, cluster, stage_layers, target, memory_constants, autocast)
    return _estimate(workload, config, cluster, stage_layers, target, memory_constants, autocast)


def default_target() -> Target:
    """autopar's own runtime: what ``estimate_step`` prices for when no target is given."""
    return load_target("autopar")
