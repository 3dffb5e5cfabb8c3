"""``apply_plan(model, plan)``: check the plan once, build the mesh, run ``runtime.parallelize`` on the whole model
(pp = 1) or on each local pipeline chunk (``runtime.pipeline``), and return the ``ParallelModel``."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from costmodel.errors import ConfigError
from planner.plan import Plan, check_plan_matches, module_fingerprint
from runtime.context_parallel import check_context_parallel
from runtime.data_parallel import averages_by_hand
from runtime.expert_parallel import check_expert_plan, expert_param_names, use_grouped_gemm_experts
from runtime.mesh import build_mesh, init_distributed
from runtime.parallel_model import LossFn, ParallelModel
from runtime.parallelize import Parallelized, parallelize
from runtime.pipeline import PipelineChunk, build_pipeline

log = logging.getLogger(__name__)


def check_plan_runs(plan: Plan) -> None:
    """Refuse (ConfigError, with the degrees and the fix) a plan this runtime cannot run: ep not dividing dp, cp
    with pp or ep, a ZeRO stage outside 0-3."""
    check_expert_plan(plan)
    check_context_parallel(plan)
    if plan.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={plan.zero_stage} must be 0, 1, 2 or 3")


def apply_plan(
    model: nn.Module,
    plan: Plan,
    *,
    mesh: DeviceMesh | None = None,
    loss_fn: LossFn | None = None,
    seed: int = 0,
) -> ParallelModel:
    """Apply ``plan`` to ``model`` on the running process group (initialised from the torchrun environment if it
    is not yet): Hugging Face MoE experts as grouped GEMMs (``use_grouped_gemm_experts``), recomputation, TP/SP,
    experts, CP, DP/ZeRO, then a meta-device model is materialised as local
    shards (seeded per module FQN); with pp > 1 the same per local pipeline chunk."""
    info = init_distributed()
    check_plan_matches(plan, fingerprint=module_fingerprint(model), world_size=dist.get_world_size())
    check_plan_runs(plan)
    use_grouped_gemm_experts(model)
    mesh = mesh if mesh is not None else build_mesh(plan, device_type=info.device_type)
    device = torch.device("cuda", torch.cuda.current_device()) if info.device_type == "cuda" else torch.device("cpu")
    pipelined = plan.degrees.pp > 1
    if not pipelined:
        part = parallelize(model, plan=plan, mesh=mesh, device=device, seed=seed)
        return ParallelModel(
            module=part.module, plan=plan, mesh=mesh, loss_fn=loss_fn, context=part.context,
            average_grads=averages_by_hand(plan, mesh, pipelined=False),
            expert_params=expert_param_names(list(part.expert_fqns)),
        )
    if loss_fn is None:
        raise ConfigError("a pipelined plan (pp > 1) needs loss_fn: the last stage computes the loss")
    parts: list[Parallelized] = []

    def parallelize_chunk(chunk: PipelineChunk) -> nn.Module:
        parts.append(parallelize(chunk, plan=plan, mesh=mesh, device=device, seed=seed, init_owner=model))
        return parts[-1].module

    runner = build_pipeline(model, plan=plan, mesh=mesh, loss_fn=loss_fn, parallelize_chunk=parallelize_chunk)
    return ParallelModel(
        module=model, plan=plan, mesh=mesh, loss_fn=loss_fn, pipeline=runner,
        average_grads=averages_by_hand(plan, mesh, pipelined=True),
        expert_params=expert_param_names([f for p in parts for f in p.expert_fqns]),
    )
