"""Collective communication time on a cluster: NCCL's algorithms as latency + bytes over ramped bus bandwidth.

Pure functions of (op, bytes, group, cluster). Conventions follow NCCL / nccl-tests:

- ``nbytes`` is the full buffer: the all-reduce buffer, the gathered all-gather output, the unreduced
  reduce-scatter input, each rank's all-to-all send buffer, the broadcast buffer, one send/recv message.
- Every algorithm is ``latency + bytes / rate`` per phase (alpha-beta). A phase's rate is its link's plateau
  bus bandwidth times the message-size ramp of that link's published nccl-tests curve (``profiles/
  comm_curves.toml``, ``costmodel.comm_ramp``), read at the phase's bytes; a link without a curve runs at
  ``CommEfficiency``'s fraction of its datasheet rate. Ring terms on ``n`` ranks: all-reduce ``2 (n-1)``
  steps and ``2 (n-1)/n S``; all-gather / reduce-scatter / all-to-all ``n-1`` and ``(n-1)/n S``; broadcast
  ``n-1`` and ``S``; send/recv 1 and ``S``.
- Latency (NCCL ``src/graph/tuning.cc``): a launch ``base_latency_s`` plus one link alpha per ring step,
  intra-node steps at the NVLink alpha and node-crossing steps at the NIC's. Tree: ``2 ((g-1) a_intra +
  log2(N) a_nic)`` (a chain inside each node, a tree across nodes). NVLS: ``nvls_latency_s``. PAT: ``8 us +
  log2(N) a_nic / 3.5 + n 2.8 us``.
- Algorithms, the fastest of those NCCL has for the op, size and group being taken (what its tuner picks):
  ring (all ops); double-binary tree (all-reduce across nodes); NVLS (all-reduce inside an NVSwitch domain
  whose link has an ``nvls`` curve: the switch reduces, bus bandwidth ~480 GB/s on 8x H100 against ~370 for
  the ring); NVLS tree (NVLS inside each node, a tree across nodes); in-network all-reduce (IB SHARP, NCCL
  CollNet, where the NIC link says ``sharp``); PAT (all-gather / reduce-scatter with one GPU of the group per
  node, NCCL 2.23+); pairwise all-to-all; point-to-point send/recv. Multi-phase algorithms are pipelined:
  the slowest phase sets the pace.
- Placement: the group is ranks ``first_rank + k * stride``, k < size, numbered node by node (tp innermost);
  ``g`` = group members per node, ``N`` = nodes spanned. Every GPU of a node is assumed to run its own
  instance of the same collective at once (SPMD), so a ring crossing nodes gets ``node NIC bw x g /
  gpus_per_node`` and a per-GPU phase its rail share. The slowest node type of the group sets each rate.
- ``concurrent_times_s`` prices collectives that run at the same time: each one's busy time on each rank's
  NVLink and NIC share is shared out equally (processor sharing) with the others on the same resource.
- Calibration: a cluster whose calibration measured this accelerator (the ``local`` cluster) uses the fitted
  alpha and bus bandwidth of each op instead, for groups inside one node and for every group of ``local``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from costmodel.collectives import COLLECTIVE_OPS, ring_terms
from costmodel.comm_ramp import Ramp, build_ramp
from costmodel.errors import ConfigError
from costmodel.hardware import BusCurve, Cluster, Link, NodeType
from costmodel.memo import ByIdentity


@dataclass(frozen=True, kw_only=True, slots=True)
class CommEfficiency:
    """Achievable fractions and latencies for what the nccl-tests curves do not give. One set for every case.

    - Per link kind, the fraction of the datasheet rate a link WITHOUT a curve reaches (a link with a curve in
      ``profiles/comm_curves.toml`` takes the curve's plateau): ``nvlink`` 0.80 (DGX-1V ring all-reduce
      ~120-130 GB/s of 150), ``xgmi`` 0.70 (MI300X: rccl-tests ~300-330 GB/s of 448), ``pcie`` 0.60
      (NVIDIA/nccl#841, nccl-tests#178: 12-25 GB/s busbw on Gen4 x16), ``ethernet`` 0.70 (TCP sockets),
      ``nvswitch`` 0.80, ``infiniband`` 0.92, ``roce`` 0.85 (the curves' kinds, for links without one),
      ``loopback`` 1.0 (its numbers come from calibration).
    - ``tree_bandwidth`` 0.92: NCCL's tuner prices the tree all-reduce at 0.92 of the ring's bandwidth.
    - ``mesh_all_to_all`` 0.50: a hybrid cube mesh connects each GPU to 4 of 7 peers; the rest take two hops.
    - ``base_latency_s`` 6.6 us, ``nvls_latency_s`` 25 us, ``pat_base_latency_s`` 8 us, ``pat_rank_latency_s``
      2.8 us, ``pat_log_divisor`` 3.5, ``pat_bandwidth`` 0.75, ``in_network_bandwidth`` 0.85: NCCL's tuner
      constants (``src/graph/tuning.cc``: ring base latency, NVLS NVLink latency, PAT latency and bandwidth,
      CollNet bandwidth on Hopper and later).
    - ``curves`` False prices every link at its kind's fraction with no ramp (the plain alpha-beta model).
    """

    nvswitch: float = 0.80
    nvlink: float = 0.80
    xgmi: float = 0.70
    pcie: float = 0.60
    infiniband: float = 0.92
    roce: float = 0.85
    ethernet: float = 0.70
    loopback: float = 1.0
    tree_bandwidth: float = 0.92
    mesh_all_to_all: float = 0.50
    base_latency_s: float = 6.6e-6
    nvls_latency_s: float = 25e-6
    pat_base_latency_s: float = 8e-6
    pat_rank_latency_s: float = 2.8e-6
    pat_log_divisor: float = 3.5
    pat_bandwidth: float = 0.75
    in_network_bandwidth: float = 0.85
    curves: bool = True

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
    """``ring``, ``tree``, ``nvls``, ``nvls_tree``, ``in_network``, ``pat``, ``pairwise``, ``p2p``,
    ``calibrated`` or ``none``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective of a set that runs at the same time (``concurrent_times_s``)."""

    op: str
    nbytes: float
    group: Group
    first_rank: int = 0


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
    """Nodes a group spans and members per node."""
    counts: dict[int, int] = {}
    types: list[NodeType] = []
    single = len(cluster.groups) == 1
    for k in range(group.size):
        rank = first_rank + k * group.stride
        n = rank // cluster.gpus_per_node if single else cluster.node_of_rank(rank)
        counts[n] = counts.get(n, 0) + 1
        node = cluster.groups[0].node if single else cluster.node_type_of_rank(rank)
        if node not in types:
            types.append(node)
    return Placement(size=group.size, nodes=len(counts), members_per_node=min(counts.values()),
                     node_types=tuple(types))


# ------------------------------------------------------------------------------------------ rates and ramps


@dataclass(frozen=True, slots=True)
class _Rate:
    """A phase's plateau rate (bytes/s), the ramp of its link (None: flat) and the link kind."""

    bps: float
    ramp: Ramp | None
    kind: str

    def at(self, nbytes: float) -> float:
        """Bytes/s the phase reaches on a message of ``nbytes``."""
        if self.ramp is None:
            return self.bps
        return self.bps * self.ramp.fraction(nbytes, self.bps / 1e9)

    def scaled(self, factor: float) -> _Rate:
        return _Rate(self.bps * factor, self.ramp, self.kind)


def _reference_latency_s(curve: BusCurve, eff: CommEfficiency) -> float:
    """The model's latency for a curve's own group (what ``build_ramp`` subtracts from the measured times)."""
    if curve.algorithm == "nvls":
        return eff.nvls_latency_s
    steps, _ = ring_terms(curve.op, curve.ranks)
    if curve.nodes == 1:
        return eff.base_latency_s + steps * curve.link_latency_s
    inter = 2 * (curve.nodes - 1) if curve.op == "all_reduce" else curve.nodes - 1
    return eff.base_latency_s + (steps - inter) * 1e-6 + inter * curve.link_latency_s  # NVSwitch alpha inside


@functools.lru_cache(maxsize=256)
def curve_ramp(curve: BusCurve, eff: CommEfficiency = DEFAULT_EFFICIENCY) -> Ramp:
    """The ramp of a published curve (``costmodel.comm_ramp``), with its shape curve's below its points."""
    shape = curve_ramp(curve.shape, eff) if curve.shape is not None else None
    return build_ramp(curve, _reference_latency_s(curve, eff), shape)


def _link_rate(link: Link, eff: CommEfficiency, ranks: int, algorithm: str = "ring") -> _Rate | None:
    """The bus-bandwidth rate of ``link`` for the ring (or ``nvls``) family on ``ranks`` GPUs: its curve's
    plateau fraction and ramp, or the kind's fraction and no ramp; None for ``nvls`` on a link without
    in-switch reduction. NVLS moves each GPU's buffer once each way whatever the group size (its algorithm
    bandwidth, ~275 GB/s on H100, is what stays fixed), so its bus bandwidth scales as 2 (n-1)/n."""
    curve = link.curve(algorithm, ranks) if eff.curves else None
    if curve is None:
        if algorithm == "nvls":
            return None
        return _Rate(link.gbps_per_direction * eff.of(link.kind) * 1e9, None, link.kind)
    bps = link.gbps_per_direction * curve.plateau_fraction * 1e9
    if algorithm == "nvls":
        bps *= ring_terms("all_reduce", max(ranks, 2))[1] / ring_terms("all_reduce", curve.ranks)[1]
    return _Rate(bps, curve_ramp(curve, eff), link.kind)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Links:
    """Rates and latencies of a placement, the slowest node type spanned setting each."""

    intra: _Rate
    nvls: _Rate | None
    """In-switch all-reduce bus bandwidth, if every node spanned has it."""
    nic_node: _Rate
    """All the node's NICs together (a ring crossing nodes gets ``g / gpus_per_node`` of it)."""
    nic_gpu: _Rate
    """NIC bandwidth per GPU when every GPU of the node sends (rail share)."""
    gpus_per_node: int
    intra_alpha_s: float
    nic_alpha_s: float
    topology: str
    sharp: bool


def _slowest(rates: list[_Rate]) -> _Rate:
    return min(rates, key=lambda r: r.bps)


def _links(p: Placement, eff: CommEfficiency) -> _Links:
    types, g = p.node_types, p.members_per_node
    nvls = [_link_rate(t.intra, eff, g, "nvls") for t in types]
    nic = [_link_rate(t.nic, eff, p.size) for t in types]
    return _Links(
        intra=_slowest([_link_rate(t.intra, eff, g) for t in types]),  # type: ignore[misc]
        nvls=None if any(r is None for r in nvls) else _slowest(nvls),  # type: ignore[arg-type]
        nic_node=_slowest([r.scaled(t.nics_per_node) for r, t in zip(nic, types)]),
        nic_gpu=_slowest([r.scaled(min(1.0, t.nics_per_node / t.gpus_per_node)) for r, t in zip(nic, types)]),
        gpus_per_node=max(t.gpus_per_node for t in types),
        intra_alpha_s=max(t.intra.latency_s for t in types),
        nic_alpha_s=max(t.nic.latency_s for t in types),
        topology=min(types, key=lambda t: t.intra.gbps_per_direction).intra_topology,
        sharp=all(t.nic.sharp for t in types),
    )


# ------------------------------------------------------------------------------------------ algorithms


@dataclass(frozen=True, slots=True)
class _Plan:
    """An algorithm: latency plus pipelined phases (the slowest one sets the pace), each ``(resource, bus
    bytes, rate, message bytes)``: ``resource`` is ``intra`` (the GPU's NVLink) or ``nic`` (its NIC share),
    the rate is read at the message size the phase's link sees (its ramp is keyed by nccl-tests sizes)."""

    algorithm: str
    latency_s: float
    phases: tuple[tuple[str, float, _Rate, float], ...]

    def _phase_s(self) -> list[float]:
        return [nbytes / rate.at(msg) for _, nbytes, rate, msg in self.phases]

    def busy_s(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (resource, *_), t in zip(self.phases, self._phase_s()):
            out[resource] = out.get(resource, 0.0) + t
        return out

    def time_s(self) -> float:
        return self.latency_s + max(self._phase_s())

    def kind(self) -> str:
        times = self._phase_s()
        return self.phases[times.index(max(times))][2].kind


def _single_node(op: str, nbytes: float, n: int, links: _Links, eff: CommEfficiency) -> list[_Plan]:
    base, alpha = eff.base_latency_s, links.intra_alpha_s
    steps, factor = ring_terms(op, n)
    if op == "send_recv":
        return [_Plan("p2p", base + alpha, (("intra", nbytes, links.intra, nbytes),))]
    rate = links.intra
    if op == "all_to_all":
        if links.topology == "hybrid-cube-mesh":
            rate = rate.scaled(eff.mesh_all_to_all)
        return [_Plan("pairwise", base + steps * alpha, (("intra", factor * nbytes, rate, nbytes),))]
    plans = [_Plan("ring", base + steps * alpha, (("intra", factor * nbytes, rate, nbytes),))]
    if op == "all_reduce" and links.nvls is not None:
        plans.append(_Plan("nvls", eff.nvls_latency_s, (("intra", factor * nbytes, links.nvls, nbytes),)))
    return plans


def _multi_node(op: str, nbytes: float, p: Placement, links: _Links, eff: CommEfficiency) -> list[_Plan]:
    n, g, nodes = p.size, p.members_per_node, p.nodes
    base, a_in, a_net = eff.base_latency_s, links.intra_alpha_s, links.nic_alpha_s
    steps, factor = ring_terms(op, n)
    if op == "send_recv":
        return [_Plan("p2p", base + a_net, (("nic", nbytes, links.nic_gpu, nbytes),))]
    if op == "all_to_all":  # pairwise: (g-1)/n of the buffer to node peers, (n-g)/n across on the rail share
        phases = [("nic", (n - g) / n * nbytes, links.nic_gpu, nbytes)]
        if g > 1:
            phases.append(("intra", (g - 1) / n * nbytes, links.intra, nbytes))
        return [_Plan("pairwise", base + steps * max(a_in, a_net), tuple(phases))]
    share = links.nic_node.scaled(g / links.gpus_per_node)  # this instance's part of the node's NICs
    ring_phases = [("nic", factor * nbytes, share, nbytes)]
    if g > 1:
        ring_phases.append(("intra", factor * nbytes, links.intra, nbytes))
    inter_steps = 2 * (nodes - 1) if op == "all_reduce" else nodes - 1
    plans = [_Plan("ring", base + (steps - inter_steps) * a_in + inter_steps * a_net, tuple(ring_phases))]
    depth = math.ceil(math.log2(nodes))
    if op == "all_reduce":
        tree = [(r, b, rate.scaled(eff.tree_bandwidth), m) for r, b, rate, m in ring_phases]
        plans.append(_Plan("tree", base + 2 * ((g - 1) * a_in + depth * a_net), tuple(tree)))
        plans.extend(_switch_reduction(nbytes, p, links, eff, share))
    if op in ("all_gather", "reduce_scatter") and g == 1:  # PAT: one GPU of the group per node
        lat = eff.pat_base_latency_s + depth * a_net / eff.pat_log_divisor + n * eff.pat_rank_latency_s
        plans.append(_Plan("pat", lat, (("nic", factor * nbytes, links.nic_gpu.scaled(eff.pat_bandwidth), nbytes),)))
    return plans


def _switch_reduction(nbytes: float, p: Placement, links: _Links, eff: CommEfficiency, share: _Rate) -> list[_Plan]:
    """All-reduce with the reduction in a switch: NVLS inside each node and a tree across (NVLS tree), or the
    InfiniBand switches (SHARP: in-network, each GPU's NIC share sends and receives S / g once)."""
    n, g, nodes = p.size, p.members_per_node, p.nodes
    factor = ring_terms("all_reduce", n)[1]
    plans = []
    depth = math.ceil(math.log2(nodes))
    if links.nvls is not None and g > 1:
        inter = share.scaled(2.0 if nodes <= 2 else 1.0)  # NCCL: the 2-node tree halves the traffic
        phases = (("intra", factor * nbytes, links.nvls, nbytes), ("nic", factor * nbytes, inter, nbytes))
        plans.append(_Plan("nvls_tree", eff.nvls_latency_s + 2 * depth * links.nic_alpha_s, phases))
    if links.sharp:
        intra = links.nvls if links.nvls is not None else links.intra
        per_gpu = nbytes / g
        phases_s = [("nic", per_gpu, links.nic_gpu.scaled(eff.in_network_bandwidth), per_gpu)]
        if g > 1:
            phases_s.append(("intra", ring_terms("all_reduce", g)[1] * nbytes, intra, nbytes))
        lat = eff.base_latency_s + 2 * (g - 1) * links.intra_alpha_s + 2 * links.nic_alpha_s
        plans.append(_Plan("in_network", lat, tuple(phases_s)))
    return plans


def _plans(op: str, nbytes: float, p: Placement, links: _Links, eff: CommEfficiency) -> list[_Plan]:
    if p.nodes == 1:
        return _single_node(op, nbytes, p.size, links, eff)
    return _multi_node(op, nbytes, p, links, eff)


def _cost(op: str, nbytes: float, n: int, time_s: float, kind: str, algorithm: str) -> CommCost:
    factor = ring_terms(op, n)[1]
    bus = factor * nbytes / time_s / 1e9 if time_s > 0 else 0.0
    return CommCost(time_s=time_s, link_kind=kind, bus_gbps=bus, algorithm=algorithm)


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


# ------------------------------------------------------------------------------------------ public entries


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
    eff = efficiency or DEFAULT_EFFICIENCY
    placement, links = _geometry(group.size, group.stride, first_rank, cluster, eff)
    if group.size == 1 or nbytes == 0:
        return CommCost(time_s=0.0, link_kind=links.intra.kind, bus_gbps=0.0, algorithm="none")
    kind = links.intra.kind if placement.nodes == 1 else links.nic_gpu.kind
    calibrated = _calibrated(op, nbytes, group.size, cluster, kind, placement.nodes)
    if calibrated is not None:
        return calibrated
    best = _best_plan(op, nbytes, placement, links, eff)
    return _cost(op, nbytes, group.size, best.time_s(), best.kind(), best.algorithm)


def algorithm_times_s(op: str, nbytes: float, group: Group, cluster: Cluster, *, first_rank: int = 0,
                      efficiency: CommEfficiency | None = None) -> dict[str, float]:
    """Seconds of every algorithm the model has for ``op`` on this group (``collective_time_s`` takes the
    fastest): e.g. ``{"ring": ..., "nvls": ...}`` for an all-reduce inside an H100 node."""
    _validate(op, nbytes, group, cluster, first_rank)
    eff = efficiency or DEFAULT_EFFICIENCY
    placement, links = _geometry(group.size, group.stride, first_rank, cluster, eff)
    if group.size == 1 or nbytes == 0:
        return {"none": 0.0}
    return {plan.algorithm: plan.time_s() for plan in _plans(op, nbytes, placement, links, eff)}


def _best_plan(op: str, nbytes: float, placement: Placement, links: _Links, eff: CommEfficiency) -> _Plan:
    """The fastest algorithm (memoized, the geometry and efficiency by identity: ``collective_time_s`` and
    ``concurrent_times_s`` ask for the same collectives' plans)."""
    return _best_plan_cached(op, nbytes, type(nbytes), ByIdentity(placement), ByIdentity(links), ByIdentity(eff))


@functools.lru_cache(maxsize=16384)
def _best_plan_cached(op: str, nbytes: float, nbytes_type: type, placement: ByIdentity, links: ByIdentity,
                      eff: ByIdentity) -> _Plan:
    return min(_plans(op, nbytes, placement.obj, links.obj, eff.obj), key=lambda plan: plan.time_s())


def _geometry(size: int, stride: int, first_rank: int, cluster: Cluster, eff: CommEfficiency) -> tuple[Placement, _Links]:
    return _geometry_cached(size, stride, first_rank, cluster.groups, eff)


@functools.lru_cache(maxsize=8192)
def _geometry_cached(size: int, stride: int, first_rank: int, groups: tuple, eff: CommEfficiency) -> tuple[Placement, _Links]:
    placement = place(Group(size=size, stride=stride), Cluster(name="", groups=groups), first_rank=first_rank)
    return placement, _links(placement, eff)


def concurrent_times_s(collectives: Sequence[Collective], cluster: Cluster, *,
                       efficiency: CommEfficiency | None = None) -> tuple[CommCost, ...]:
    """Times of collectives that start together and share links (e.g. a data-parallel reduce-scatter and the
    pipeline send/recv on the same NICs; tensor-parallel all-reduces on NVLink beside data-parallel traffic
    that also crosses NVLink).

    Each collective is priced alone (its algorithm as ``collective_time_s`` picks it), then its busy time on
    each member rank's NVLink (``intra``) and NIC share (``nic``) is shared equally with the other collectives
    busy on the same rank's same resource (processor sharing: collective ``i`` finishes its part on a resource
    at ``sum_j min(d_j, d_i)`` of the busy times there). Its time is its latency plus the latest of those, and
    never less than alone. Collectives on disjoint ranks or resources do not slow each other. Memoized (the
    cluster by identity)."""
    return _concurrent_cached(tuple(collectives), ByIdentity(cluster), efficiency)


@functools.lru_cache(maxsize=4096)
def _concurrent_cached(collectives: tuple[Collective, ...], cluster_id: ByIdentity,
                       efficiency: CommEfficiency | None) -> tuple[CommCost, ...]:
    cluster: Cluster = cluster_id.obj
    eff = efficiency or DEFAULT_EFFICIENCY
    alone = [collective_time_s(c.op, c.nbytes, c.group, cluster, first_rank=c.first_rank, efficiency=efficiency)
             for c in collectives]
    busy: list[dict[str, float]] = []  # per collective: its busy seconds per resource of each member rank
    latency: list[float] = []
    for c, cost in zip(collectives, alone):
        plan = _plan_of(c, cluster, eff, cost)
        if plan is None:  # calibrated, trivial: not shared
            busy.append({})
            latency.append(cost.time_s)
            continue
        busy.append(plan.busy_s())
        latency.append(plan.latency_s)
    members = [frozenset(c.first_rank + k * c.group.stride for k in range(c.group.size)) for c in collectives]
    out = []
    for i, (c, cost) in enumerate(zip(collectives, alone)):
        shared = [sum(min(busy[j][res], di) for j in holders)
                  for res, di in busy[i].items() for holders in _holders(i, res, busy, members)]
        time_s = max(cost.time_s, latency[i] + max(shared, default=0.0))
        out.append(_cost(c.op, c.nbytes, c.group.size, time_s, cost.link_kind, cost.algorithm))
    return tuple(out)


def _holders(i: int, res: str, busy: list[dict[str, float]], members: list[frozenset[int]]) -> set[tuple[int, ...]]:
    """The distinct sets (in order) of collectives busy on ``res`` of one of collective ``i``'s member ranks:
    rank by rank, whom that rank's resource is shared with. Ranks that only ``i`` uses there share it with
    none; only the ranks ``i`` has in common with another collective on ``res`` are looked at one by one."""
    on = [j for j in range(len(busy)) if res in busy[j]]
    common = set().union(*(members[i] & members[j] for j in on if j != i))
    out = {tuple(j for j in on if r in members[j]) for r in common}
    if len(common) < len(members[i]):
        out.add((i,))
    return out


def _plan_of(c: Collective, cluster: Cluster, eff: CommEfficiency, cost: CommCost) -> _Plan | None:
    if cost.algorithm in ("calibrated", "none"):
        return None
    placement, links = _geometry(c.group.size, c.group.stride, c.first_rank, cluster, eff)
    return _best_plan(c.op, c.nbytes, placement, links, eff)
