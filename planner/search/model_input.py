"""What the planner needs of a model: its Workload, its ModelInfo, its blocks (for the per-module sharding)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from costmodel.errors import ConfigError
from costmodel.workload import Workload
from planner.plan import ModelInfo, ModuleSharding

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedModel:
    workload: Workload
    model_info: ModelInfo
    blocks: tuple[Any, ...] = ()
    """``planner.graph.Block`` per layer / embedding / head, when the model was traced here."""
    graph: Any = None
    """The ``planner.graph.OpGraph`` the blocks were found in."""
    module_groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Group names in ``workload.layers`` (``embedding``, ``head``) -> the module FQNs they stand for."""


def load(model: Any, *, seq: int | None, global_batch: int, example_inputs: Any = None) -> LoadedModel:
    """``model`` is a spec string (traced and cached by ``planner.workload``), an ``nn.Module`` with its
    ``example_inputs`` (traced as it is, batch first) or a ``(Workload, ModelInfo)``."""
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], Workload):
        workload, info = model
        if not isinstance(info, ModelInfo):
            raise ConfigError(f"model=(Workload, {type(info).__name__}): the second item must be a planner.plan.ModelInfo")
        if seq is not None and seq != workload.seq:
            raise ConfigError(f"seq={seq} but the given Workload is for seq={workload.seq}: build the Workload for "
                              f"seq={seq} or pass seq=None")
        return LoadedModel(workload=workload, model_info=info, module_groups=dict(workload.meta.get("module_groups", {})))
    from planner import workload as wl_mod

    if hasattr(model, "named_parameters") and callable(model):  # an nn.Module
        if example_inputs is None:
            raise ConfigError(f"planning a {type(model).__name__} module needs example_inputs= (one batch of its "
                              "positional inputs, batch first)")
        if seq is not None:
            raise ConfigError("seq= applies to model specs; a module is planned at its example_inputs' shape")
        name = f"{type(model).__name__} (module)"
        workload, bits = wl_mod.workload_from_module(model, example_inputs, name=name)
    elif isinstance(model, str):
        workload, bits = wl_mod.workload_from_model(model, batch=1, seq=seq)
    else:
        raise ConfigError(f"model must be a spec string, an nn.Module or a (Workload, ModelInfo) pair, got "
                          f"{type(model).__name__}")
    name = getattr(bits, "name", model)
    blocks = tuple(getattr(bits, "blocks", ()) or ())
    groups = {b.name: tuple(b.modules) for b in blocks if getattr(b, "kind", "") != "transformer"}
    groups.update(dict(workload.meta.get("module_groups", {})) if isinstance(workload.meta, dict) else {})
    flops = float((workload.flops_fwd_per_seq + workload.flops_bwd_per_seq) * global_batch)
    info = ModelInfo(
        name=name,
        fingerprint=str(getattr(bits, "fingerprint", "")),
        params=int(getattr(bits, "params", workload.params)),
        flops_per_step=flops,
        num_layers=workload.num_layers,
        seq_len=workload.seq,
    )
    return LoadedModel(workload=workload, model_info=info, blocks=blocks, graph=getattr(bits, "graph", None),
                       module_groups=groups)


def sequence_parallel_tps(loaded: LoadedModel, *, cluster: Any, max_tp: int) -> frozenset[int] | None:
    """The power-of-two tp degrees (2..max_tp) at which every distinct transformer block has an executable
    sequence-parallel sharding, asked of the per-block ILP; None when the model carries no traced blocks."""
    if not loaded.blocks or loaded.graph is None:
        return None
    from planner.search.block_plan import StrategyCache, sequence_parallel_ok

    cache = StrategyCache()
    distinct = {b.signature: b for b in loaded.blocks if getattr(b, "kind", "") == "transformer"}
    ok = set()
    tp = 2
    while tp <= max_tp:
        if all(sequence_parallel_ok(b, graph=loaded.graph, tp=tp, cluster=cluster, seq=loaded.workload.seq,
                                    cache=cache) for b in distinct.values()):
            ok.add(tp)
        tp *= 2
    return frozenset(ok)


def shardings_for(loaded: LoadedModel, best: Any, *, cluster: Any, config: Any, target: Any = None
                  ) -> tuple[tuple[ModuleSharding, ...], dict]:
    """Per-module sharding of the chosen configuration: for every workload entry, the solution of the block
    ILP that the step model priced it with (``GraphCoster.strategy`` at the entry's own layer context: its
    pipeline rank's node group, its recomputation), expanded to the entry's module FQNs. ``config``: the step
    model's ``ParallelConfig`` of the search's ``best`` candidate; ``target``: the execution target it was
    priced for (None: autopar)."""
    coster = loaded.workload.coster
    if not loaded.blocks or loaded.graph is None or not hasattr(coster, "strategy"):
        log.info("no traced blocks (model given as a Workload): the plan carries no per-module shardings")
        return (), {"blocks": 0}
    from costmodel.step import layer_contexts

    contexts = layer_contexts(loaded.workload, config, cluster, stage_layers=best.stage_layers, target=target)
    out: dict[str, str] = {}
    solved: dict[int, dict] = {}
    for layer, ctx in zip(loaded.workload.layers, contexts):
        strat = coster.strategy(layer, ctx)
        solved[id(strat)] = strat.solver
        prefix = layer.name if layer.kind not in ("embedding", "head") else ""
        for m in strat.shardings:
            fqn = f"{prefix}.{m.fqn}" if prefix and m.fqn else (m.fqn or prefix)
            out.setdefault(fqn, m.style)
    _tie_vocab_styles(out, loaded)
    shardings = tuple(ModuleSharding(fqn=f, style=style) for f, style in out.items())  # execution order
    statuses: dict[str, int] = {}
    for sol in solved.values():
        statuses[str(sol.get("status"))] = statuses.get(str(sol.get("status")), 0) + 1
    gaps = [float(sol.get("gap", 0.0)) for sol in solved.values()]
    return shardings, {"blocks": len(loaded.workload.layers), "distinct_solutions": len(solved),
                       "statuses": statuses, "max_gap": max(gaps, default=0.0)}


def _tie_vocab_styles(styles: dict[str, str], loaded: LoadedModel) -> None:
    """Tied input embedding and LM head share one weight, so they must be split alike: the embedding and head
    blocks are solved separately, and may disagree. A vocabulary-parallel head makes the tied token embedding
    vocabulary-parallel too (an all-reduce of its output); a replicated head keeps it replicated."""
    if not loaded.workload.tied_embeddings or loaded.graph is None:
        return
    vocab = loaded.workload.vocab
    token_embeddings = {
        n.module_fqn for n in loaded.graph.nodes
        if n.op_class == "embedding" and any(p[1] and p[1][0] == vocab for p in n.params)
    }
    head_sharded = any(style == "vocab_head" for style in styles.values())
    for fqn in token_embeddings & styles.keys():
        styles[fqn] = "vocab_embedding" if head_sharded else "replicate"
