"""Collective communication time on a cluster: alpha-beta model of ring, tree and hierarchical algorithms.

Pure functions of (op, bytes, group, cluster). Conventions follow NCCL / nccl-tests:

- ``nbytes`` is the full buffer: the all-reduce buffer, the gathered all-gather output, the unreduced
  reduce-scatter input, each rank's all-to-all send buffer, the broadcast buffer, one send/recv message.
- Ring, ``n`` ranks, bandwidth ``bw`` (bus bandwidth), per-step latency ``alpha`` (Thakur, Rabenseifner and
  Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA 2005; ``costmodel.collectives``):
  all-reduce ``2 (n-1)/n S/bw + 2 (n-1) alpha``; all-gather / reduce-scatter ``(n-1)/n S/bw + (n-1) alpha``;
  all-to-all (pairwise exchange) ``(n-1)/n S/bw + (n-1) alpha``; broadcast (pipelined chain) ``S/bw + (n-1)
  alpha``; send/recv ``S/bw + alpha``. Tree: latency ``2 log2(n) alpha`` (all-reduce) or ``log2(n) alpha``
  (broadcast), bandwidth term as the ring's at ``tree_bandwidth`` of its rate.
- Placement: the group is ranks ``first_rank + k * stride``, k < size, numbered node by node (tp innermost),
  so a group with ``stride * size <= gpus_per_node`` stays in one node. ``g`` = group members per node,
  ``N`` = nodes spanned.
- Multi-node: every GPU of a node is assumed to run its own instance of the same collective at once (SPMD:
  the other tensor-parallel ranks' data-parallel all-reduces), so the ``nics_per_node`` NICs are shared by the
  node's GPUs. A flat ring crosses each node boundary once per instance: its rate is
  ``min(intra bw, node NIC bw * g / gpus_per_node)`` (nccl-tests #119 and #100: 2-3 HGX A100 with 4 HDR NICs
  measure 85-96 GB/s all-reduce busbw = 4 x 25 GB/s x 0.92). Hierarchical: reduce-scatter in the node,
  all-reduce of ``S/g`` across nodes on each GPU's rail-NIC share, all-gather in the node:
  ``2 (g-1)/g S/bw_intra + 2 (N-1)/N (S/g)/bw_nic``. The fastest of ring, tree and hierarchical is taken (what
  a tuned library picks). The slowest link of the group sets each phase's pace.
- Achievable rates = datasheet rate x ``CommEfficiency`` (one set of constants for every case, below).
- Calibration: a cluster whose calibration measured this accelerator (``calibration.accelerator`` equals the
  node's GPU name, e.g. the ``local`` cluster) uses the fitted alpha and bus bandwidth of each op instead, for
  groups inside one node (a single machine measures nothing else) and for every group of ``local``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from costmodel.collectives import COLLECTIVE_OPS, ring_terms
from costmodel.errors import ConfigError
from costmodel.hardware import Cluster, NodeType
from costmodel.memo import ByIdentity


@dataclass(frozen=True, kw_only=True, slots=True)
class CommEfficiency:
    """Achievable fraction of a link's datasheet rate (nccl-tests bus bandwidth / datasheet per direction).

    One set for every case; no per-case fitting. Sources:
    - ``nvswitch`` 0.80: nccl-tests all_reduce busbw 8x A100 NVSwitch ~230-240 GB/s of 300 (nccl-tests #100,
      #149: ~200-235); 8x H100 NVSwitch ~370 of 450 (0.82) without NVLink SHARP.
    - ``nvlink`` 0.80: point-to-point NVLink (bridges, hybrid cube mesh) as NVSwitch; DGX-1V ring all-reduce
      ~120-130 GB/s of 150.
    - ``xgmi`` 0.70: MI300X full mesh; a ring uses one 64 GB/s link per neighbour, RCCL spreads rings over
      the mesh and reaches ~300-330 GB/s all-reduce busbw of 448 (public rccl-tests reports).
    - ``pcie`` 0.60: 8 PCIe GPUs in two sockets route rings through the CPU interconnect; nccl issues #841 /
      nccl-tests #178 report 12-25 GB/s busbw on Gen4 x16 (31.5).
    - ``infiniband`` 0.92: nccl-tests #119 / #100 (A100, 4x HDR: 85-96 GB/s of 100), H100 46-48 GB/s per
      400G NIC of 50.
    - ``roce`` 0.85, ``ethernet`` 0.70 (TCP sockets): nccl issue #495 (8x 100G RoCE: ~75 GB/s of 100).
    - ``loopback`` 1.0: its numbers come from calibration.
    - ``tree_bandwidth`` 0.90: NCCL's tree reaches a little less bandwidth than its ring at large sizes.
    - ``mesh_all_to_all`` 0.50: a hybrid cube mesh connects each GPU to 4 of 7 peers; all-to-all traffic to
      the others takes two hops.
    """

    nvswitch: float = 0.80
    nvlink: float = 0.80
    xgmi: float = 0.70
    pcie: float = 0.60
    infiniband: float = 0.92
    roce: float = 0.85
    ethernet: float = 0.70
    loopback: float = 1.0
    tree_bandwidth: float = 0.90
    mesh_all_to_all: float = 0.50

    def of(self, kind: str) -> float:
        return getattr(self, kind)


DEFAULT_EFFICIENCY = CommEfficiency()


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """A communicator: ranks ``first_rank + k * stride`` for k < size (a mesh axis; ``stride`` = the product
    of the sizes of the axes inner to it, e.g. a dp group over tp=8 has stride 8)."""

    size: int
    stride: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class CommCost:
    time_s: float
    link_kind: str
    """The link kind that sets the pace (the bottleneck phase)."""
    bus_gbps: float
    """nccl-tests bus bandwidth of the predicted time: ``factor(n) * S / t`` (GB/s)."""
    algorithm: str = ""
    """``ring``, ``tree``, ``hierarchical``, ``pairwise``, ``p2p``, ``calibrated`` or ``none``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where a group's ranks sit: nodes spanned and the worst-case links among them."""

    size: int
    nodes: int
    """Nodes spanned (N)."""
    members_per_node: int
    """Smallest number of group members on one spanned node (g)."""
    node_types: tuple[NodeType, ...]
    """Distinct node types spanned."""


def _validate(op: str, nbytes: float, group: Group, cluster: Cluster, first_rank: int) -> None:
    if op not in COLLECTIVE_OPS:
        raise ConfigError(f"unknown collective {op!r}; use one of {', '.join(COLLECTIVE_OPS)}")
    if not isinstance(group.size, int) or not isinstance(group.stride, int) or group.size < 1 or group.stride < 1:
        raise ConfigError(f"group size={group.size!r}, stride={group.stride!r}: both must be integers >= 1")
    if not nbytes >= 0 or math.isinf(nbytes):
        raise ConfigError(f"nbytes={nbytes!r} must be a finite number >= 0")
    last = first_rank + (group.size - 1) * group.stride
    if first_rank < 0 or last >= cluster.num_devices:
        raise ConfigError(
            f"group size={group.size} stride={group.stride} from rank {first_rank} reaches rank {last}, beyond "
            f"cluster {cluster.name!r} of {cluster.num_devices} devices; shrink the group or add nodes"
        )


def place(group: Group, cluster: Cluster, *, first_rank: int = 0) -> Placement:
    """Nodes a group spans and members per node (arithmetic for one node type, explicit otherwise)."""
    if len(cluster.groups) == 1:
        node = cluster.groups[0].node
        return _place_uniform(group.size, group.stride, first_rank, node.gpus_per_node, node)
    return _place_general(group.size, group.stride, first_rank, cluster)


def _place_uniform(size: int, stride: int, first_rank: int, gpn: int, node: NodeType) -> Placement:
    counts: dict[int, int] = {}
    for k in range(size):
        n = (first_rank + k * stride) // gpn
        counts[n] = counts.get(n, 0) + 1
    return Placement(size=size, nodes=len(counts), members_per_node=min(counts.values()), node_types=(node,))


def _place_general(size: int, stride: int, first_rank: int, cluster: Cluster) -> Placement:
    counts: dict[int, int] = {}
    types: list[NodeType] = []
    for k in range(size):
        rank = first_rank + k * stride
        n = cluster.node_of_rank(rank)
        counts[n] = counts.get(n, 0) + 1
        node = cluster.node_type_of_rank(rank)
        if node not in types:
            types.append(node)
    return Placement(size=size, nodes=len(counts), members_per_node=min(counts.values()), node_types=tuple(types))


@dataclass(frozen=True, kw_only=True, slots=True)
class _Links:
    """Effective rates (bytes/s) and latencies of a placement, worst case over the spanned nodes."""

    intra_bps: float
    intra_alpha_s: float
    intra_kind: str
    nic_ring_bps: float
    """NIC bandwidth one instance's flat ring gets per node: node NIC total x g / gpus_per_node."""
    nic_gpu_bps: float
    """NIC bandwidth per GPU when every GPU of the node sends (rail share)."""
    nic_alpha_s: float
    nic_kind: str
    topology: str


def _links(p: Placement, eff: CommEfficiency) -> _Links:
    intra = min(p.node_types, key=lambda t: t.intra.gbps_per_direction * eff.of(t.intra.kind))
    nic_gpu = min(t.nic_gbps_per_gpu * eff.of(t.nic.kind) for t in p.node_types)
    ring_share = min(
        t.nic.gbps_per_direction * t.nics_per_node * eff.of(t.nic.kind) * p.members_per_node / t.gpus_per_node
        for t in p.node_types
    )
    slow_nic = min(p.node_types, key=lambda t: t.nic_gbps_per_gpu * eff.of(t.nic.kind))
    return _Links(
        intra_bps=intra.intra.gbps_per_direction * eff.of(intra.intra.kind) * 1e9,
        intra_alpha_s=max(t.intra.latency_s for t in p.node_types),
        intra_kind=intra.intra.kind,
        nic_ring_bps=ring_share * 1e9,
        nic_gpu_bps=nic_gpu * 1e9,
        nic_alpha_s=max(t.nic.latency_s for t in p.node_types),
        nic_kind=slow_nic.nic.kind,
        topology=intra.intra_topology,
    )


def _cost(op: str, nbytes: float, n: int, time_s: float, kind: str, algorithm: str) -> CommCost:
    factor = ring_terms(op, n)[1]
    bus = factor * nbytes / time_s / 1e9 if time_s > 0 else 0.0
    return CommCost(time_s=time_s, link_kind=kind, bus_gbps=bus, algorithm=algorithm)


def _ring(op: str, nbytes: float, n: int, bw_bps: float, alpha_s: float) -> float:
    steps, factor = ring_terms(op, n)
    return steps * alpha_s + factor * nbytes / bw_bps


def _tree(op: str, nbytes: float, n: int, bw_bps: float, alpha_s: float, eff: CommEfficiency) -> float:
    """Double binary tree (all-reduce) / binomial tree (broadcast)."""
    depth = math.ceil(math.log2(n))
    if op == "all_reduce":
        return 2.0 * depth * alpha_s + 2.0 * (n - 1) / n * nbytes / (bw_bps * eff.tree_bandwidth)
    return depth * alpha_s + nbytes / (bw_bps * eff.tree_bandwidth)  # broadcast


def _single_node(op: str, nbytes: float, n: int, links: _Links, eff: CommEfficiency) -> CommCost:
    bw, alpha, kind = links.intra_bps, links.intra_alpha_s, links.intra_kind
    if op == "all_to_all" and links.topology == "hybrid-cube-mesh":
        bw *= eff.mesh_all_to_all
    if op == "send_recv":
        return _cost(op, nbytes, n, alpha + nbytes / bw, kind, "p2p")
    ring = _ring(op, nbytes, n, bw, alpha)
    if op in ("all_reduce", "broadcast"):
        tree = _tree(op, nbytes, n, bw, alpha, eff)
        if tree < ring:
            return _cost(op, nbytes, n, tree, kind, "tree")
    return _cost(op, nbytes, n, ring, kind, "pairwise" if op == "all_to_all" else "ring")


def _multi_node(op: str, nbytes: float, p: Placement, links: _Links, eff: CommEfficiency) -> CommCost:
    n, g, nodes = p.size, p.members_per_node, p.nodes
    alpha = max(links.intra_alpha_s, links.nic_alpha_s)
    # flat ring / tree over all n ranks: bottleneck of the intra hops (if any) and the node-boundary crossing
    ring_bw = links.nic_ring_bps if g == 1 else min(links.intra_bps, links.nic_ring_bps)
    ring_kind = links.nic_kind if ring_bw == links.nic_ring_bps else links.intra_kind
    if op == "send_recv":
        return _cost(op, nbytes, n, links.nic_alpha_s + nbytes / links.nic_gpu_bps, links.nic_kind, "p2p")
    if op == "all_to_all":
        intra_t = (g - 1) / n * nbytes / links.intra_bps
        inter_t = (n - g) / n * nbytes / links.nic_gpu_bps
        kind = links.nic_kind if inter_t >= intra_t else links.intra_kind
        return _cost(op, nbytes, n, (n - 1) * alpha + max(intra_t, inter_t), kind, "pairwise")
    candidates = [(_ring(op, nbytes, n, ring_bw, alpha), ring_kind, "ring")]
    if op in ("all_reduce", "broadcast"):
        candidates.append((_tree(op, nbytes, n, ring_bw, alpha, eff), ring_kind, "tree"))
    if g > 1 and op in ("all_reduce", "all_gather", "reduce_scatter"):
        candidates.append(_hierarchical(op, nbytes, g, nodes, links))
    time_s, kind, algorithm = min(candidates, key=lambda c: c[0])
    return _cost(op, nbytes, n, time_s, kind, algorithm)


def _hierarchical(op: str, nbytes: float, g: int, nodes: int, links: _Links) -> tuple[float, str, str]:
    """Intra reduce-scatter (S over g) + inter collective of S/g over N on rail NICs + intra all-gather."""
    intra_op = "reduce_scatter" if op != "all_gather" else "all_gather"
    intra_t = _ring(intra_op, nbytes, g, links.intra_bps, links.intra_alpha_s)
    if op == "all_reduce":
        intra_t *= 2.0  # reduce-scatter before and all-gather after
    inter_t = _ring(op, nbytes / g, nodes, links.nic_gpu_bps, links.nic_alpha_s)
    kind = links.nic_kind if inter_t >= intra_t else links.intra_kind
    return intra_t + inter_t, kind, "hierarchical"


def _calibrated(op: str, nbytes: float, n: int, cluster: Cluster, kind: str, nodes: int) -> CommCost | None:
    """The fitted model of a calibration of this accelerator: for groups inside one node (what a single
    machine can measure), or for any group of the ``local`` cluster (all its links are the loopback)."""
    cal = cluster.calibration
    if cal is None or cal.accelerator not in cluster.gpu_names:
        return None
    if nodes > 1 and kind != "loopback":
        return None
    fit = cal.collective_fit(op, n) or (cal.collective_fit("all_reduce", n) if op == "broadcast" else None)
    if fit is None:
        return None
    steps, factor = ring_terms(op, n)
    time_s = steps * fit.latency_s + factor * nbytes / (fit.bus_gbps * 1e9)
    return _cost(op, nbytes, n, time_s, kind, "calibrated")


def collective_time_s(
    op: str,
    nbytes: float,
    group: Group,
    cluster: Cluster,
    *,
    first_rank: int = 0,
    efficiency: CommEfficiency | None = None,
) -> CommCost:
    """Predicted time of ``op`` on ``nbytes`` (NCCL convention, see module doc) for ``group`` on ``cluster``.

    Memoized (a pure function of its arguments; the cluster, immutable, by identity)."""
    key = (op, nbytes, type(nbytes), group.size, group.stride, first_rank, ByIdentity(cluster), efficiency)
    try:
        hash(key)
    except TypeError:  # an unhashable argument: price it unmemoized (the checks name a bad value)
        return _collective_time_s(op, nbytes, group, cluster, first_rank=first_rank, efficiency=efficiency)
    return _collective_cached(*key)



@functools.lru_cache(maxsize=16384)
def _collective_cached(op: str, nbytes: float, nbytes_type: type, size: int, stride: int, first_rank: int,
                       cluster: ByIdentity, efficiency: CommEfficiency | None) -> CommCost:
    """``nbytes_type`` keeps 4 and 4.0 (equal keys) apart, so the cost's numbers keep the caller's types."""
    return _collective_time_s(op, nbytes, Group(size=size, stride=stride), cluster.obj, first_rank=first_rank,
                              efficiency=efficiency)


def _collective_time_s(op: str, nbytes: float, group: Group, cluster: Cluster, *, first_rank: int,
                       efficiency: CommEfficiency | None) -> CommCost:
    _validate(op, nbytes, group, cluster, first_rank)
    placement, links = _geometry(group.size, group.stride, first_rank, cluster, efficiency or DEFAULT_EFFICIENCY)
    if group.size == 1 or nbytes == 0:
        return CommCost(time_s=0.0, link_kind=links.intra_kind, bus_gbps=0.0, algorithm="none")
    kind = links.intra_kind if placement.nodes == 1 else links.nic_kind
    calibrated = _calibrated(op, nbytes, group.size, cluster, kind, placement.nodes)
    if calibrated is not None:
        return calibrated
    if placement.nodes == 1:
        return _single_node(op, nbytes, group.size, links, efficiency or DEFAULT_EFFICIENCY)
    return _multi_node(op, nbytes, placement, links, efficiency or DEFAULT_EFFICIENCY)


def _geometry(size: int, stride: int, first_rank: int, cluster: Cluster, eff: CommEfficiency) -> tuple[Placement, _Links]:
    return _geometry_cached(size, stride, first_rank, cluster.groups, eff)


@functools.lru_cache(maxsize=8192)
def _geometry_cached(size: int, stride: int, first_rank: int, groups: tuple, eff: CommEfficiency) -> tuple[Placement, _Links]:
    placement = place(Group(size=size, stride=stride), Cluster(name="", groups=groups), first_rank=first_rank)
    return placement, _links(placement, eff)
