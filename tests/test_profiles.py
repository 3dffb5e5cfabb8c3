"""Hardware profiles: the built-in data, clusters, and bad profiles rejected with file / key / allowed values."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from costmodel.errors import ProfileError
from costmodel.profiles import (
    PROFILES_DIR,
    custom_cluster,
    get_accelerator,
    get_link,
    get_node_type,
    list_accelerators,
    list_node_types,
    load_cluster_file,
    load_profiles,
    make_cluster,
    resolve_cluster,
)

ISSUE_ACCELERATORS = (
    "V100-SXM2-16GB", "V100-SXM2-32GB", "A100-SXM4-40GB", "A100-SXM4-80GB", "A100-PCIe-80GB", "H100-SXM5-80GB",
    "H100-PCIe-80GB", "H200-SXM-141GB", "B200-SXM-180GB", "L40S", "MI300X",
)  # fmt: skip
ISSUE_NODES = (
    "dgx-a100-80gb", "dgx-a100-40gb", "dgx-h100", "dgx-h200", "dgx-b200", "pcie-8xa100", "pcie-8xl40s",
    "aws-p3.16xlarge", "mi300x-8", "local",
)  # fmt: skip


def test_built_in_profiles_cover_the_issue_and_cite_sources():
    assert set(ISSUE_ACCELERATORS) <= set(list_accelerators())
    assert set(ISSUE_NODES) <= set(list_node_types())
    db = load_profiles()
    for item in (*db.accelerators.values(), *db.links.values(), *db.nodes.values()):
        assert item.source.strip(), f"{item.name} has no source"
    for node in db.nodes.values():
        if node.price_per_gpu_hour is not None:
            assert node.price_source, f"{node.name} has a price without a source"
    links = {link.name for link in db.links.values()}
    for name in ("nvlink2", "nvlink3", "nvlink4", "nvlink5", "pcie-gen3-x16", "pcie-gen4-x16", "pcie-gen5-x16",
                 "ib-hdr", "ib-ndr", "ib-xdr", "ethernet-25g", "ethernet-100g"):  # fmt: skip
        assert name in links


def test_datasheet_numbers():
    a100 = get_accelerator("A100-SXM4-80GB")
    assert (a100.tflops("bf16"), a100.tflops("tf32"), a100.hbm_gbps, a100.memory_gb) == (312.0, 156.0, 2039.0, 80.0)
    assert get_accelerator("h100").tflops("bf16") == pytest.approx(989.4)  # dense, not the sparse 1979
    v100 = get_accelerator("v100")
    assert v100.tflops("bf16") == 125.0  # no bf16 on V100: falls back to its fp16 tensor cores
    assert v100.tflops("tf32") == 15.7
    p3 = get_node_type("aws-p3.16xlarge")
    assert (p3.gpus_per_node, p3.gpu.name, p3.intra_topology) == (8, "V100-SXM2-16GB", "hybrid-cube-mesh")
    assert p3.nic.gbps_per_direction * p3.nics_per_node == pytest.approx(3.125)  # 25 Gb/s
    dgx = get_node_type("dgx-a100-80gb")
    assert dgx.intra.gbps_per_direction == 300 and dgx.nics_per_node == 8 and dgx.nic.gbps_per_direction == 25


def test_cluster_ranks_are_numbered_node_by_node():
    hetero = load_cluster_file(PROFILES_DIR / "clusters" / "hetero-a100-h100.toml")
    assert (hetero.num_devices, hetero.nodes, hetero.gpus_per_node) == (48, 6, 8)
    assert hetero.gpu_names == ("A100-SXM4-80GB", "H100-SXM5-80GB")
    assert hetero.group_of_rank(31).node.name == "dgx-a100-80gb"
    assert hetero.group_of_rank(32).node.name == "dgx-h100"
    assert [hetero.node_of_rank(r) for r in (0, 7, 8, 31, 32, 47)] == [0, 0, 1, 3, 4, 5]
    with pytest.raises(ProfileError, match="rank 48 is outside"):
        hetero.group_of_rank(48)
    cluster = make_cluster("dgx-h100", 128)
    assert cluster.num_devices == 1024 and cluster.price_per_hour() == pytest.approx(1024 * 12.29)


def test_resolve_cluster_specs(tmp_path):
    assert resolve_cluster("dgx-a100-80gb", nodes=4).num_devices == 32
    local = resolve_cluster("local", nodes=1, gpus_per_node=3)
    assert (local.num_devices, local.gpu.kind, local.node_type.intra.kind) == (3, "cpu", "loopback")
    selene = resolve_cluster(str(PROFILES_DIR / "clusters" / "selene-a100-128.toml"), nodes=2)
    assert selene.num_devices == 16
    with pytest.raises(ProfileError, match="2 node groups"):
        resolve_cluster(str(PROFILES_DIR / "clusters" / "hetero-a100-h100.toml"), nodes=2)
    custom = resolve_cluster(str(PROFILES_DIR / "clusters" / "custom-pcie-h100.toml"))
    assert (custom.num_devices, custom.node_type.intra.kind) == (16, "pcie")
    with pytest.raises(ProfileError, match="unknown node type 'dgx-z100'.*dgx-a100-80gb"):
        resolve_cluster("dgx-z100")
    with pytest.raises(ProfileError, match="nodes = 0"):
        make_cluster("dgx-h100", 0)


def test_custom_cluster_for_what_if():
    nv = custom_cluster(gpu="H100", nodes=2, gpus_per_node=8, intra="nvlink", inter_node_gbps=50)
    pcie = custom_cluster(gpu="H100", nodes=2, gpus_per_node=8, intra="pcie", inter_node_gbps=50)
    assert nv.node_type.intra.name == "nvswitch-h100" and pcie.node_type.intra.name == "pcie-gen5-x16"
    assert nv.node_type.nic_gbps_per_gpu == 50
    with pytest.raises(ProfileError, match="L40S has no nvlink"):
        custom_cluster(gpu="L40S", nodes=1, gpus_per_node=8, intra="nvlink", inter_node_gbps=25)
    with pytest.raises(ProfileError, match="allowed: nvlink, pcie"):
        custom_cluster(gpu="H100", nodes=1, gpus_per_node=8, intra="infiniband", inter_node_gbps=25)


# --------------------------------------------------------------------------------- bad profiles


def _copy_profiles(tmp_path: Path) -> Path:
    root = tmp_path / "profiles"
    root.mkdir()
    for name in ("accelerators.toml", "links.toml", "nodes.toml", "comm_curves.toml"):
        shutil.copy(PROFILES_DIR / name, root / name)
    return root


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_unknown_gpu_lists_the_known_ones(tmp_path):
    with pytest.raises(ProfileError, match=r"unknown accelerator 'H900' \(did you mean h200, h100\?\); known: "
                                           r"A100-PCIe-40GB, .*V100-SXM2-32GB"):
        get_accelerator("H900")
    root = _copy_profiles(tmp_path)
    _edit(root / "nodes.toml", 'gpu = "H100-SXM5-80GB"', 'gpu = "H900"')
    with pytest.raises(ProfileError) as err:
        load_profiles(str(root))
    msg = str(err.value)
    assert "nodes.toml" in msg and "[nodes.dgx-h100]" in msg and "'gpu' = 'H900'" in msg and "A100-SXM4-80GB" in msg


def test_missing_key_names_file_and_key(tmp_path):
    root = _copy_profiles(tmp_path)
    _edit(root / "accelerators.toml", "memory_gb = 80\nhbm_gbps = 2039\n", "hbm_gbps = 2039\n")
    with pytest.raises(ProfileError, match=r"accelerators\.toml: \[accelerators\.A100-SXM4-80GB\] missing key 'memory_gb'"):
        load_profiles(str(root))


def test_negative_bandwidth_rejected(tmp_path):
    root = _copy_profiles(tmp_path)
    _edit(root / "links.toml", "gbps_per_direction = 25\n", "gbps_per_direction = -25\n")
    with pytest.raises(ProfileError, match=r"links\.toml: \[links\.ib-hdr\] key 'gbps_per_direction' = -25 must be a positive"):
        load_profiles(str(root))


def test_bad_link_kind_lists_allowed_values(tmp_path):
    root = _copy_profiles(tmp_path)
    _edit(root / "links.toml", 'kind = "infiniband"', 'kind = "carrier-pigeon"')
    with pytest.raises(ProfileError, match="'carrier-pigeon' is not allowed; allowed values: nvlink, nvswitch"):
        load_profiles(str(root))


def test_bad_toml_syntax_names_file_and_line(tmp_path):
    root = _copy_profiles(tmp_path)
    text = (root / "nodes.toml").read_text().splitlines()
    line = next(i for i, t in enumerate(text) if t.startswith("gpus_per_node")) + 1
    text[line - 1] = "gpus_per_node = = 8"
    (root / "nodes.toml").write_text("\n".join(text) + "\n")
    with pytest.raises(ProfileError, match=rf"nodes\.toml: invalid TOML: .*line {line}"):
        load_profiles(str(root))


def test_bad_cluster_files(tmp_path):
    no_groups = tmp_path / "empty.toml"
    no_groups.write_text('name = "x"\n')
    with pytest.raises(ProfileError, match=r"empty\.toml: missing key 'groups'"):
        load_cluster_file(no_groups)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('[[groups]]\nnode = "dgx-a200"\ncount = 2\n')
    with pytest.raises(ProfileError, match=r"unknown\.toml: \[groups\[0\]\] key 'node' = 'dgx-a200' is not a known node type; known: .*dgx-h100"):
        load_cluster_file(unknown)
    zero = tmp_path / "zero.toml"
    zero.write_text('[[groups]]\nnode = "dgx-h100"\ncount = 0\n')
    with pytest.raises(ProfileError, match=r"zero\.toml: \[groups\[0\]\] key 'count' = 0 must be a positive"):
        load_cluster_file(zero)
    typo = tmp_path / "typo.toml"
    typo.write_text('[[groups]]\nnode = "dgx-h100"\ncuont = 2\n')
    with pytest.raises(ProfileError, match="unknown key 'cuont'; allowed keys: node, count, gpus_per_node"):
        load_cluster_file(typo)
    with pytest.raises(ProfileError, match="does not exist"):
        load_cluster_file(tmp_path / "missing.toml")


def test_cluster_file_can_name_a_calibration(tmp_path):
    cal_path = sorted((PROFILES_DIR / "calibration").glob("*.json"))[0]
    path = tmp_path / "mine.toml"
    path.write_text(f'name = "my-box"\ncalibration = "{cal_path}"\n[[groups]]\nnode = "local"\ncount = 1\ngpus_per_node = 3\n')
    cluster = load_cluster_file(path)
    assert cluster.name == "my-box" and cluster.num_devices == 3
    assert cluster.calibration is not None and cluster.gpu.hbm_gbps == cluster.calibration.membound_gbps


def test_one_accelerator_vocabulary_for_clusters_and_sweeps():
    """dgx-h100, h100 and H100-SXM5-80GB name one thing wherever a node type or an accelerator is asked for."""
    from costmodel.profiles import get_node_type, resolve_cluster
    from planner.whatif import parse_sweep

    for name in ("dgx-h100", "h100", "H100-SXM5-80GB", "h100-sxm"):
        assert get_node_type(name).name == "dgx-h100"
        assert get_accelerator(name).name == "H100-SXM5-80GB"
        assert resolve_cluster(name, nodes=2).num_devices == 16
        assert parse_sweep([f"gpu={name}"])[0].cluster.gpu.name == "H100-SXM5-80GB"
    with pytest.raises(ProfileError, match="'h100-pcie' is the accelerator H100-PCIe-80GB: no node type .* holds it"):
        get_node_type("h100-pcie")
    with pytest.raises(ProfileError, match=r"unknown node type 'dgx-h10' \(did you mean dgx-h100"):
        get_node_type("dgx-h10")


# --------------------------------------------------------------------------------- development-set systems


DEVSET_NODES = ("dgx-h100", "dgx-b200", "dgx-b300", "gb200-nvl72", "gb300-nvl72", "h200-8gpu-cx7")


def test_every_development_set_system_is_a_node_type():
    import json

    systems = set()
    for path in (PROFILES_DIR.parent / "benchmarks" / "data").glob("*.json"):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            systems |= {row["system"] for row in data["rows"] if "system" in row}
    assert systems and systems <= set(DEVSET_NODES) | {"dgx-a100-80gb"}
    for name in DEVSET_NODES:
        node = get_node_type(name)
        assert node.source and node.gpu.source and node.intra.source and node.nic.source


@pytest.mark.parametrize("name", DEVSET_NODES)
def test_every_new_node_prices_collectives_inside_and_across(name):
    from costmodel.comm import Group, collective_time_s

    cluster = make_cluster(name, 2)
    gpn = cluster.gpus_per_node
    inside = collective_time_s("all_reduce", 2.0**28, Group(size=8), cluster)
    across = collective_time_s("all_reduce", 2.0**28, Group(size=2, stride=gpn), cluster)
    assert inside.link_kind == "nvswitch" and across.link_kind == "infiniband"
    assert 0 < inside.time_s < across.time_s
    assert inside.algorithm == "nvls"  # NVSwitch gen 3 and later reduce in the switch


def test_nvl72_is_one_nvlink_domain_of_72_gpus_with_a_nic_each():
    """tp / ep groups anywhere inside the rack get NVLink rates; data-parallel groups across racks get one
    NIC per GPU (ConnectX-7 400G on GB200, ConnectX-8 800G on GB300)."""
    from costmodel.comm import Group, collective_time_s

    gb200, gb300 = get_node_type("gb200-nvl72"), get_node_type("gb300-nvl72")
    assert (gb200.gpus_per_node, gb200.nics_per_node, gb200.intra.gbps_per_direction) == (72, 72, 900)
    assert (gb200.nic_gbps_per_gpu, gb300.nic_gbps_per_gpu) == (50, 100)
    rack = make_cluster("gb200-nvl72", 4)
    ep64 = collective_time_s("all_to_all", 2.0**28, Group(size=64, stride=1), rack, first_rank=4)
    tp8 = collective_time_s("all_reduce", 2.0**26, Group(size=8), rack, first_rank=64)  # trays 16-17
    assert ep64.link_kind == "nvswitch" and tp8.link_kind == "nvswitch"
    dp = collective_time_s("all_reduce", 2.0**28, Group(size=4, stride=72), rack)
    assert dp.link_kind == "infiniband"
    part = make_cluster("gb200-nvl72", 2, gpus_per_node=64)  # a job on 64 GPUs of each rack: 64 NICs each
    assert (part.num_devices, part.node_type.nics_per_node) == (128, 64)


def test_new_accelerators_and_fp8():
    gb200, gb300, b300 = get_accelerator("gb200"), get_accelerator("gb300"), get_accelerator("b300")
    assert (gb200.tflops("bf16"), gb200.tflops("fp8"), gb200.memory_gb) == (2500.0, 5000.0, 186)
    assert (gb300.tflops("bf16"), gb300.memory_gb, b300.memory_gb, b300.tflops("fp8")) == (2500.0, 279, 288, 4500.0)
    assert get_accelerator("h100").tflops("fp8") == pytest.approx(1978.9)  # dense, not the sparse 3,958
    with pytest.raises(ProfileError, match="no peak rate for 'fp8'"):
        get_accelerator("a100").tflops("fp8")  # no FP8 tensor cores before Hopper


def test_every_curve_is_used_or_a_cross_check_and_cites_its_source():
    db = load_profiles()
    used = {c.name for link in db.links.values() for c in link.curves}
    shapes = {c.shape.name for c in db.curves.values() if c.shape is not None}
    assert set(db.curves) - used - shapes == {"azure-nd-h200-v5-allreduce-nvls"}
    for curve in db.curves.values():
        assert curve.source.strip() and len(curve.sizes_bytes) == len(curve.busbw_gbps)
        assert 0.5 < curve.plateau_fraction < 1.1, curve.name
    assert get_link("nvswitch-h100").curve("nvls").name == "azure-nd-h100-v5-allreduce-nvls"
    assert get_link("nvlink5-switch").curve("nvls", 72).name == "coreweave-gb200-nvl72-allreduce"
    assert get_link("nvlink5-switch").curve("nvls", 8).name == "b200-allreduce-nvls"
    assert get_link("nvswitch-a100").curve("nvls") is None and not get_link("ib-ndr").sharp


def test_bad_curves_are_rejected(tmp_path):
    root = _copy_profiles(tmp_path)
    _edit(root / "links.toml", 'curves = ["ib-hdr-a100-3node"]', 'curves = ["ib-hdr-a100-4node"]')
    with pytest.raises(ProfileError, match=r"\[links\.ib-hdr\] key 'curves' names 'ib-hdr-a100-4node', not a curve"):
        load_profiles(str(root))
    (tmp_path / "b").mkdir()
    root = _copy_profiles(tmp_path / "b")
    _edit(root / "comm_curves.toml", "busbw_gbps = [320.0, 320.0]", "busbw_gbps = [320.0]")
    with pytest.raises(ProfileError, match=r"comm_curves\.toml: \[curves\.roce-400g-h100\] sizes_bytes has 2 entries"):
        load_profiles(str(root))
    (tmp_path / "c").mkdir()
    root = _copy_profiles(tmp_path / "c")
    _edit(root / "comm_curves.toml", 'link = "roce-400g"', 'link = "roce-999g"')
    with pytest.raises(ProfileError, match="key 'link' = 'roce-999g' is not a link of links.toml"):
        load_profiles(str(root))
