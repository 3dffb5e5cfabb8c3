"""From a traced model to the cost model's ``Workload`` (plain numbers per layer, for one sequence).

``workload_from_model(spec, seq=)`` builds the model on meta, fingerprints its parameters (FP32 as built, the
same triples the runtime sees), casts the meta model to bf16 (the training compute dtype: activation bytes are
bf16 bytes), traces it and returns the ``Workload`` plus the ``ModelInfoBits`` a ``planner.plan.ModelInfo``
needs. It is memoized per (spec, seq) by ``functools.lru_cache`` on a pure function, so planning repeatedly
does not re-trace; ``clear_cache()`` empties it.

Ranks that compute fp32 parameters under bf16 autocast (no FSDP2 mixed precision) keep other activations than
the bf16 trace: the workload's coster gets an ``AutocastTrace`` of the same meta model, which traces it with
fp32 parameters under autocast (``planner.trace.trace(autocast=True)``) the first time such a rank is priced,
and keeps the graph (``planner.search.block_cost``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from costmodel.errors import ConfigError, UnsupportedModelError
from costmodel.workload import LayerWork, Workload
from planner.dims import complete_dims
from planner.graph import Block, BlockGroup, OpGraph, find_block_groups, find_blocks, pipeline_blocker
from planner.models import ModelDims, build_model
from planner.plan import model_fingerprint
from planner.search.block_cost import GraphCoster

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelInfoBits:
    """What ``planner.plan.ModelInfo`` needs beyond the Workload, plus the traced graph and its blocks."""

    name: str
    fingerprint: str
    """``planner.plan.model_fingerprint`` over the full model's ``named_parameters`` (as built)."""
    params: int
    num_layers: int
    seq_len: int
    dims: ModelDims
    graph: OpGraph
    blocks: tuple[Block, ...]
    groups: tuple[BlockGroup, ...]
    trace_time_s: float


class AutocastTrace:
    """The graph of a model with fp32 parameters traced under bf16 autocast (``planner.trace.trace(autocast=True)``),
    made on the first call and kept (the model is let go then); None when it cannot be traced (a warning). The
    model is cast to fp32 then: pass one nobody else uses (a meta model: the cast is free)."""

    def __init__(self, model: Any, example_inputs: tuple) -> None:
        self._model: Any = model
        self._inputs = tuple(example_inputs)
        self._graph: OpGraph | None = None

    def __call__(self) -> OpGraph | None:
        if self._model is not None:
            import torch

            from planner.trace import cast_floating, trace

            model, self._model = self._model, None
            try:
                self._graph = trace(model.to(torch.float32), cast_floating(self._inputs, torch.float32),
                                    autocast=True)
            except UnsupportedModelError as e:
                log.warning("no autocast trace (%s): autocast ranks' activations are priced from the bf16 trace", e)
            self._inputs = ()
        return self._graph


def workload_from_graph(graph: OpGraph, dims: ModelDims, *, name: str, batch: int = 1,
                        blocks: list[Block] | None = None,
                        autocast_graph: Callable[[], OpGraph | None] | None = None) -> Workload:
    """Per-layer work for one sequence: embedding, each transformer layer, head (FLOPs divided by ``batch``,
    the micro-batch the graph was traced with). ``autocast_graph``: the same model's graph under autocast, made
    when first asked for (``AutocastTrace``), for the coster's autocast regime."""
    if batch < 1:
        raise ConfigError(f"batch={batch} must be a positive integer (the micro-batch the graph was traced with)")
    blocks = blocks if blocks is not None else find_blocks(graph)
    layers = tuple(
        LayerWork(name=b.name, kind=b.kind, signature=b.signature, params=b.params, flops_fwd=b.flops_fwd / batch,
                  flops_bwd=b.flops_bwd / batch, attn_flops_fwd=b.attn_flops_fwd / batch,
                  expert_params=b.expert_params, bytes_fwd=b.bytes_fwd / batch)
        for b in blocks
    )
    n_layers = sum(1 for b in blocks if b.kind == "transformer")
    attn = sum(b.attn_flops_fwd for b in blocks)
    dtype = next((d for n in graph.nodes if n.op_class == "matmul" for d in n.output_dtypes), "float32")
    meta = {
        "module_groups": {b.name: b.modules for b in blocks if b.kind != "transformer"},
        "attn_causal_fraction": (sum(b.attn_flops_fwd_causal for b in blocks) / attn) if attn else 1.0,
        "flops_bwd_recompute_per_seq": sum(b.flops_bwd_recompute for b in blocks) / batch,
        "traced_layers": graph.traced_layers,
        "unsupported_ops": dict(graph.unsupported),
        "pipeline_blocker": pipeline_blocker(graph, blocks),
        # experts stored as stacked (experts, ...) parameters (transformers' MixtralExperts): FSDP2 shards them
        # along the expert dimension, padded to whole rows per rank
        "stacked_experts": bool(dims.experts) and any(
            len(shape) >= 3 and shape[0] == dims.experts for n in graph.nodes for _, shape, _ in n.params),
    }
    dtype_bytes = _DTYPE_BYTES.get(dtype, 4)
    coster = GraphCoster(graph=graph, blocks=blocks, seq=dims.seq, dtype_bytes=dtype_bytes,
                         autocast_graph=autocast_graph)
    return Workload(
        name=name, layers=layers, hidden=dims.hidden, heads=dims.heads, kv_heads=dims.kv_heads,
        ffn_hidden=dims.ffn_hidden, vocab=dims.vocab, seq=dims.seq, num_layers=n_layers or dims.layers,
        experts=dims.experts, topk=dims.topk, glu=dims.glu, dtype_bytes=dtype_bytes,
        tied_embeddings=dims.tied_embeddings, coster=coster, meta=meta,
    )


def workload_from_model(spec: str, *, batch: int = 1, seq: int | None = None) -> tuple[Workload, ModelInfoBits]:
    """Trace ``spec`` (see ``planner.models``) once per (spec, seq) and return its Workload and ModelInfoBits.

    The Workload is per sequence whatever ``batch`` is, so ``batch`` is only validated and the trace uses 1.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch={batch!r} must be a positive integer")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        raise ConfigError(f"seq={seq!r} must be a positive integer or None (the model's default)")
    return _traced(spec, seq)


DTYPE_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per activation / gradient / message element of each compute dtype a plan may run in (``autopar
validate`` runs fp32 on CPUs without native bf16)."""

_FOR_DTYPE: dict[tuple[int, int], tuple[Workload, Workload]] = {}


def workload_for_dtype(workload: Workload, dtype: str) -> Workload:
    """``workload`` priced for ``dtype`` compute: its bytes per element and, for a traced model, its coster's
    (``GraphCoster.with_dtype_bytes``: the tp / cp / ep messages, activations and memory-bound traffic of fp32
    runs are twice the traced bf16 ones, and the block ILP chooses its shardings with those costs). The same
    object for the same (workload, dtype), so the step model's memo (by identity) and the solved blocks are
    shared."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"compute dtype {dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
    n = DTYPE_BYTES[dtype]
    if workload.dtype_bytes == n:
        return workload
    hit = _FOR_DTYPE.get((id(workload), n))
    if hit is not None and hit[0] is workload:
        return hit[1]
    coster = workload.coster
    if hasattr(coster, "with_dtype_bytes"):
        coster = coster.with_dtype_bytes(n)
    out = dataclasses.replace(workload, dtype_bytes=n, coster=coster)
    _FOR_DTYPE[(id(workload), n)] = (workload, out)
    return out


def clear_cache() -> None:
    _traced.cache_clear()


@dataclass(frozen=True, kw_only=True, slots=True)
class TracedSpec:
    """A spec built on meta and traced: the graph plus what only the full model knows."""

    dims: ModelDims
    graph: OpGraph
    fingerprint: str
    params: int
    """``sum(p.numel())`` over the full model's parameters (the traced graph must agree)."""
    autocast: AutocastTrace | None = field(default=None, compare=False)
    """The model (its meta build, cast to fp32 when first asked for) traced with fp32 parameters under autocast;
    None when the model was not built on meta."""


def trace_spec(spec: str, *, batch: int = 1, seq: int | None = None) -> TracedSpec:
    """Build ``spec`` on meta, fingerprint it (as built), cast it to bf16 (meta: free) and trace it."""
    from planner.trace import cast_floating, trace

    bundle = build_model(spec, batch=batch, seq=seq)
    model = bundle.model
    named = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    params = sum(_numel(s) for _, s, _ in named)
    inputs = bundle.example_inputs
    autocast = None
    if named and all(p.device.type == "meta" for p in model.parameters()):
        import torch

        autocast = AutocastTrace(model, inputs)  # the same meta model, cast back to fp32 if that is asked for
        model.to(torch.bfloat16)  # meta: no memory; the graph then carries bf16 activation bytes
        inputs = cast_floating(inputs, torch.bfloat16)  # float inputs (images, features) with the model
    graph = trace(model, inputs)
    dims = complete_dims(bundle.dims, graph)  # user code: seq (and what else the graph shows) from the graph
    if graph.params != params:
        log.warning("%s: traced ops use %d parameters of %d (the rest is unused in forward)",
                    spec, graph.params, params)
    return TracedSpec(dims=dims, graph=graph, fingerprint=model_fingerprint(named), params=params,
                      autocast=autocast)


def workload_from_module(model: Any, example_inputs: Any, *, name: str) -> tuple[Workload, ModelInfoBits]:
    """Trace an ``nn.Module`` the caller holds (on meta, or with real weights: torch.export only fakes them)
    with one sample of ``example_inputs`` (a batch, batch first: the first row of each tensor), in the dtype it
    has: the module is not changed. Not memoized (modules are not hashable by content)."""
    import torch

    from planner.trace import trace

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be an nn.Module, got {type(model).__name__}")
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] >= 1 for t in inputs):
        raise ConfigError(f"example_inputs for {name}: give the model's positional inputs as tensors with the batch "
                          "first (one batch, e.g. (input_ids,)); got "
                          f"{[type(t).__name__ + str(tuple(getattr(t, 'shape', ()))) for t in inputs]}")
    sample = tuple(t[:1] for t in inputs)
    if any(p.is_meta for p in model.parameters()):  # only shapes matter: CPU inputs of a meta model go to meta too
        sample = tuple(t.to("meta") for t in sample)
    named = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    if cached:  # a Hugging Face model traced for training: no KV cache in its outputs
        config.use_cache = False
    try:
        graph = trace(model, sample)
    finally:
        if cached:
            config.use_cache = cached
    dims = complete_dims(ModelDims(arch="custom", layers=len(graph.layer_fqns), hidden=0, heads=0, kv_heads=0,
                                   ffn_hidden=0, vocab=0, seq=0), graph)
    blocks = find_blocks(graph)
    # an fp32 module is what autocast computes (for a bf16 compute dtype asked of this fp32 trace): traced under
    # autocast when first asked for (its cast to fp32 changes nothing); other dtypes, or a Hugging Face model
    # whose KV cache is switched off for the trace only: not traced so
    fp32 = all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point())
    autocast = AutocastTrace(model, sample) if fp32 and not cached else None
    workload = workload_from_graph(graph, dims, name=name, blocks=blocks, autocast_graph=autocast)
    bits = ModelInfoBits(
        name=name, fingerprint=model_fingerprint(named), params=sum(_numel(s) for _, s, _ in named),
        num_layers=workload.num_layers, seq_len=dims.seq, dims=dims, graph=graph, blocks=tuple(blocks),
        groups=tuple(find_block_groups(blocks)), trace_time_s=graph.trace_time_s,
    )
    return workload, bits


@functools.lru_cache(maxsize=16)
def _traced(spec: str, seq: int | None) -> tuple[Workload, ModelInfoBits]:
    t = trace_spec(spec, batch=1, seq=seq)
    blocks = find_blocks(t.graph)
    workload = workload_from_graph(t.graph, t.dims, name=spec, blocks=blocks, autocast_graph=t.autocast)
    bits = ModelInfoBits(
        name=spec, fingerprint=t.fingerprint, params=t.params, num_layers=workload.num_layers,
        seq_len=t.dims.seq, dims=t.dims, graph=t.graph, blocks=tuple(blocks),
        groups=tuple(find_block_groups(blocks)), trace_time_s=t.graph.trace_time_s,
    )
    return workload, bits


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
