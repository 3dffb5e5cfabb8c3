"""Hardware and cluster description: accelerators, links, node types, clusters.

Plain frozen data. The numbers come from ``profiles/*.toml`` (see ``costmodel.profiles``), each with a
``source``; nothing here probes the live machine.

Conventions:
- ``Link.gbps_per_direction`` is GB/s (10^9 bytes/s) in ONE direction, per GPU for intra-node fabrics
  (NVLink 3: 12 links x 25 GB/s = 300 GB/s per direction, "600 GB/s bidirectional" on the datasheet) and
  per NIC port for network links (InfiniBand HDR 200 Gb/s = 25 GB/s per direction).
- ``Accelerator.peak_tflops`` is dense (no 2:4 sparsity) tensor-core peak, TFLOP/s, keyed by dtype.
- Ranks are numbered node by node in group order: rank ``r`` of a cluster of 8-GPU nodes is GPU ``r % 8``
  of node ``r // 8``; a mesh puts ``tp`` innermost, so a tensor-parallel group of size <= 8 stays in a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from costmodel.errors import ProfileError

if TYPE_CHECKING:  # pragma: no cover
    from costmodel.calibration import Calibration

LinkKind = Literal["nvlink", "nvswitch", "xgmi", "pcie", "infiniband", "roce", "ethernet", "loopback"]
LINK_KINDS: tuple[str, ...] = ("nvlink", "nvswitch", "xgmi", "pcie", "infiniband", "roce", "ethernet", "loopback")
DTYPES: tuple[str, ...] = ("bf16", "fp16", "tf32", "fp32", "fp8", "fp4")
CURVE_ALGORITHMS: tuple[str, ...] = ("ring", "auto", "nvls")
"""``ring`` (NCCL_ALGO=Ring), ``auto`` (NCCL's own choice where that is ring / tree: no in-switch reduction on
the system), ``nvls`` (NVLink SHARP: the reduction runs in the NVSwitch)."""
INTRA_TOPOLOGIES: tuple[str, ...] = ("switch", "full-mesh", "hybrid-cube-mesh", "pcie-tree", "shared-memory")

# A dtype the device lacks falls back to the nearest one it has (V100 has no bf16 / tf32 tensor cores: a bf16
# job there runs as fp16, a tf32 one as fp32).
_DTYPE_FALLBACK: dict[str, tuple[str, ...]] = {
    "bf16": ("bf16", "fp16", "fp32"),
    "fp16": ("fp16", "bf16", "fp32"),
    "tf32": ("tf32", "fp32"),
    "fp32": ("fp32",),
    "fp8": ("fp8",),
    "fp4": ("fp4",),  # no fallback: NVFP4 GEMMs need FP4 tensor cores (Blackwell)
}


GPU_ALLOCATABLE_FRACTION = 79.25 / 80.0
"""Share of a GPU's HBM (datasheet GB = GiB) that ``torch.cuda`` reports as its total capacity (A100 80 GB)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Accelerator:
    """One device type: dense peak rates, memory, memory bandwidth."""

    name: str
    """Profile name, e.g. ``A100-SXM4-80GB``."""
    memory_gb: float
    """Device memory, GB (10^9 bytes) as the datasheet states it."""
    hbm_gbps: float
    """Peak memory bandwidth, GB/s."""
    peak_tflops: dict[str, float] = field(hash=False)
    """Dense peak TFLOP/s by dtype (``bf16``, ``fp16``, ``tf32``, ``fp32``); a missing key = not supported."""
    source: str
    vendor: str = ""
    kind: Literal["gpu", "cpu"] = "gpu"
    aliases: tuple[str, ...] = ()
    nvlink_link: str = ""
    """links.toml entry for this GPU's NVLink fabric (what-if ``custom_cluster(intra="nvlink")``); "" = none."""
    pcie_link: str = ""
    """links.toml entry for this GPU's PCIe generation x16."""
    attention_speedup: float = 1.0
    """Fused attention's rate against its share of the tensor-core peak (``costmodel.compute``'s ``attention``
    efficiency, set on Hopper / Blackwell): above 1 where the chip runs the softmax's exponentials faster than
    those did (Blackwell Ultra's doubled SFU throughput)."""

    def tflops(self, dtype: str = "bf16") -> float:
        """Dense peak TFLOP/s for ``dtype``, falling back to the nearest supported dtype (see module doc)."""
        chain = _DTYPE_FALLBACK.get(dtype)
        if chain is None:
            raise ProfileError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        for d in chain:
            value = self.peak_tflops.get(d)
            if value:
                return value
        raise ProfileError(
            f"accelerator {self.name!r} has no peak rate for {dtype!r} (it lists {sorted(self.peak_tflops)})"
        )

    @property
    def memory_bytes(self) -> float:
        """Bytes a process can allocate on the device. A GPU's datasheet gigabytes are GiB of HBM, of which
        the driver keeps a little: PyTorch reports "a total capacity of 79.25 GiB" on an 80 GB A100 (CUDA
        out-of-memory messages in github wbfwonderful/Vad-R1#11, levihsu/OOTDiffusion#235), so
        ``GPU_ALLOCATABLE_FRACTION`` of the GiB; the CUDA context and NCCL buffers come out of that
        (``costmodel.memory.MemoryConstants.context_bytes``). A CPU's memory is as given."""
        if self.kind == "gpu":
            return self.memory_gb * 2**30 * GPU_ALLOCATABLE_FRACTION
        return self.memory_gb * 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class BusCurve:
    """A published nccl-tests curve: bus bandwidth ``busbw_gbps[i]`` at message size ``sizes_bytes[i]`` (the
    nccl-tests size: the full buffer) for ``op`` run with ``algorithm`` on ``ranks`` GPUs over ``nodes`` nodes."""

    name: str
    op: str
    algorithm: str
    """One of ``CURVE_ALGORITHMS``."""
    ranks: int
    nodes: int
    link: str
    """The links.toml entry whose rate bounds the measured collective."""
    link_latency_s: float
    """That link's ``latency_s`` (the alpha the ramp is derived with)."""
    reference_gbps: float
    """Datasheet rate the bus bandwidth is compared with: the link's rate per GPU for a fabric inside a node,
    the NIC rate times the NICs a ring crossing nodes uses (e.g. 4 NICs x 25 GB/s)."""
    sizes_bytes: tuple[float, ...]
    busbw_gbps: tuple[float, ...]
    source: str
    shape: BusCurve | None = None
    """A curve whose ramp this one follows below its own smallest size (when its points start at large sizes)."""

    @property
    def plateau_gbps(self) -> float:
        """The largest bus bandwidth measured."""
        return max(self.busbw_gbps)

    @property
    def plateau_fraction(self) -> float:
        """Plateau bus bandwidth / datasheet rate: the achievable fraction of the link."""
        return self.plateau_gbps / self.reference_gbps


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One kind of link: bandwidth in one direction and per-message latency."""

    name: str
    kind: LinkKind
    gbps_per_direction: float
    """GB/s in one direction (per GPU for intra-node fabrics, per NIC for network links)."""
    latency_s: float
    """Latency of one message hop (the alpha of the alpha-beta model), seconds."""
    source: str
    curves: tuple[BusCurve, ...] = ()
    """Published nccl-tests curves of this link: their plateau sets the achievable rate and their ramp the rate
    at each message size; an ``nvls`` curve means the switch reduces in-network. Several curves of one
    algorithm family measured on different group sizes: the nearest size (in log2) is used."""
    sharp: bool = False
    """The network behind this NIC reduces in the switch (InfiniBand SHARP, NCCL CollNet)."""

    def curve(self, algorithm: str, ranks: int = 8) -> BusCurve | None:
        """The curve for ``nvls`` or for ``ring`` (a ``ring`` curve before an ``auto`` one) measured on the
        group size nearest ``ranks``; None if the link has none."""
        family = ("nvls",) if algorithm == "nvls" else ("ring", "auto")
        found = [c for c in self.curves if c.algorithm in family]
        if not found:
            return None
        return min(found, key=lambda c: (abs(math.log2(c.ranks) - math.log2(max(ranks, 1))),
                                         family.index(c.algorithm)))


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeType:
    """A server, or one NVLink domain: ``gpus_per_node`` accelerators on an intra-node fabric, ``nics_per_node``
    NICs out (an NVL72 rack is one node of 72 GPUs on its NVLink Switch System with the 72 NICs of its trays)."""

    name: str
    gpu: Accelerator
    gpus_per_node: int
    intra: Link
    nic: Link
    nics_per_node: int
    price_per_gpu_hour: float | None = None
    """US dollars per GPU-hour (on-demand list price), if known; see ``price_source``."""
    intra_topology: str = "switch"
    """``switch`` (NVSwitch: any pair at full rate), ``full-mesh`` (MI300X xGMI), ``hybrid-cube-mesh``
    (DGX-1 / p3 NVLink 2), ``pcie-tree`` (GPUs behind PCIe switches), ``shared-memory`` (CPU processes)."""
    source: str = ""
    price_source: str = ""

    @property
    def nic_gbps_per_gpu(self) -> float:
        """NIC bandwidth per GPU, one direction, when every GPU of the node sends at once (rails shared)."""
        share = min(1.0, self.nics_per_node / self.gpus_per_node)
        return self.nic.gbps_per_direction * share


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeGroup:
    """``count`` nodes of one type."""

    node: NodeType
    count: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Node groups (heterogeneous clusters have several) plus an optional calibration of the device."""

    name: str
    groups: tuple[NodeGroup, ...]
    calibration: Calibration | None = None

    @property
    def num_devices(self) -> int:
        return sum(g.count * g.node.gpus_per_node for g in self.groups)

    @property
    def nodes(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def gpus_per_node(self) -> int:
        """GPUs per node of the first group (all groups in a homogeneous cluster)."""
        return self.groups[0].node.gpus_per_node

    @property
    def gpu_names(self) -> tuple[str, ...]:
        """Distinct accelerator names in group order."""
        seen: list[str] = []
        for g in self.groups:
            if g.node.gpu.name not in seen:
                seen.append(g.node.gpu.name)
        return tuple(seen)

    @property
    def is_homogeneous(self) -> bool:
        return len({g.node.name for g in self.groups}) == 1

    @property
    def node_type(self) -> NodeType:
        """The node type of the first group."""
        return self.groups[0].node

    @property
    def gpu(self) -> Accelerator:
        """The accelerator of the first group."""
        return self.groups[0].node.gpu

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_devices:
            raise ProfileError(
                f"rank {rank} is outside cluster {self.name!r} of {self.num_devices} devices (0..{self.num_devices - 1})"
            )

    def group_of_rank(self, rank: int) -> NodeGroup:
        """The node group that holds global ``rank``."""
        return self.groups[self.group_index_of_rank(rank)]

    def group_index_of_rank(self, rank: int) -> int:
        self._check_rank(rank)
        base = 0
        for i, g in enumerate(self.groups):
            size = g.count * g.node.gpus_per_node
            if rank < base + size:
                return i
            base += size
        raise AssertionError("unreachable: rank checked above")  # pragma: no cover

    def node_of_rank(self, rank: int) -> int:
        """Global node index (0..nodes-1) that holds ``rank``."""
        self._check_rank(rank)
        base_rank, base_node = 0, 0
        for g in self.groups:
            gpn = g.node.gpus_per_node
            size = g.count * gpn
            if rank < base_rank + size:
                return base_node + (rank - base_rank) // gpn
            base_rank += size
            base_node += g.count
        raise AssertionError("unreachable: rank checked above")  # pragma: no cover

    def node_type_of_rank(self, rank: int) -> NodeType:
        return self.group_of_rank(rank).node

    def price_per_hour(self) -> float | None:
        """Cluster price per hour in US dollars, or None if a node type has no price."""
        total = 0.0
        for g in self.groups:
            if g.node.price_per_gpu_hour is None:
                return None
            total += g.node.price_per_gpu_hour * g.node.gpus_per_node * g.count
        return total

    def with_calibration(self, calibration: Calibration | None) -> Cluster:
        return Cluster(name=self.name, groups=self.groups, calibration=calibration)
