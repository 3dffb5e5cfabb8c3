"""Collective formulas (``costmodel.comm`` docstring) against hand-computed cases, placement, NIC sharing."""

from __future__ import annotations

import math

import pytest

from costmodel.calibration import Calibration, CollectiveFit
from costmodel.collectives import ring_terms
from costmodel.comm import CommEfficiency, Group, collective_time_s, place
from costmodel.errors import ConfigError
from costmodel.profiles import load_cluster_file, make_cluster, PROFILES_DIR

GIB = float(1 << 30)
# DGX A100: NVSwitch 300 GB/s per direction x 0.80; 8x HDR 25 GB/s x 0.92; latencies 1 us (NVLink), 5 us (IB)
INTRA_BPS = 300e9 * 0.80
NIC_BPS = 25e9 * 0.92
NODE_NIC_BPS = 8 * NIC_BPS
A_INTRA, A_NIC = 1e-6, 5e-6


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def test_ring_all_reduce_8_gpus_one_node():
    cost = collective_time_s("all_reduce", GIB, Group(size=8), make_cluster("dgx-a100-80gb", 1))
    ring = 2 * 7 * A_INTRA + 2 * 7 / 8 * GIB / INTRA_BPS  # 2(n-1) alpha + 2(n-1)/n S/bw
    assert _close(cost.time_s, ring)
    assert (cost.algorithm, cost.link_kind) == ("ring", "nvswitch")
    assert cost.bus_gbps == pytest.approx(240.0, rel=1e-2)  # nccl-tests busbw of 8x A100: ~230-240


def test_small_all_reduce_in_node_takes_the_tree():
    nbytes = 8192.0
    cost = collective_time_s("all_reduce", nbytes, Group(size=8), make_cluster("dgx-a100-80gb", 1))
    tree = 2 * 3 * A_INTRA + 2 * 7 / 8 * nbytes / (INTRA_BPS * 0.9)  # 2 log2(n) alpha
    ring = 2 * 7 * A_INTRA + 2 * 7 / 8 * nbytes / INTRA_BPS
    assert tree < ring
    assert _close(cost.time_s, tree) and cost.algorithm == "tree"


def test_all_reduce_across_2_nodes():
    cost = collective_time_s("all_reduce", GIB, Group(size=16), make_cluster("dgx-a100-80gb", 2))
    ring = 2 * 15 * A_NIC + 2 * 15 / 16 * GIB / min(INTRA_BPS, NODE_NIC_BPS)
    hier = 2 * (7 * A_INTRA + 7 / 8 * GIB / INTRA_BPS) + (2 * 1 * A_NIC + 2 * 1 / 2 * (GIB / 8) / NIC_BPS)
    tree = 2 * 4 * A_NIC + 2 * 15 / 16 * GIB / (min(INTRA_BPS, NODE_NIC_BPS) * 0.9)
    assert _close(cost.time_s, min(ring, hier, tree))
    assert cost.algorithm == "ring" and cost.link_kind == "infiniband"
    # 8 HDR NICs cap the ring at 8 x 25 x 0.92 = 184 GB/s bus bandwidth (below NVSwitch's 240)
    assert cost.bus_gbps == pytest.approx(184.0, rel=2e-2)


def test_all_reduce_across_16_nodes():
    cluster = make_cluster("dgx-a100-80gb", 16)
    cost = collective_time_s("all_reduce", GIB, Group(size=128), cluster)
    ring = 2 * 127 * A_NIC + 2 * 127 / 128 * GIB / NODE_NIC_BPS
    hier = 2 * (7 * A_INTRA + 7 / 8 * GIB / INTRA_BPS) + (2 * 15 * A_NIC + 2 * 15 / 16 * (GIB / 8) / NIC_BPS)
    tree = 2 * 7 * A_NIC + 2 * 127 / 128 * GIB / (NODE_NIC_BPS * 0.9)
    assert _close(cost.time_s, min(ring, hier, tree))
    # a small message across 16 nodes: the latency term decides, the tree wins over the 254-step ring
    small = collective_time_s("all_reduce", 4096.0, Group(size=128), cluster)
    assert small.algorithm == "tree"
    assert _close(small.time_s, 2 * 7 * A_NIC + 2 * 127 / 128 * 4096.0 / (NODE_NIC_BPS * 0.9))


def test_data_parallel_group_over_tp8_uses_one_rail_nic_per_gpu():
    # dp=16 over tp=8: one member per node; the node's 8 NICs are shared by the 8 concurrent dp groups
    cost = collective_time_s("all_reduce", GIB, Group(size=16, stride=8), make_cluster("dgx-a100-80gb", 16))
    ring = 2 * 15 * A_NIC + 2 * 15 / 16 * GIB / NIC_BPS
    tree = 2 * 4 * A_NIC + 2 * 15 / 16 * GIB / (NIC_BPS * 0.9)
    assert _close(cost.time_s, min(ring, tree)) and cost.link_kind == "infiniband"


def test_fewer_nics_than_gpus_share_them():
    # pcie-8xa100: 2 HDR NICs for 8 GPUs: each of the 8 concurrent dp groups gets a quarter NIC
    cost = collective_time_s("all_reduce", GIB, Group(size=2, stride=8), make_cluster("pcie-8xa100", 2))
    nic_share = 25e9 * 0.92 * 2 / 8
    assert _close(cost.time_s, 2 * 1 * A_NIC + 2 * 1 / 2 * GIB / nic_share)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_all_gather_reduce_scatter_in_node(op):
    cost = collective_time_s(op, GIB, Group(size=8), make_cluster("dgx-h100", 1))
    bw = 450e9 * 0.80
    assert _close(cost.time_s, 7 * A_INTRA + 7 / 8 * GIB / bw)
    assert cost.bus_gbps == pytest.approx(360.0, rel=1e-2)  # nccl-tests H100 NVSwitch: ~370


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_all_gather_reduce_scatter_across_nodes(op):
    cost = collective_time_s(op, GIB, Group(size=32), make_cluster("dgx-a100-80gb", 4))
    ring = 31 * A_NIC + 31 / 32 * GIB / NODE_NIC_BPS
    hier = (7 * A_INTRA + 7 / 8 * GIB / INTRA_BPS) + (3 * A_NIC + 3 / 4 * (GIB / 8) / NIC_BPS)
    assert _close(cost.time_s, min(ring, hier))
    assert ring_terms(op, 32) == (31.0, 31 / 32)


def test_group_that_spans_nodes_uses_the_nic_and_one_inside_stays_on_nvlink():
    cluster = make_cluster("dgx-a100-80gb", 2)
    inside = collective_time_s("all_reduce", GIB, Group(size=8), cluster, first_rank=8)  # node 1
    assert inside.link_kind == "nvswitch"
    crossing = collective_time_s("all_reduce", GIB, Group(size=8), cluster, first_rank=4)  # ranks 4..11
    assert crossing.link_kind == "infiniband" and crossing.time_s > inside.time_s
    strided = place(Group(size=4, stride=2), cluster)  # ranks 0, 2, 4, 6
    assert (strided.nodes, strided.members_per_node) == (1, 4)
    spanning = place(Group(size=4, stride=4), cluster)  # ranks 0, 4, 8, 12
    assert (spanning.nodes, spanning.members_per_node) == (2, 2)


def test_all_to_all_send_recv_broadcast():
    cluster = make_cluster("dgx-a100-80gb", 2)
    a2a = collective_time_s("all_to_all", GIB, Group(size=16), cluster)
    intra_t = 7 / 16 * GIB / INTRA_BPS  # 7 of 16 chunks to node peers, 8 across nodes on the GPU's NIC share
    inter_t = 8 / 16 * GIB / NIC_BPS
    assert _close(a2a.time_s, 15 * A_NIC + max(intra_t, inter_t)) and a2a.link_kind == "infiniband"
    p2p = collective_time_s("send_recv", 64e6, Group(size=2, stride=8), cluster)
    assert _close(p2p.time_s, A_NIC + 64e6 / NIC_BPS)
    p2p_in = collective_time_s("send_recv", 64e6, Group(size=2, stride=1), cluster)
    assert _close(p2p_in.time_s, A_INTRA + 64e6 / INTRA_BPS)
    bcast = collective_time_s("broadcast", GIB, Group(size=8), cluster)
    assert _close(bcast.time_s, min(7 * A_INTRA + GIB / INTRA_BPS, 3 * A_INTRA + GIB / (INTRA_BPS * 0.9)))


def test_hybrid_cube_mesh_all_to_all_is_slower_than_all_gather():
    cluster = make_cluster("aws-p3.16xlarge", 1)
    ag = collective_time_s("all_gather", GIB, Group(size=8), cluster)
    a2a = collective_time_s("all_to_all", GIB, Group(size=8), cluster)
    assert _close(a2a.time_s, 7 * 1.5e-6 + 7 / 8 * GIB / (150e9 * 0.8 * 0.5))
    assert a2a.time_s > 1.9 * ag.time_s


def test_p3_inter_node_is_25_gbit_ethernet():
    cost = collective_time_s("all_reduce", GIB, Group(size=2, stride=8), make_cluster("aws-p3.16xlarge", 2))
    nic = 3.125e9 * 0.70 / 8  # one 25 Gb/s NIC shared by 8 GPUs
    assert _close(cost.time_s, 2 * 30e-6 + GIB / nic) and cost.link_kind == "ethernet"


def test_heterogeneous_group_is_paced_by_its_slowest_links():
    hetero = load_cluster_file(PROFILES_DIR / "clusters" / "hetero-a100-h100.toml")
    # ranks 24..39 = the last A100 node and the first H100 node
    mixed = collective_time_s("all_reduce", GIB, Group(size=16), hetero, first_rank=24)
    a100 = collective_time_s("all_reduce", GIB, Group(size=16), make_cluster("dgx-a100-80gb", 2))
    assert _close(mixed.time_s, a100.time_s)
    h100_only = collective_time_s("all_reduce", GIB, Group(size=16), hetero, first_rank=32)
    assert h100_only.time_s < mixed.time_s


def test_efficiency_constants_are_overridable():
    cluster = make_cluster("dgx-a100-80gb", 1)
    base = collective_time_s("all_gather", GIB, Group(size=8), cluster)
    slow = collective_time_s("all_gather", GIB, Group(size=8), cluster, efficiency=CommEfficiency(nvswitch=0.4))
    bw_base, bw_slow = 7 / 8 * GIB / INTRA_BPS, 7 / 8 * GIB / (300e9 * 0.4)
    assert _close(slow.time_s - base.time_s, bw_slow - bw_base)


def test_calibrated_local_cluster_uses_the_fit():
    fit = CollectiveFit(op="all_reduce", latency_s=2e-4, bus_gbps=0.5, max_ranks=2)
    cal = Calibration(
        device_name="test cpu", accelerator="cpu-local", date="2026-01-01T00:00:00+00:00", backend="gloo",
        memory_gb=8.0, matmul=(), membound=(), membound_gbps=10.0, collectives=(), matmul_fits=(),
        collective_fits=(fit,),
    )  # fmt: skip
    cluster = make_cluster("local", 1, gpus_per_node=4, calibration=cal)
    cost = collective_time_s("all_reduce", 1e6, Group(size=4), cluster)
    assert cost.algorithm == "calibrated"
    assert _close(cost.time_s, 2 * 3 * 2e-4 + 2 * 3 / 4 * 1e6 / 0.5e9)
    uncalibrated = collective_time_s("all_reduce", 1e6, Group(size=4), make_cluster("local", 1, gpus_per_node=4))
    assert uncalibrated.algorithm != "calibrated"


def test_trivial_and_bad_groups():
    cluster = make_cluster("dgx-a100-80gb", 1)
    assert collective_time_s("all_reduce", GIB, Group(size=1), cluster).time_s == 0.0
    assert collective_time_s("all_reduce", 0.0, Group(size=8), cluster).time_s == 0.0
    with pytest.raises(ConfigError, match="beyond cluster"):
        collective_time_s("all_reduce", GIB, Group(size=16), cluster)
    with pytest.raises(ConfigError, match="unknown collective 'allreduce'"):
        collective_time_s("allreduce", GIB, Group(size=8), cluster)
    with pytest.raises(ConfigError, match="nbytes"):
        collective_time_s("all_reduce", -1.0, Group(size=8), cluster)


def test_gpu_calibration_applies_inside_a_node_only():
    fit = CollectiveFit(op="all_reduce", latency_s=1e-5, bus_gbps=200.0, max_ranks=8)
    cal = Calibration(
        device_name="NVIDIA A100-SXM4-80GB", accelerator="A100-SXM4-80GB", date="2026-01-01T00:00:00+00:00",
        backend="nccl", memory_gb=80.0, matmul=(), membound=(), membound_gbps=1800.0, collectives=(),
        matmul_fits=(), collective_fits=(fit,),
    )  # fmt: skip
    cluster = make_cluster("dgx-a100-80gb", 2, calibration=cal)
    inside = collective_time_s("all_reduce", GIB, Group(size=8), cluster)
    assert inside.algorithm == "calibrated" and _close(inside.time_s, 14 * 1e-5 + 1.75 * GIB / 200e9)
    across = collective_time_s("all_reduce", GIB, Group(size=16), cluster)
    assert across.algorithm != "calibrated" and across.link_kind == "infiniband"
