"""Process group and DeviceMesh from a Plan.

``init_distributed()`` is the one place that reads RANK / WORLD_SIZE / LOCAL_RANK (as ``torchrun`` sets them):
gloo on CPU, NCCL on CUDA, with a bounded collective timeout (``timeout_s``, default ``AUTOPAR_TIMEOUT_S`` or
600 s), so a rank that hangs makes the others fail instead of waiting forever.

``build_mesh(plan, device_type=...)`` lays the ranks row-major over the plan's ``MeshSpec`` axes ("pp", "dp",
"ep", "cp", "tp"), tp innermost, exactly as ``planner.plan`` documents, over the ranks numbered node by node
(ordered by torchrun's GROUP_RANK, then LOCAL_RANK, gathered from every rank): the numbering the cost model
prices (``costmodel.comm.place``). So with tp x cp dividing the plan's ``gpus_per_node``, tensor and context
parallel groups stay inside a node and data / pipeline groups cross nodes. Under torchrun the launch must match
the plan's cluster: LOCAL_WORLD_SIZE (``--nproc-per-node``) = ``gpus_per_node`` and the node count
(``--nnodes``) = ``nodes``, else ``PlanMismatchError`` (``check_launch``).
"""

from __future__ import annotations

import datetime
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
    

DEFAULT_TIMEOUT_S = 600.0
"""Collective timeout when neither ``timeout_s`` nor ``AUTOPAR_TIMEOUT_S`` is given (NCCL's default in torch)."""


def collective_timeout_s(timeout_s: float | None = None) -> float:
    """``timeout_s``, else ``AUTOPAR_TIMEOUT_S``, else ``DEFAULT_TIMEOUT_S``; a positive number of seconds."""
    if timeout_s is None:
        raw = os.environ.get("AUTOPAR_TIMEOUT_S")
        try:
            timeout_s = float(raw) if raw is not None else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ConfigError(f"AUTOPAR_TIMEOUT_S={raw!r} is not a number of seconds") from None
    if not timeout_s > 0:
        raise ConfigError(f"collective timeout {timeout_s!r} s must be > 0")
    return float(timeout_s)


def init_distributed(*, backend: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Initialise the default process group from the torchrun environment (idempotent).

    Without RANK / WORLD_SIZE in the environment this is a 1-rank world (MASTER_ADDR/PORT default to a local
    free port), so a training script also runs as a plain ``python train.py``. Collectives time out after
    ``collective_timeout_s(timeout_s)`` seconds (ignored when the group already exists).
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
    timeout = datetime.timedelta(seconds=collective_timeout_s(timeout_s))
    store = _restart_safe_store(world_size, timeout)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
    log.info("process group up: rank %d of %d, backend %s", rank, world_size, backend)
    return DistInfo(
        rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device_type=device_type
    )


def _restart_safe_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's shared rendezvous store (TORCHELASTIC_USE_AGENT_STORE=True, the c10d default) the store
    outlives a restart and the process group's keys from the failed attempt are read again (gloo connects to the
    dead ranks' addresses: pytorch/pytorch#135712). Prefix the keys with the restart count and world size; None
    (torch's own env:// store) otherwise. Multi-node restarts: the agents' restart counts can differ, so there
    launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (``autopar launch`` does)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                         timeout=timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"autopar/attempt_{restart}/world_{world_size}", base)


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
    layout = gather_layout()
    check_launch(plan, layout)
    names = tuple(plan.mesh.axis_names)
    order = layout.node_major_order()
    if order == list(range(world_size)):
        return init_device_mesh(device_type, mesh_shape=sizes, mesh_dim_names=names)
    log.info("ranks are not numbered node by node; mesh laid over ranks %s", order)
    return DeviceMesh(device_type, torch.tensor(order, dtype=torch.int).reshape(sizes), mesh_dim_names=names)


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Where every rank runs: ``node[r]`` (torchrun's GROUP_RANK) and ``local[r]`` (LOCAL_RANK) of global rank
    r, and the launch's LOCAL_WORLD_SIZE / node count (None outside torchrun: a single-node world)."""

    node: tuple[int, ...]
    local: tuple[int, ...]
    local_world_size: int | None
    nnodes: int

    def node_major_order(self) -> list[int]:
        """Global ranks sorted by (node, local rank): mesh position i holds rank ``order[i]``."""
        return sorted(range(len(self.node)), key=lambda r: (self.node[r], self.local[r]))


def gather_layout() -> Layout:
    """Every rank's (GROUP_RANK, LOCAL_RANK) (collective on the default group; torchrun sets both)."""
    rank = dist.get_rank()
    mine = (_env_int("GROUP_RANK", 0), _env_int("LOCAL_RANK", rank))
    everyone: list[tuple[int, int]] = [mine] * dist.get_world_size()
    if dist.get_world_size() > 1:
        dist.all_gather_object(everyone, mine)
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    return Layout(node=tuple(n for n, _ in everyone), local=tuple(lr for _, lr in everyone),
                  local_world_size=_env_int("LOCAL_WORLD_SIZE", 0) if lws is not None else None,
                  nnodes=len({n for n, _ in everyone}))


def check_launch(plan: Plan, layout: Layout) -> None:
    """Refuse a launch whose nodes are not the plan's: under torchrun (LOCAL_WORLD_SIZE set), ranks per node
    must equal ``plan.cluster.gpus_per_node`` and the node count ``plan.cluster.nodes`` (the placement the cost
    model priced); the ranks of each node must be ``0 .. LOCAL_WORLD_SIZE - 1``."""
    c = plan.cluster
    if layout.local_world_size is None:
        return
    per_node: dict[int, list[int]] = {}
    for n, lr in zip(layout.node, layout.local):
        per_node.setdefault(n, []).append(lr)
    uneven = {n: sorted(lrs) for n, lrs in per_node.items() if sorted(lrs) != list(range(layout.local_world_size))}
    if uneven:
        raise PlanMismatchError(
            f"local ranks per node {uneven} are not 0..{layout.local_world_size - 1}: launch the same "
            "--nproc-per-node on every node"
        )
    if layout.local_world_size != c.gpus_per_node or layout.nnodes != c.nodes:
        raise PlanMismatchError(
            f"plan was made for {c.nodes} node(s) x {c.gpus_per_node} GPUs per node ({c.name}), but torchrun "
            f"launched {layout.nnodes} node(s) x {layout.local_world_size} ranks per node: launch with --nnodes "
            f"{c.nodes} --nproc-per-node {c.gpus_per_node} (`autopar launch plan.json -- train.py` prints it), or "
            f"re-plan for the launch (`autopar plan --nodes {layout.nnodes} --gpus-per-node "
            f"{layout.local_world_size}`)"
        )


def group_nodes(mesh: DeviceMesh, axis: str, layout: Layout) -> list[int]:
    """The nodes (GROUP_RANK) of the ranks in this rank's ``axis`` group, in group order."""
    ranks = dist.get_process_group_ranks(mesh.get_group(axis))
    return [layout.node[r] for r in ranks]


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
