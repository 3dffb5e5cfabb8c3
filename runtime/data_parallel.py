"""Data parallelism per the plan's ZeRO stage, over the batch axis of the mesh ("dp", times "ep"; times "cp" under
context parallel, whose ranks hold parts of the same sequences: ``runtime.mesh.grad_mesh``).

- ZeRO 3: FSDP2 ``fully_shard`` on every transformer layer (the children of the model's ModuleLists) and on the
  root, ``reshard_after_forward=True``: parameters, gradients and optimizer state sharded (Rajbhandari et al. 2020).
- ZeRO 2 and ZeRO 1: ``fully_shard(..., reshard_after_forward=False)``. Gradients are reduce-scattered and the
  optimizer state is sharded (ZeRO 2); the parameters stay gathered from forward to the end of backward (no
  second all-gather in backward). Approximated: FSDP2 keeps the parameters sharded *between* steps, so the memory
  at rest is ZeRO 3's, and ZeRO 1 (full gradients, reduced with an all-reduce) cannot be expressed: it runs as
  ZeRO 2, whose communication volume is the same (reduce-scatter + all-gather = one all-reduce).
- ZeRO 0: ``DistributedDataParallel`` when no parameter is a DTensor; with tensor parallel (DTensor parameters,
  which DDP cannot bucket) FSDP2's replicate (``torch.distributed._composable.replicate_with_fsdp.replicate``:
  parameters replicated over dp, gradients all-reduced). In a pipeline and with expert parallel ZeRO 0 has no
  wrapper: ``ParallelModel.step`` calls ``average_gradients`` after the backward (``averages_by_hand``).
- Expert parallel (``expert_fqns``): each experts module first gets its own ``fully_shard`` over the outer ``dp``
  axis (the ranks holding the same experts: their gradients already hold the mean over ep, see
  ``runtime.expert_parallel``), the rest is sharded over dp x ep as without experts.
Gradients are averaged over the batch ranks in every case, so a per-rank mean loss gives the global-mean gradient.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from costmodel.errors import ConfigError
from planner.plan import Plan
from runtime.mesh import grad_mesh

log = logging.getLogger(__name__)


def averages_by_hand(plan: Plan, mesh: DeviceMesh, *, pipelined: bool) -> bool:
    """True where no wrapper averages the gradients and ``average_gradients`` must: ZeRO 0 over more than one
    batch rank in a pipeline (the stages run their own backward) or with expert parallel (expert gradients
    average over ``dp`` only)."""
    return plan.zero_stage == 0 and grad_mesh(mesh).size() > 1 and (pipelined or plan.degrees.ep > 1)


def wraps_with_ddp(model: nn.Module, *, plan: Plan, mesh: DeviceMesh) -> bool:
    """True when ``apply_data_parallel`` will wrap ``model`` in DDP (which needs materialised parameters)."""
    return (plan.zero_stage == 0 and grad_mesh(mesh).size() > 1
            and not any(isinstance(p, DTensor) for p in model.parameters()))


def apply_data_parallel(model: nn.Module, *, plan: Plan, mesh: DeviceMesh,
                        expert_fqns: Iterable[str] = ()) -> nn.Module:
    """Wrap ``model`` for data parallelism over the batch axis; returns the module to call (DDP may wrap it)."""
    dp_mesh = grad_mesh(mesh)  # the batch axes, times cp when context parallel
    if dp_mesh.size() == 1:
        return model
    zero = plan.zero_stage
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={zero} must be 0, 1, 2 or 3")
    if wraps_with_ddp(model, plan=plan, mesh=mesh):
        if any(p.is_meta for p in model.parameters()):
            raise ConfigError("DDP (zero_stage=0) needs materialised parameters: call runtime.materialize first")
        log.info("data parallel: DDP over %d ranks", dp_mesh.size())
        return DistributedDataParallel(model, process_group=dp_mesh.get_group())
    if zero == 0:
        for block in transformer_blocks(model):
            replicate(block, mesh=dp_mesh)
        replicate(model, mesh=dp_mesh)
        log.info("data parallel: FSDP2 replicate (DDP semantics) over %d ranks with DTensor parameters", dp_mesh.size())
        return model
    reshard = zero == 3
    if zero == 1:
        log.warning("zero_stage=1 runs as FSDP2 reshard_after_forward=False (ZeRO 2 semantics): see data_parallel")
    for fqn in expert_fqns:  # the experts' own unit over the ranks that hold them (module docstring)
        fully_shard(model.get_submodule(fqn), mesh=mesh["dp"], reshard_after_forward=reshard)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    log.info("data parallel: FSDP2 zero=%d over %d ranks", zero, dp_mesh.size())
    return model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers: children of every ModuleList, in registration order."""
    return [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 and replicate modify in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def average_gradients(named_params: Iterable[tuple[str, nn.Parameter]], *, mesh: DeviceMesh,
                      expert_params: frozenset[str] = frozenset()) -> None:
    """Average the gradients in place as one process would, where no wrapper does (``averages_by_hand``).

    Expert gradients (names in ``expert_params``) already hold the mean over ep (the all-to-all backward, scaled
    by 1/ep): averaged over the outer ``dp`` axis. Every other gradient (the local shard of a TP DTensor, or a
    plain tensor) over the batch ranks (``grad_mesh``). Nothing over tp: every tp rank computed the same."""
    batch, dp_outer = grad_mesh(mesh), mesh["dp"]
    for name, p in named_params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        group = dp_outer if name in expert_params else batch
        if group.size() > 1:
            dist.all_reduce(g, group=group.get_group())
            g.div_(group.size())
