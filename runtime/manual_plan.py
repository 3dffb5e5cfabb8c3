"""Hand-made plans for a model (no planner needed): Megatron-style TP styles by module name, given degrees.

For tests, examples and for running a configuration the user chose. ``megatron_shardings(model)`` names the
styles the planner's intra-op search would pick for the Megatron layout: q/k/v, fc1, gate/up -> colwise;
out/o projections, fc2, down -> rowwise; token embedding -> vocab_embedding; LM head -> vocab_head; every norm ->
sequence_parallel. ``manual_plan(model, ...)`` wraps them with degrees, one pipeline stage per pp rank (layers
split evenly, embedding first, norm and head last) and the schedule into a ``planner.plan.Plan`` whose
fingerprint is the model's (``Plan.build`` / ``StagePlan.placed``: the plan builder the planner uses too).
"""

from __future__ import annotations

import torch.nn as nn

from costmodel.errors import ConfigError
from planner.plan import (
    ClusterInfo,
    ModelInfo,
    ModuleSharding,
    ParallelDegrees,
    Plan,
    Prediction,
    ScheduleSpec,
    SolverStats,
    StagePlan,
    module_fingerprint,
)
from runtime.checkpointing import transformer_layers

_COLWISE = ("q_proj", "k_proj", "v_proj", "fc1", "gate_proj", "up_proj")
_ROWWISE = ("out_proj", "o_proj", "fc2", "down_proj")
_EMBED = ("embed_tokens",)
_HEAD = ("lm_head",)


def megatron_shardings(model: nn.Module, *, sequence_parallel: bool = False) -> tuple[ModuleSharding, ...]:
    out = []
    for fqn, mod in model.named_modules():
        leaf = fqn.rpartition(".")[2]
        if isinstance(mod, nn.Linear) and leaf in _COLWISE:
            out.append(ModuleSharding(fqn=fqn, style="colwise"))
        elif isinstance(mod, nn.Linear) and leaf in _ROWWISE:
            out.append(ModuleSharding(fqn=fqn, style="rowwise"))
        elif isinstance(mod, nn.Embedding) and leaf in _EMBED:
            out.append(ModuleSharding(fqn=fqn, style="vocab_embedding"))
        elif isinstance(mod, nn.Linear) and leaf in _HEAD:
            out.append(ModuleSharding(fqn=fqn, style="vocab_head"))
        elif sequence_parallel and "norm" in type(mod).__name__.lower() and any(True for _ in mod.parameters(recurse=False)):
            out.append(ModuleSharding(fqn=fqn, style="sequence_parallel"))
    return tuple(out)


def _stages(model: nn.Module, *, pp: int, world_size: int, recompute: str,
            recompute_layers: int) -> list[StagePlan]:
    """One stage per pipeline rank: the transformer layers split evenly (the first stages take one more)."""
    layers = transformer_layers(model)
    if pp > 1 and not layers:
        raise ConfigError(f"{type(model).__name__} has no ModuleList of layers to cut into pipeline stages")
    if pp > 1 and len(layers) < pp:
        raise ConfigError(f"{len(layers)} layers cannot fill pp={pp} stages; choose pp <= {len(layers)}")
    per, extra = divmod(len(layers), pp)
    stages, lo = [], 0
    for i in range(pp):
        hi = lo + per + (1 if i < extra else 0)
        stages.append(StagePlan.placed(i, pp=pp, world_size=world_size, modules=tuple(layers[lo:hi]),
                                       recompute=recompute, recompute_layers=recompute_layers))
        lo = hi
    return stages


def manual_plan(
    model: nn.Module,
    *,
    tp: int = 1,
    cp: int = 1,
    dp: int = 1,
    pp: int = 1,
    zero_stage: int = 0,
    sequence_parallel: bool = False,
    recompute: str = "none",
    recompute_layers: int = -1,
    microbatch_size: int = 1,
    num_microbatches: int = 1,
    schedule: str = "1f1b",
    seq_len: int = 0,
    name: str = "manual",
    shardings: tuple[ModuleSharding, ...] | None = None,
    nodes: int = 1,
) -> Plan:
    """A Plan with the given degrees for ``model`` (module names from ``megatron_shardings`` when tp > 1).

    ``cp`` > 1: context parallel (``runtime.context_parallel``); ``seq_len`` (if given) must be divisible by 2 cp.
    ``recompute``: every stage's activation recomputation (none / selective / full), on the first
    ``recompute_layers`` layers of each stage (-1: all). ``nodes``: the plan's cluster is ``nodes`` local nodes of
    world / nodes ranks each (the launch must match: ``runtime.mesh.check_launch``)."""
    degrees = ParallelDegrees(tp=tp, cp=cp, dp=dp, pp=pp)
    world = degrees.world_size
    if nodes < 1 or world % nodes:
        raise ConfigError(f"nodes={nodes} must be >= 1 and divide the world size {world}")
    if shardings is None:
        shardings = megatron_shardings(model, sequence_parallel=sequence_parallel) if tp > 1 else ()
    return Plan.build(
        model=ModelInfo(
            name=name,
            fingerprint=module_fingerprint(model),
            params=sum(p.numel() for p in model.parameters()),
            flops_per_step=0.0,
            num_layers=len(transformer_layers(model)),
            seq_len=seq_len,
        ),
        cluster=ClusterInfo(name="local", num_devices=world, nodes=nodes, gpus_per_node=world // nodes,
                            gpu="cpu"),
        degrees=degrees,
        stages=_stages(model, pp=pp, world_size=world, recompute=recompute, recompute_layers=recompute_layers),
        shardings=shardings,
        zero_stage=zero_stage,
        sequence_parallel=sequence_parallel,
        schedule=ScheduleSpec(name=schedule, microbatch_size=microbatch_size, num_microbatches=num_microbatches),
        prediction=Prediction(
            step_time_s=0.0, tokens_per_s=0.0, model_tflops_per_gpu=0.0, hw_tflops_per_gpu=0.0, mfu=0.0,
            memory_gb_per_device=0.0, fits=True,
        ),
        solver=SolverStats(status="fixed"),
    )
