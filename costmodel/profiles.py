"""Load hardware profiles (``profiles/*.toml``) and build clusters from them.

Every number in the profile files carries a ``source``. Files are validated on load: a bad value raises
``ProfileError`` naming the file, the table and key, and the allowed values. The built-in files are read
once per process (an ``lru_cache`` of immutable results keyed by directory).

``load_calibration`` reads a calibration file (JSON or TOML) written by ``autopar calibrate``.

Cluster specs accepted by ``resolve_cluster``: a node type name (``dgx-a100-80gb``) times ``nodes``;
``local`` (CPU processes on this machine; uses a calibration when given); a ``.toml`` cluster file with
``[[groups]]`` of node types (heterogeneous clusters), optionally defining its own ``[nodes.*]``,
``[links.*]`` and ``[curves.*]``. Links name their nccl-tests curves (``comm_curves.toml``) by ``curves``.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from costmodel.calibration import Calibration, calibration_from_dict, shared_by
from costmodel.errors import ProfileError
from costmodel.hardware import (
    CURVE_ALGORITHMS,
    DTYPES,
    INTRA_TOPOLOGIES,
    LINK_KINDS,
    Accelerator,
    BusCurve,
    Cluster,
    Link,
    NodeGroup,
    NodeType,
)

log = logging.getLogger(__name__)

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
"""The ``profiles`` data package (a plain directory next to ``costmodel``)."""

LOCAL = "local"


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileDB:
    """All accelerators, links and node types known, keyed by canonical name."""

    accelerators: Mapping[str, Accelerator]
    links: Mapping[str, Link]
    nodes: Mapping[str, NodeType]
    curves: Mapping[str, BusCurve] = field(default_factory=lambda: MappingProxyType({}))
    """Published nccl-tests curves (``comm_curves.toml``) by name."""


# ------------------------------------------------------------------------------------------ validation


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ProfileError(f"profile file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:  # message carries "(at line L, column C)"
        raise ProfileError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path}: not a TOML file (byte {e.start} is not UTF-8 text)") from None


class _Table:
    """One ``[section.name]`` table of a file, with typed getters whose errors name file, table and key."""

    def __init__(self, data: Any, *, file: Path | str, where: str) -> None:
        self.file, self.where = file, where
        if not isinstance(data, dict):
            self.fail(f"must be a table, got {type(data).__name__}")
        self.data = data

    def fail(self, msg: str) -> None:
        raise ProfileError(f"{self.file}: [{self.where}] {msg}")

    def _raw(self, key: str, default: Any, required: bool) -> Any:
        if key not in self.data:
            if required:
                self.fail(f"missing key {key!r}")
            return default
        return self.data[key]

    def string(self, key: str, *, required: bool = True, default: str = "", allowed: tuple[str, ...] = ()) -> str:
        value = self._raw(key, default, required)
        if not isinstance(value, str) or (required and not value):
            self.fail(f"key {key!r} = {value!r} must be a non-empty string")
        if allowed and value not in allowed:
            self.fail(f"key {key!r} = {value!r} is not allowed; allowed values: {', '.join(allowed)}")
        return value

    def number(self, key: str, *, required: bool = True, default: float | None = None, integer: bool = False) -> Any:
        value = self._raw(key, default, required)
        if value is None and not required:
            return None
        good = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not good:
            self.fail(f"key {key!r} = {value!r} must be {'an integer' if integer else 'a number'}")
        if value <= 0 or value != value or value == float("inf"):
            self.fail(f"key {key!r} = {value!r} must be a positive finite number")
        return value if integer else float(value)

    def boolean(self, key: str) -> bool:
        value = self._raw(key, False, False)
        if not isinstance(value, bool):
            self.fail(f"key {key!r} = {value!r} must be true or false")
        return value

    def numbers(self, key: str) -> tuple[float, ...]:
        value = self._raw(key, None, True)
        if not isinstance(value, list) or not value:
            self.fail(f"key {key!r} must be a non-empty list of positive numbers")
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                self.fail(f"key {key!r} holds {v!r}; every entry must be a positive finite number")
        return tuple(float(v) for v in value)

    def strings(self, key: str) -> tuple[str, ...]:
        value = self._raw(key, [], False)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail(f"key {key!r} must be a list of strings")
        return tuple(value)

    def check_keys(self, allowed: tuple[str, ...]) -> None:
        unknown = sorted(set(self.data) - set(allowed))
        if unknown:
            self.fail(f"unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")


_ACCEL_KEYS = ("vendor", "kind", "memory_gb", "hbm_gbps", "peak_tflops", "source", "aliases", "nvlink_link", "pcie_link",
               "attention_speedup")
_LINK_KEYS = ("kind", "gbps_per_direction", "latency_s", "source", "curves", "sharp")
_CURVE_KEYS = ("op", "algorithm", "ranks", "nodes", "link", "reference_gbps", "sizes_bytes", "busbw_gbps", "shape",
               "source")  # fmt: skip
_CURVE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
_NODE_KEYS = ("gpu", "gpus_per_node", "intra", "intra_topology", "nic", "nics_per_node", "price_per_gpu_hour",
              "price_source", "source")  # fmt: skip


def _parse_accelerator(name: str, data: Any, *, file: Path | str) -> Accelerator:
    t = _Table(data, file=file, where=f"accelerators.{name}")
    t.check_keys(_ACCEL_KEYS)
    peaks = _Table(t._raw("peak_tflops", None, True), file=file, where=f"accelerators.{name}.peak_tflops")
    peaks.check_keys(DTYPES)
    if not peaks.data:
        peaks.fail(f"needs at least one of {', '.join(DTYPES)}")
    return Accelerator(
        name=name,
        memory_gb=t.number("memory_gb"),
        hbm_gbps=t.number("hbm_gbps"),
        peak_tflops={d: peaks.number(d) for d in DTYPES if d in peaks.data},
        source=t.string("source"),
        vendor=t.string("vendor", required=False),
        kind=t.string("kind", required=False, default="gpu", allowed=("gpu", "cpu")),  # type: ignore[arg-type]
        aliases=t.strings("aliases"),
        nvlink_link=t.string("nvlink_link", required=False),
        pcie_link=t.string("pcie_link", required=False),
        attention_speedup=t.number("attention_speedup", required=False, default=1.0),
    )


def _parse_link(name: str, data: Any, *, file: Path | str, curves: Mapping[str, BusCurve]) -> Link:
    t = _Table(data, file=file, where=f"links.{name}")
    t.check_keys(_LINK_KEYS)
    chosen = []
    for curve_name in t.strings("curves"):
        if curve_name not in curves:
            t.fail(f"key 'curves' names {curve_name!r}, not a curve of comm_curves.toml; "
                   f"known: {', '.join(sorted(curves))}")
        chosen.append(curves[curve_name])
    for kinds in (("nvls",), ("ring", "auto")):
        sizes = [c.ranks for c in chosen if c.algorithm in kinds]
        if len(sizes) != len(set(sizes)):
            t.fail(f"key 'curves' lists two {' / '.join(kinds)} curves of the same group size; keep one per size")
    return Link(
        name=name,
        kind=t.string("kind", allowed=LINK_KINDS),  # type: ignore[arg-type]
        gbps_per_direction=t.number("gbps_per_direction"),
        latency_s=t.number("latency_s"),
        source=t.string("source"),
        curves=tuple(chosen),
        sharp=t.boolean("sharp"),
    )


def _parse_curve(name: str, data: Any, *, file: Path | str, link_latency: Mapping[str, float],
                 shapes: dict) -> BusCurve:
    """One ``[curves.NAME]`` table; ``shapes`` maps names to curves parsed so far (a shape is named before use)."""
    t = _Table(data, file=file, where=f"curves.{name}")
    t.check_keys(_CURVE_KEYS)
    link = t.string("link")
    if link not in link_latency:
        t.fail(f"key 'link' = {link!r} is not a link of links.toml; known: {', '.join(sorted(link_latency))}")
    sizes, busbw = t.numbers("sizes_bytes"), t.numbers("busbw_gbps")
    if len(sizes) != len(busbw):
        t.fail(f"sizes_bytes has {len(sizes)} entries and busbw_gbps {len(busbw)}; give one busbw per size")
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        t.fail("sizes_bytes must increase")
    shape_name = t.string("shape", required=False)
    if shape_name and shape_name not in shapes:
        t.fail(f"key 'shape' = {shape_name!r} is not a curve defined above it; known: {', '.join(sorted(shapes))}")
    ranks, nodes = t.number("ranks", integer=True), t.number("nodes", integer=True)
    if ranks < 2 or nodes > ranks or ranks % nodes:
        t.fail(f"ranks = {ranks}, nodes = {nodes}: need ranks >= 2 spread evenly over the nodes")
    return BusCurve(
        name=name, op=t.string("op", allowed=_CURVE_OPS), algorithm=t.string("algorithm", allowed=CURVE_ALGORITHMS),
        ranks=ranks, nodes=nodes, link=link, link_latency_s=link_latency[link],
        reference_gbps=t.number("reference_gbps"), sizes_bytes=sizes, busbw_gbps=busbw, source=t.string("source"),
        shape=shapes[shape_name] if shape_name else None,
    )  # fmt: skip


def _parse_curves(curves: dict, links: dict, *, file: Path | str, base: Mapping[str, BusCurve]) -> dict[str, BusCurve]:
    """The curves of ``curves`` (in file order, so a shape precedes its users), resolving links in ``links``."""
    latency: dict[str, float] = {}
    for n, d in links.items():
        value = d.get("latency_s") if isinstance(d, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            latency[n] = float(value)
    out = dict(base)
    for n, d in curves.items():
        out[n] = _parse_curve(n, d, file=file, link_latency=latency, shapes=out)
    return out


def _lookup(table: _Table, key: str, known: Mapping[str, Any], what: str) -> Any:
    name = table.string(key)
    if name not in known:
        table.fail(f"key {key!r} = {name!r} is not a known {what}; known: {', '.join(sorted(known))}")
    return known[name]


def _parse_node(name: str, data: Any, *, file: Path | str, accelerators: Mapping, links: Mapping) -> NodeType:
    t = _Table(data, file=file, where=f"nodes.{name}")
    t.check_keys(_NODE_KEYS)
    return NodeType(
        name=name,
        gpu=_lookup(t, "gpu", accelerators, "accelerator"),
        gpus_per_node=t.number("gpus_per_node", integer=True),
        intra=_lookup(t, "intra", links, "link"),
        intra_topology=t.string("intra_topology", required=False, default="switch", allowed=INTRA_TOPOLOGIES),
        nic=_lookup(t, "nic", links, "link"),
        nics_per_node=t.number("nics_per_node", integer=True),
        price_per_gpu_hour=t.number("price_per_gpu_hour", required=False),
        price_source=t.string("price_source", required=False),
        source=t.string("source"),
    )


def _section(data: dict, key: str, *, file: Path | str, required: bool) -> dict:
    if key not in data:
        if required:
            raise ProfileError(f"{file}: missing top-level table [{key}]")
        return {}
    if not isinstance(data[key], dict):
        raise ProfileError(f"{file}: [{key}] must be a table of named tables")
    return data[key]


def parse_profiles(*, accelerators: dict, links: dict, nodes: dict, files: tuple[str, ...],
                   base: ProfileDB | None = None, curves: dict | None = None) -> ProfileDB:
    """Build a ``ProfileDB`` from parsed TOML sections (extending ``base`` if given); ``files`` names the
    accelerators, links, nodes (and curves) files for error messages."""
    accels = dict(base.accelerators) if base else {}
    accels.update({n: _parse_accelerator(n, d, file=files[0]) for n, d in accelerators.items()})
    base_links = {n: {"latency_s": link.latency_s} for n, link in base.links.items()} if base else {}
    curve_map = _parse_curves(curves or {}, {**base_links, **links}, file=files[-1],
                              base=base.curves if base else {})
    link_map = dict(base.links) if base else {}
    link_map.update({n: _parse_link(n, d, file=files[1], curves=curve_map) for n, d in links.items()})
    node_map = dict(base.nodes) if base else {}
    node_map.update(
        {n: _parse_node(n, d, file=files[2], accelerators=accels, links=link_map) for n, d in nodes.items()}
    )
    return ProfileDB(
        accelerators=MappingProxyType(accels), links=MappingProxyType(link_map), nodes=MappingProxyType(node_map),
        curves=MappingProxyType(curve_map),
    )


@functools.lru_cache(maxsize=8)
def load_profiles(directory: str | None = None) -> ProfileDB:
    """Read ``accelerators.toml``, ``links.toml``, ``nodes.toml`` and (if present) ``comm_curves.toml`` from
    ``directory`` (default: built-in)."""
    root = Path(directory) if directory else PROFILES_DIR
    paths = tuple(root / f for f in ("accelerators.toml", "links.toml", "nodes.toml"))
    sections = [
        _section(_read_toml(p), key, file=p, required=True) for p, key in zip(paths, ("accelerators", "links", "nodes"))
    ]
    curves_path = root / "comm_curves.toml"
    curves = (_section(_read_toml(curves_path), "curves", file=curves_path, required=True)
              if curves_path.exists() else {})
    return parse_profiles(
        accelerators=sections[0], links=sections[1], nodes=sections[2], curves=curves,
        files=tuple(str(p) for p in (*paths, curves_path)),
    )


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file (JSON, or TOML for ``.toml``); errors name the file and key."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"calibration file {str(path)!r} does not exist; create one with `autopar calibrate --out {path}`")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path}: not a text file (byte {e.start} is not UTF-8); give the JSON or TOML file "
                           "that `autopar calibrate --out` wrote") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: invalid TOML: {e}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    return calibration_from_dict(data, where=str(path))


# ------------------------------------------------------------------------------------------- lookups


def list_accelerators() -> list[str]:
    return sorted(load_profiles().accelerators)


def list_node_types() -> list[str]:
    return sorted(load_profiles().nodes)


def list_links() -> list[str]:
    return sorted(load_profiles().links)


def _accelerator_named(name: str, db: ProfileDB) -> Accelerator | None:
    wanted = name.strip().lower()
    for accel in db.accelerators.values():
        if wanted == accel.name.lower() or wanted in (a.lower() for a in accel.aliases):
            return accel
    return None


def _node_named(name: str, db: ProfileDB) -> NodeType | None:
    wanted = name.strip().lower()
    return next((node for node in db.nodes.values() if node.name.lower() == wanted), None)


def _close_matches(name: str, db: ProfileDB) -> str:
    names = [*db.accelerators, *(a for acc in db.accelerators.values() for a in acc.aliases), *db.nodes]
    close = difflib.get_close_matches(name.strip().lower(), [n.lower() for n in names], n=3, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def get_accelerator(name: str, *, db: ProfileDB | None = None) -> Accelerator:
    """By name or alias (``profiles/accelerators.toml``), or by a node type's name (its accelerator: ``dgx-h100``
    is ``H100-SXM5-80GB``), case-insensitive; unknown -> ProfileError with close matches and the known names."""
    db = db or load_profiles()
    accel = _accelerator_named(name, db)
    node = None if accel is not None else _node_named(name, db)
    if accel is not None or node is not None:
        return accel if accel is not None else node.gpu
    raise ProfileError(f"unknown accelerator {name!r}{_close_matches(name, db)}; known: "
                       f"{', '.join(sorted(db.accelerators))} (their aliases, or a node type's name)")


def get_link(name: str, *, db: ProfileDB | None = None) -> Link:
    db = db or load_profiles()
    for link in db.links.values():
        if link.name.lower() == name.strip().lower():
            return link
    raise ProfileError(f"unknown link {name!r}; known: {', '.join(sorted(db.links))}")


def get_node_type(name: str, *, db: ProfileDB | None = None) -> NodeType:
    """By name (``profiles/nodes.toml``), or by an accelerator's name or alias: the node type built of it
    (``h100`` and ``H100-SXM5-80GB`` are ``dgx-h100``), case-insensitive."""
    db = db or load_profiles()
    node = _node_named(name, db)
    if node is not None:
        return node
    accel = _accelerator_named(name, db)
    if accel is None:
        raise ProfileError(f"unknown node type {name!r}{_close_matches(name, db)}; known: "
                           f"{', '.join(sorted(db.nodes))}, an accelerator they hold, or a cluster .toml file")
    nodes = sorted(n.name for n in db.nodes.values() if n.gpu.name == accel.name)
    if len(nodes) != 1:
        have = f"several node types hold it: {', '.join(nodes)}; name one" if nodes else (
            f"no node type in profiles/nodes.toml holds it; name one of {', '.join(sorted(db.nodes))}, or sweep it "
            f"with `autopar whatif --sweep gpu={accel.name}`")
        raise ProfileError(f"{name!r} is the accelerator {accel.name}: {have}")
    return db.nodes[nodes[0]]


# ------------------------------------------------------------------------------------------- clusters


def _positive_int(value: Any, what: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"{what} = {value!r} must be a positive integer; {fix}")
    return value


def local_node_type(*, gpus_per_node: int, calibration: Calibration | None = None) -> NodeType:
    """``local``: ``gpus_per_node`` CPU processes on this machine; measured rates when calibrated.

    With a calibration (already ``costmodel.calibration.shared_by`` the ranks when they outnumber the cores,
    as ``make_cluster`` passes it) the accelerator's peak is the fitted matmul peak per dtype, its memory
    bandwidth the measured memory-bound rate, and the loopback link's bandwidth / latency the all-reduce fit (the comm model
    uses the per-op fits directly). Without one, the conservative defaults of ``profiles/``.
    """
    base = get_node_type(LOCAL)
    gpu, link = base.gpu, base.intra
    if calibration is not None:
        peaks = {f.dtype: f.peak_tflops for f in calibration.matmul_fits}
        gpu = replace(
            gpu,
            peak_tflops=peaks or dict(gpu.peak_tflops),
            hbm_gbps=calibration.membound_gbps,
            memory_gb=calibration.memory_gb,
            source=f"autopar calibrate on {calibration.device_name}, {calibration.date}",
        )
        fit = calibration.collective_fit("all_reduce")
        if fit is not None:
            link = replace(
                link,
                gbps_per_direction=fit.bus_gbps,
                latency_s=max(fit.latency_s, 1e-9),
                source=f"autopar calibrate ({calibration.backend}) on {calibration.device_name}, {calibration.date}",
            )
    return replace(base, gpu=gpu, intra=link, nic=link, gpus_per_node=gpus_per_node)


def make_cluster(
    node_type: str, nodes: int, *, gpus_per_node: int | None = None, calibration: Calibration | None = None
) -> Cluster:
    """``nodes`` nodes of ``node_type`` (a name from ``profiles/nodes.toml``, ``local``, or an accelerator's name
    or alias: the node type that holds it)."""
    nodes = _positive_int(nodes, "nodes", "pass --nodes N with N >= 1")
    if gpus_per_node is not None:
        _positive_int(gpus_per_node, "gpus_per_node", "pass --gpus-per-node N with N >= 1")
    node = get_node_type(node_type)  # a node type, or an accelerator's name or alias
    if node.name == LOCAL:
        gpn = gpus_per_node or node.gpus_per_node
        calibration = shared_by(calibration, gpn) if calibration is not None else None
        node = local_node_type(gpus_per_node=gpn, calibration=calibration)
    else:
        if gpus_per_node is not None and gpus_per_node != node.gpus_per_node:
            node = replace(node, gpus_per_node=gpus_per_node, nics_per_node=max(1, node.nics_per_node * gpus_per_node // node.gpus_per_node))
    return Cluster(name=f"{nodes}x{node.name}", groups=(NodeGroup(node=node, count=nodes),), calibration=calibration)


def load_cluster_file(path: str | Path, *, calibration: Calibration | None = None) -> Cluster:
    """A cluster TOML file: ``name``, ``[[groups]]`` (``node``, ``count``, optional ``gpus_per_node``),
    optional ``calibration`` (a path relative to the file) and its own ``[accelerators.*]``, ``[links.*]``,
    ``[nodes.*]`` tables (same keys as the built-in files)."""
    path = Path(path)
    data = _read_toml(path)
    allowed = ("name", "groups", "calibration", "accelerators", "links", "nodes", "curves")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ProfileError(f"{path}: unknown top-level key {unknown[0]!r}; allowed: {', '.join(allowed)}")
    db = parse_profiles(
        accelerators=_section(data, "accelerators", file=path, required=False),
        links=_section(data, "links", file=path, required=False),
        nodes=_section(data, "nodes", file=path, required=False),
        curves=_section(data, "curves", file=path, required=False),
        files=(str(path),) * 4,
        base=load_profiles(),
    )
    groups_raw = data.get("groups")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ProfileError(f"{path}: missing key 'groups': add one or more [[groups]] tables with node = NAME, count = N")
    if calibration is None and "calibration" in data:
        cal_path = data["calibration"]
        if not isinstance(cal_path, str):
            raise ProfileError(f"{path}: key 'calibration' must be a path string")
        calibration = load_calibration(path.parent / cal_path)
    groups = []
    for i, raw in enumerate(groups_raw):
        t = _Table(raw, file=path, where=f"groups[{i}]")
        t.check_keys(("node", "count", "gpus_per_node"))
        name = t.string("node")
        count = t.number("count", integer=True)
        gpn = t.number("gpus_per_node", required=False, integer=True)
        if name.lower() == LOCAL:
            gpn = gpn or get_node_type(LOCAL).gpus_per_node
            if calibration is not None and not any(g.node.name == LOCAL for g in groups):
                calibration = shared_by(calibration, gpn)  # the local ranks of the first local group share cores
            node = local_node_type(gpus_per_node=gpn, calibration=calibration)
        else:
            if name not in db.nodes:
                t.fail(f"key 'node' = {name!r} is not a known node type; known: {', '.join(sorted(db.nodes))}")
            node = db.nodes[name]
            if gpn and gpn != node.gpus_per_node:
                node = replace(node, gpus_per_node=gpn, nics_per_node=max(1, node.nics_per_node * gpn // node.gpus_per_node))
        groups.append(NodeGroup(node=node, count=count))
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{path}: key 'name' must be a non-empty string")
    return Cluster(name=name, groups=tuple(groups), calibration=calibration)


def resolve_cluster(
    spec: str, *, nodes: int | None = None, gpus_per_node: int | None = None, profile_path: str | Path | None = None
) -> Cluster:
    """What ``--cluster SPEC [--nodes N] [--gpus-per-node G] [--profile FILE]`` means.

    ``spec`` is a node type name, ``local``, or a cluster ``.toml`` file. ``nodes`` (default 1) and
    ``gpus_per_node`` apply to node types; for a single-group file ``nodes`` overrides its count.
    """
    calibration = load_calibration(profile_path) if profile_path else None
    if spec.endswith(".toml") or Path(spec).is_file():
        cluster = load_cluster_file(spec, calibration=calibration)
        if nodes is not None or gpus_per_node is not None:
            if len(cluster.groups) != 1:
                raise ProfileError(
                    f"--nodes / --gpus-per-node cannot resize cluster file {spec!r}: it has {len(cluster.groups)} "
                    "node groups; edit the counts in the file instead"
                )
            group = cluster.groups[0]
            node = group.node if gpus_per_node is None else replace(group.node, gpus_per_node=gpus_per_node)
            count = _positive_int(nodes, "nodes", "pass --nodes N with N >= 1") if nodes is not None else group.count
            cluster = replace(cluster, groups=(NodeGroup(node=node, count=count),))
        return cluster
    return make_cluster(spec, nodes if nodes is not None else 1, gpus_per_node=gpus_per_node, calibration=calibration)


def custom_cluster(*, gpu: str, nodes: int, gpus_per_node: int, intra: str, inter_node_gbps: float) -> Cluster:
    """A what-if cluster: ``nodes`` x ``gpus_per_node`` of ``gpu`` on NVLink (the GPU's own NVLink / NVSwitch
    generation) or PCIe (its PCIe generation), one NIC per GPU of ``inter_node_gbps`` GB/s per direction
    (GB/s, not Gb/s: InfiniBand NDR 400 Gb/s = 50)."""
    accel = get_accelerator(gpu)
    nodes = _positive_int(nodes, "nodes", "pass nodes >= 1")
    gpus_per_node = _positive_int(gpus_per_node, "gpus_per_node", "pass gpus_per_node >= 1")
    if isinstance(inter_node_gbps, bool) or not isinstance(inter_node_gbps, (int, float)) or not inter_node_gbps > 0:
        raise ProfileError(f"inter_node_gbps = {inter_node_gbps!r} must be a positive number of GB/s per direction")
    if inter_node_gbps > 200:  # 1.6 Tb/s NICs are 200 GB/s: a larger number is probably Gb/s
        log.warning("inter_node_gbps=%g GB/s per GPU is above any NIC sold; did you pass Gb/s (divide by 8)?", inter_node_gbps)
    choices = {"nvlink": accel.nvlink_link, "pcie": accel.pcie_link}
    if intra not in choices:
        raise ProfileError(f"intra = {intra!r}; allowed: nvlink, pcie")
    if not choices[intra]:
        raise ProfileError(f"{accel.name} has no {intra} fabric in profiles/accelerators.toml; use intra='pcie'")
    intra_link = get_link(choices[intra])
    ndr = get_link("ib-ndr")
    nic = Link(
        name=f"nic-{inter_node_gbps:g}GBps",
        kind="infiniband",
        gbps_per_direction=float(inter_node_gbps),
        latency_s=ndr.latency_s,
        source="what-if: custom_cluster(inter_node_gbps=...); InfiniBand NDR's latency and nccl-tests curve",
        curves=ndr.curves,
    )
    topology = "switch" if intra_link.kind in ("nvswitch",) else "full-mesh" if intra_link.kind == "xgmi" else (
        "pcie-tree" if intra_link.kind == "pcie" else "switch")  # fmt: skip
    node = NodeType(
        name=f"custom-{gpus_per_node}x{accel.name}-{intra}",
        gpu=accel,
        gpus_per_node=gpus_per_node,
        intra=intra_link,
        intra_topology=topology,
        nic=nic,
        nics_per_node=gpus_per_node,
        source="what-if: custom_cluster",
    )
    return Cluster(name=f"{nodes}x{node.name}", groups=(NodeGroup(node=node, count=nodes),))
