"""``auto_wrap(model, example_inputs, loss_fn=...)``: the one call in a training script under torchrun.

Rank 0 loads (a path), takes (a ``Plan``) or makes (``planner.plan_model`` for the running world) the plan and
broadcasts it, so every rank applies the same one; each rank checks it belongs to this model and world size and
applies it with ``runtime.apply_plan``. A planning error on rank 0 is raised on every rank with its type.
"""

from __future__ import annotations

import logging
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
) -> ParallelModel:
    """Load (path), take (Plan) or make (None: ``planner.plan_model`` for ``cluster``, default this machine with
    the running world size) a plan on rank 0, broadcast it so every rank applies the same one, check it belongs to
    this model and world size, and apply it. ``example_inputs``: one global batch (its shape sets the batch and
    sequence length the planner plans for)."""
    info = init_distributed()
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
    return apply_plan(model, agreed, loss_fn=loss_fn, seed=seed)


def _error_type(name: str) -> type[Exception]:
    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, errors.AutoparError) else RuntimeError


def _resolve_plan(model: nn.Module, example_inputs: Any, *, plan: Any, cluster: Any, world_size: int) -> Plan:
    if isinstance(plan, Plan):
        return plan
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
        cluster_obj = resolve_cluster(cluster or "local", nodes=1, gpus_per_node=world_size)
    return plan_model(model, cluster_obj, global_batch=int(inputs[0].shape[0]), example_inputs=inputs)
