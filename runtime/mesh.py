"""Process group and DeviceMesh from a Plan.

``init_distributed()`` is the one place that reads RANK / WORLD_SIZE / LOCAL_RANK (as ``torchrun`` sets them):
gloo on CPU, NCCL on CUDA. ``build_mesh(plan, device_type=...)`` lays the ranks row-major over the plan's
``MeshSpec`` axes ("pp", "dp", "ep", "cp", "tp"), tp innermost, exactly as ``planner.plan`` documents.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from costmodel.errors import ConfigError, PlanMismatchError
from planner.plan import Plan
from runtime.measure.spawn import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device_type: str
    """``cuda`` or ``cpu``: the device type meshes and parameters use."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; unset it or launch with torchrun")
    

def init_distributed(*, backend: str | None = None) -> DistInfo:
    """Initialise the default process group from the torchrun environment (idempotent).

    Without RANK / WORLD_SIZE in the environment this is a 1-rank world (MASTER_ADDR/PORT default to a local
    free port), so a training script also runs as a plain ``python train.py``.
    """
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    device_type = "cuda" if use_cuda else "cpu"
    if dist.is_initialized():
        return DistInfo(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=_env_int("LOCAL_RANK", dist.get_rank()),
            backend=dist.get_backend(),
            device_type=device_type,
        )
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world_size}; launch with torchrun")
    backend = backend or ("nccl" if use_cuda else "gloo")
    if "MASTER_ADDR" not in os.environ:
        if world_size > 1:
            raise ConfigError(f"WORLD_SIZE={world_size} but MASTER_ADDR is not set: launch with torchrun")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    log.info("process group up: rank %d of %d, backend %s", rank, world_size, backend)
    return DistInfo(
        rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device_type=device_type
    )


def build_mesh(plan: Plan, *, device_type: str) -> DeviceMesh:
    """The 5-D DeviceMesh of ``plan.mesh`` (size-1 axes included, so ``mesh["tp"]`` always exists)."""
    if not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialised: call runtime.init_distributed() first")
    world_size = dist.get_world_size()
    sizes = tuple(plan.mesh.axis_sizes)
    total = 1
    for s in sizes:
        total *= s
    if total != world_size:
        raise PlanMismatchError(
            f"plan mesh {dict(zip(plan.mesh.axis_names, sizes))} needs {total} ranks but {world_size} are "
            f"running: launch {total} ranks or re-plan for {world_size}"
        )
    return init_device_mesh(device_type, mesh_shape=sizes, mesh_dim_names=tuple(plan.mesh.axis_names))


def batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh the batch is split over (``dp`` x ``ep``; the plan puts the data-parallel degree there)."""
    if mesh["ep"].size() == 1:
        return mesh["dp"]
    return mesh["dp", "ep"]._flatten("dp_ep")


def grad_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh that averages the gradients of replicated parameters (and that ZeRO shards over): the batch
    axes, times ``cp`` (each cp rank computes the gradient of its tokens' loss; ``runtime.context_parallel``)."""
    if mesh["cp"].size() == 1:
        return batch_mesh(mesh)
    if mesh["ep"].size() > 1:
        raise ConfigError(
            f"mesh has cp={mesh['cp'].size()} and ep={mesh['ep'].size()}: context parallel runs with ep=1; "
            "re-plan with --fix ep=1 or --fix cp=1"
        )
    return mesh["dp", "cp"]._flatten("dp_cp")


def batch_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index in the batch split and the number of batch shards."""
    dp = batch_mesh(mesh)
    return dp.get_local_rank(), dp.size()
