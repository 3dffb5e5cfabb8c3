"""``auto_wrap(model, example_inputs, loss_fn=...)``: the one call in a training script under torchrun.

Rank 0 loads (a path), takes (a ``Plan``), picks (a directory of plan files: the one written for the running world
size) or makes (``planner.plan_model`` for the running world: torchrun's nodes x ranks per node) the plan and
broadcasts it, so every rank applies the same one; each rank checks it belongs to this model and world size and
applies it with ``runtime.apply_plan``. A planning error on rank 0 is raised on every rank with its type.

With ``checkpoint_dir`` the model saves every ``checkpoint_every`` steps and ``pm.resume(optimizer)`` loads the
latest complete checkpoint, whichever plan and world size wrote it (``runtime.parallel_model``). Under
``torchrun --max-restarts K`` a restarted or resized job (``--nnodes MIN:MAX``) runs the same script: with
``plan=None`` or a plan directory it gets a plan for the ranks it now has and continues from the checkpoint.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.nn as nn

import costmodel.errors as errors
from costmodel.errors import ConfigError
from costmodel.profiles import resolve_cluster
from planner import plan_model
from planner.plan import Plan, check_plan_matches, load_plan, module_fingerprint
from runtime.apply import apply_plan
from runtime.mesh import init_distributed
from runtime.parallel_model import LossFn, ParallelModel

log = logging.getLogger(__name__)


def auto_wrap(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn,
    plan: Plan | str | Path | None = None,
    cluster: Any = None,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int | None = None,
    async_checkpoint: bool = True,
    checkpoint_keep: int = 2,
    timeout_s: float | None = None,
) -> ParallelModel:
    """Load (a plan file), take (Plan), pick (a directory: the plan file for this world size) or make (None:
    ``planner.plan_model`` for ``cluster``, default ``local`` with the launch's nodes x ranks per node) a plan on
    rank 0, broadcast it so every rank applies the same one, check it belongs to this model and world size, and
    apply it. ``example_inputs``: one global batch (its shape sets the batch and sequence length the planner plans
    for). ``checkpoint_dir`` / ``checkpoint_every``: save model + optimizer + step there every N steps (async DCP
    unless ``async_checkpoint=False``), keeping the newest ``checkpoint_keep``; call ``pm.resume(optimizer)``
    before training. ``timeout_s``: collective timeout if this call creates the process group
    (``runtime.mesh.init_distributed``)."""
    if (checkpoint_dir is None) != (checkpoint_every is None):
        raise ConfigError("give checkpoint_dir and checkpoint_every together (a directory and an interval in steps)")
    info = init_distributed(timeout_s=timeout_s)
    payload: list[Any] = [None]
    if info.rank == 0:
        try:
            resolved = _resolve_plan(model, example_inputs, plan=plan, cluster=cluster, world_size=info.world_size)
            payload = [("ok", resolved.to_dict())]
        except Exception as e:  # noqa: BLE001 - sent to every rank, re-raised there with its type
            payload = [("err", type(e).__name__, str(e))]
    if info.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if payload[0][0] == "err":
        _, kind, msg = payload[0]
        err_type = _error_type(kind)
        text = msg if err_type is not RuntimeError else f"planning on rank 0 raised {kind}: {msg}"
        raise err_type(text if info.rank == 0 else f"(from rank 0) {text}")
    agreed = Plan.from_dict(payload[0][1])
    check_plan_matches(agreed, fingerprint=module_fingerprint(model), world_size=info.world_size)
    log.info("auto_wrap: plan degrees %s, zero %d, schedule %s", agreed.degrees, agreed.zero_stage, agreed.schedule)
    pm = apply_plan(model, agreed, loss_fn=loss_fn, seed=seed)
    if checkpoint_dir is not None:
        pm.checkpoint_to(checkpoint_dir, every_steps=int(checkpoint_every), async_save=async_checkpoint,
                         keep=checkpoint_keep)
    return pm


def _error_type(name: str) -> type[Exception]:
    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, errors.AutoparError) else RuntimeError


def _resolve_plan(model: nn.Module, example_inputs: Any, *, plan: Any, cluster: Any, world_size: int) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)) and Path(plan).is_dir():
        return plan_for_world(Path(plan), fingerprint=module_fingerprint(model), world_size=world_size)
    if isinstance(plan, (str, Path)):
        return load_plan(plan)
    if plan is not None:
        raise ConfigError(f"plan= must be a Plan, a plan file path or None, got {type(plan).__name__}")
    return _plan_for(model, example_inputs, cluster=cluster, world_size=world_size)


def _plan_for(model: nn.Module, example_inputs: Any, *, cluster: Any, world_size: int) -> Plan:
    """Plan with the planner's public entry, which traces this very module (torch.export fakes its weights; the
    module is not changed) at the batch ``example_inputs`` holds: any PyTorch model, not only Hugging Face ones."""
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not hasattr(inputs[0], "shape") or len(inputs[0].shape) < 1:
        raise ConfigError("auto_wrap(plan=None) needs example_inputs: one global batch of the model's positional "
                          "inputs, batch first")
    if not isinstance(cluster, (str, type(None))):
        cluster_obj = cluster
    else:
        nodes, per_node = launch_shape(world_size)
        cluster_obj = resolve_cluster(cluster or "local", nodes=nodes, gpus_per_node=per_node)
    return plan_model(model, cluster_obj, global_batch=int(inputs[0].shape[0]), example_inputs=inputs)


def launch_shape(world_size: int) -> tuple[int, int]:
    """(nodes, ranks per node) of this launch: torchrun's GROUP_WORLD_SIZE x LOCAL_WORLD_SIZE when they make up
    the world, else one node of ``world_size``."""
    try:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    except ValueError:
        return 1, world_size
    return (nodes, per_node) if nodes * per_node == world_size and nodes >= 1 else (1, world_size)


def plan_for_world(directory: Path, *, fingerprint: str, world_size: int) -> Plan:
    """The plan file in ``directory`` (``*.json``) made for this model and ``world_size`` devices; of several,
    the one whose nodes x GPUs per node is the launch's, then the first by name."""
    found: dict[int, list[str]] = {}
    matching: list[tuple[str, Plan]] = []
    for path in sorted(directory.glob("*.json")):
        try:
            p = load_plan(path)
        except errors.PlanMismatchError:
            continue
        if p.model.fingerprint != fingerprint:
            continue
        found.setdefault(p.degrees.world_size, []).append(path.name)
        if p.degrees.world_size == world_size:
            matching.append((path.name, p))
    if not matching:
        have = ", ".join(f"{w} ({', '.join(names)})" for w, names in sorted(found.items())) or "none"
        raise errors.PlanMismatchError(
            f"{directory} holds no plan for this model on {world_size} ranks (world sizes it has: {have}): write "
            f"one with `autopar plan ... --nodes N --gpus-per-node G --out {directory}/plan-{world_size}.json`, "
            "or pass plan=None to plan here"
        )
    nodes, per_node = launch_shape(world_size)
    same_shape = [(n, p) for n, p in matching if (p.cluster.nodes, p.cluster.gpus_per_node) == (nodes, per_node)]
    name, chosen = (same_shape or matching)[0]
    log.info("auto_wrap: %s is the plan for %d ranks in %s", name, world_size, directory)
    return chosen
