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
    for name in ("accelerators.toml", "links.toml", "nodes.toml"):
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
