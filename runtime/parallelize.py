"""``parallelize(part, ...)``: apply a plan to one model part, the whole model (pp = 1) or one pipeline chunk.

The steps, in order (torchtitan's ``parallelize_fn`` shape: the same function for the whole model and, as the
pipeline's per-chunk function, for each chunk):

1. recomputation of the part's transformer layers per its ``StagePlan`` (``runtime.checkpointing``);
2. tensor / sequence parallel per the plan's module shardings (``runtime.tensor_parallel``);
3. experts over the ep axis (``runtime.expert_parallel``);
4. context parallel (whole model only: cp runs without a pipeline; ``runtime.context_parallel``);
5. data parallel / ZeRO (``runtime.data_parallel``), unless ``averages_by_hand`` (ZeRO 0 in a pipeline or with
   experts: ``ParallelModel.step`` averages the gradients);
6. a meta-device part is materialised as this rank's shards (``runtime.materialize``; before DDP, which needs
   real parameters, else after sharding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from planner.plan import Plan
from runtime.checkpointing import apply_stage_recompute, transformer_layers
from runtime.context_parallel import ContextParallel, apply_context_parallel
from runtime.data_parallel import apply_data_parallel, averages_by_hand, unwrap, wraps_with_ddp
from runtime.expert_parallel import apply_expert_parallel
from runtime.materialize import materialize
from runtime.pipeline import PipelineChunk
from runtime.tensor_parallel import apply_tensor_parallel, holds_vocab_head, loss_parallel_works


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallelized:
    """What ``parallelize`` made of one part."""

    module: nn.Module
    """The module to call: the part itself (changed in place), or its DDP wrapper."""
    expert_fqns: tuple[str, ...] = ()
    """The part's experts modules sharded over ep."""
    context: ContextParallel | None = None
    """Set when cp > 1: splits each sequence over the cp ranks."""


def parallelize(
    part: nn.Module,
    *,
    plan: Plan,
    mesh: DeviceMesh,
    device: torch.device,
    seed: int = 0,
    init_owner: nn.Module | None = None,
) -> Parallelized:
    """Apply ``plan`` to ``part`` in place (the steps of the module docstring).

    ``part``: the model, or a ``runtime.pipeline.PipelineChunk`` (then plan entries for modules of other chunks
    are skipped, stage outputs are plain tensors: a vocabulary-sharded head returns this rank's shard of the
    logits, which the pipeline's loss wraps back into a DTensor for the loss-parallel cross-entropy, and
    ``init_owner`` is the full model whose init rule materialises the chunk).
    """
    chunk = isinstance(part, PipelineChunk)
    is_meta = any(p.is_meta for p in part.parameters())
    if not is_meta:
        part.to(device)  # before sharding: DTensor and FSDP2 take this rank's part of the tensors in place
    stage = part.stage if chunk else sorted(plan.stages, key=lambda s: s.index)[0]
    layers = part.layer_fqns if chunk else transformer_layers(part)
    apply_stage_recompute(part, layer_fqns=layers, stage=stage)
    loss_parallel_ok = None
    if chunk and plan.degrees.tp > 1 and holds_vocab_head(part, plan.shardings):
        # the head's stage: its logits leave it as this rank's vocabulary shard for the loss-parallel
        # cross-entropy, as without a pipeline (the backend probed as there)
        loss_parallel_ok = loss_parallel_works(mesh["tp"])
        part.logits_mesh = mesh["tp"] if loss_parallel_ok else None
    apply_tensor_parallel(part, plan=plan, mesh=mesh, strict=not chunk, loss_parallel_ok=loss_parallel_ok,
                          local_logits=chunk)
    expert_fqns = tuple(apply_expert_parallel(part, plan=plan, mesh=mesh, strict=not chunk))
    context = None if chunk else apply_context_parallel(part, plan=plan, mesh=mesh)
    module = part
    if not averages_by_hand(plan, mesh, pipelined=chunk):
        if is_meta and wraps_with_ddp(part, plan=plan, mesh=mesh):
            materialize(part, device=device, seed=seed, init_owner=init_owner)
            is_meta = False
        blocks = [part.get_submodule(f) for f in layers] if chunk else None  # one FSDP2 unit per layer
        module = apply_data_parallel(part, plan=plan, mesh=mesh, expert_fqns=expert_fqns, blocks=blocks)
    if is_meta:
        materialize(unwrap(module), device=device, seed=seed, init_owner=init_owner)
    return Parallelized(module=module, expert_fqns=expert_fqns, context=context)
