"""What-if analysis: plan one model on many clusters and tabulate the best plan of each.

``parse_sweep(["gpu=a100-80gb,h100", "nodes=1,2,4"])`` expands sweep axes into a list of ``ClusterCase``
(the cross product, built with ``costmodel.profiles.custom_cluster``); ``cluster_cases(["dgx-h100", "my.toml"])``
resolves named clusters and cluster files. ``run_whatif`` plans every case, in worker processes when
``jobs > 1``, and returns a ``WhatIfResult`` whose ``table`` is a pandas DataFrame with one row per case:
infeasible cases stay in the table, marked, with the memory per device they would need.

``fix`` pins choices on every cluster as ``plan_model(fix=...)`` does (``tp=8,pp=2``). Each case's outcome is
cached on disk under a hash of everything that decides it (model spec and, for a file, its content; cluster;
global batch; sequence length; time limit; pinned choices; the source of the cost model, the search and
the hardware profiles), so a repeated sweep only plans what changed. The cache directory is an argument
(``cache_dir``); ``default_cache_dir()`` is ``$XDG_CACHE_HOME/autopar/whatif`` or ``~/.cache/autopar/whatif``.

Costs: a cluster's price per hour is the sum over its node groups of GPUs x ``price_per_gpu_hour`` of the node
profile; cost per million tokens = price per second x 1e6 / tokens per second.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from costmodel.errors import AutoparError, ConfigError, InfeasiblePlanError
from costmodel.profiles import custom_cluster, get_node_type, list_node_types, resolve_cluster
from planner.plan import Plan
from planner.search.driver import plan_model
from planner.workload import workload_from_model

log = logging.getLogger(__name__)

# Sweep axes, their value types and the value used when an axis is not given.
SWEEP_AXES: dict[str, type] = {
    "gpu": str,
    "nodes": int,
    "gpus-per-node": int,
    "inter-node-gbps": float,
    "intra": str,
}
SWEEP_DEFAULTS: dict[str, Any] = {"nodes": 1, "gpus-per-node": 8, "inter-node-gbps": 400.0, "intra": "nvlink"}
INTRA_KINDS = ("nvlink", "pcie")
# ``inter-node-gbps`` is the NIC rate per GPU in Gb/s, as NICs are sold (InfiniBand HDR 200, NDR 400);
# ``custom_cluster`` takes GB/s per direction.
BITS_PER_BYTE = 8.0

# Source whose change invalidates cached outcomes (relative to the repository root).
_CODE_GLOBS = ("costmodel/*.py", "planner/search/*.py", "planner/workload.py", "planner/trace.py",
               "planner/graph.py", "planner/flops.py", "planner/models.py", "planner/plan.py", "profiles/**/*")
_REPO_ROOT = Path(__file__).resolve().parent.parent

STATUS_OK = "ok"
STATUS_INFEASIBLE = "infeasible"
STATUS_ERROR = "error"


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterCase:
    """One cluster of a what-if study and how the user described it."""

    label: str
    """Short name shown in tables and legends (``h100 2x8 nvlink 400G``, or the spec given)."""
    cluster: Any
    """A ``costmodel.hardware.Cluster``."""
    axes: dict[str, Any] = field(default_factory=dict)
    """gpu, nodes, gpus-per-node, intra, inter-node-gbps (NaN where it does not apply, one node)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """What planning one case gave: a plan, or why there is none."""

    status: str
    """``ok`` | ``infeasible`` | ``error``."""
    plan: Plan | None = None
    message: str = ""
    memory_gb_needed: float = math.nan
    """For an infeasible case, the memory per device the best candidate needs (NaN if unknown)."""
    plan_time_s: float = 0.0
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "message": self.message,
            "memory_gb_needed": None if math.isnan(self.memory_gb_needed) else self.memory_gb_needed,
            "plan_time_s": self.plan_time_s,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Outcome":
        mem = d.get("memory_gb_needed")
        return Outcome(
            status=d["status"],
            plan=Plan.from_dict(d["plan"]) if d.get("plan") is not None else None,
            message=d.get("message", ""),
            memory_gb_needed=math.nan if mem is None else float(mem),
            plan_time_s=float(d.get("plan_time_s", 0.0)),
            cached=True,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class WhatIfResult:
    table: Any
    """pandas DataFrame, one row per case in the order given (only finished cases if interrupted)."""
    plans: dict[str, Plan]
    """The best plan of each feasible case, by label."""
    interrupted: bool
    elapsed_s: float


# --- building the list of clusters ------------------------------------------------------------------------


def parse_axis(token: str) -> tuple[str, tuple[Any, ...]]:
    """``"nodes=1,2,4"`` -> ``("nodes", (1, 2, 4))``; ConfigError naming the axis and the fix otherwise."""
    name, sep, values = token.partition("=")
    name = name.strip()
    if not sep:
        raise ConfigError(f"sweep axis {token!r} has no '=': write AXIS=V1,V2 (axes: {', '.join(SWEEP_AXES)})")
    if name not in SWEEP_AXES:
        raise ConfigError(f"unknown sweep axis {name!r}; known axes: {', '.join(SWEEP_AXES)}")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not items:
        raise ConfigError(f"sweep axis {name!r} has no values: write {name}=V1,V2,...")
    kind = SWEEP_AXES[name]
    try:
        parsed = tuple(kind(float(v)) if kind is int and float(v).is_integer() else kind(v) for v in items)
    except ValueError:
        raise ConfigError(f"sweep axis {name!r}: values {items} must be {kind.__name__}s") from None
    if kind in (int, float) and any(v <= 0 for v in parsed):
        raise ConfigError(f"sweep axis {name!r}: values {list(parsed)} must be positive")
    if name == "intra" and any(v not in INTRA_KINDS for v in parsed):
        raise ConfigError(f"sweep axis 'intra': values {list(parsed)}; allowed {', '.join(INTRA_KINDS)}")
    return name, tuple(dict.fromkeys(parsed))


def parse_sweep(tokens: list[str]) -> list[ClusterCase]:
    """Cross product of sweep axes -> clusters (``custom_cluster``); ``gpu`` is required.

    With one node the inter-node bandwidth does not matter: those cases are kept once (inter-node-gbps NaN).
    """
    axes: dict[str, tuple[Any, ...]] = {}
    for token in tokens:
        name, values = parse_axis(token)
        if name in axes:
            raise ConfigError(f"sweep axis {name!r} given twice: give it once with all its values")
        axes[name] = values
    if "gpu" not in axes:
        raise ConfigError("a sweep needs a gpu axis, e.g. gpu=a100-80gb,h100")
    for name, default in SWEEP_DEFAULTS.items():
        axes.setdefault(name, (default,))
    names = list(SWEEP_AXES)
    cases: list[ClusterCase] = []
    seen: set[tuple] = set()
    for combo in itertools.product(*(axes[n] for n in names)):
        a = dict(zip(names, combo))
        if a["nodes"] == 1:
            a["inter-node-gbps"] = math.nan
        key = tuple(str(v) for v in a.values())
        if key in seen:
            continue
        seen.add(key)
        cluster = custom_cluster(
            gpu=a["gpu"],
            nodes=a["nodes"],
            gpus_per_node=a["gpus-per-node"],
            intra=a["intra"],
            inter_node_gbps=(SWEEP_DEFAULTS["inter-node-gbps"] if a["nodes"] == 1 else a["inter-node-gbps"])
            / BITS_PER_BYTE,
        )
        cases.append(ClusterCase(label=_sweep_label(a), cluster=cluster, axes=a))
    return cases


def _sweep_label(a: dict[str, Any]) -> str:
    label = f"{a['gpu']} {a['nodes']}x{a['gpus-per-node']} {a['intra']}"
    if not math.isnan(a["inter-node-gbps"]):
        label += f" {a['inter-node-gbps']:g}Gb"
    return label


def cluster_cases(specs: list[str], *, nodes: int | None = None, gpus_per_node: int | None = None) -> list[ClusterCase]:
    """Named node types / ``local`` / cluster .toml files -> cases (``costmodel.profiles.resolve_cluster``)."""
    cases = []
    for spec in specs:
        cluster = resolve_cluster(spec, nodes=nodes, gpus_per_node=gpus_per_node)
        label = Path(spec).stem if spec.endswith(".toml") else spec
        if nodes is not None:
            label += f" x{nodes}"
        cases.append(ClusterCase(label=label, cluster=cluster, axes=describe_cluster(cluster)))
    labels = [c.label for c in cases]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"clusters {labels} repeat a name: give each cluster once")
    return cases


def describe_cluster(cluster: Any) -> dict[str, Any]:
    """The sweep axes' values of any cluster (first node group for the per-node ones; NIC Gb/s per GPU)."""
    node = cluster.groups[0].node
    inter = math.nan if cluster.nodes == 1 else node.nic_gbps_per_gpu * BITS_PER_BYTE
    return {
        "gpu": "+".join(cluster.gpu_names) if len(cluster.gpu_names) > 1 else cluster.gpu_names[0],
        "nodes": cluster.nodes,
        "gpus-per-node": cluster.gpus_per_node,
        "intra": node.intra.kind,
        "inter-node-gbps": inter,
    }


def price_per_gpu_hour(node: Any) -> tuple[float, str]:
    """(USD per GPU-hour, where it came from) of a node type; NaN when no profile prices its GPU.

    A what-if node (``custom_cluster``) has no price of its own: it takes the price of the profiled node
    type with the same accelerator (the cheapest, if several).
    """
    if node.price_per_gpu_hour is not None:
        return float(node.price_per_gpu_hour), node.name
    priced = []
    for name in list_node_types():
        other = get_node_type(name)
        if other.gpu.name == node.gpu.name and other.price_per_gpu_hour is not None:
            priced.append((float(other.price_per_gpu_hour), other.name))
    return min(priced) if priced else (math.nan, "")


def price_per_hour(cluster: Any) -> float:
    """USD per hour of the whole cluster (GPUs x price per GPU-hour); NaN when a GPU has no price."""
    return sum(g.count * g.node.gpus_per_node * price_per_gpu_hour(g.node)[0] for g in cluster.groups)


# --- planning with a cache --------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autopar" / "whatif"


def code_fingerprint(root: Path = _REPO_ROOT) -> str:
    """sha256 over the source of the cost model, the search and the profiles (invalidates the cache)."""
    h = hashlib.sha256()
    for pattern in _CODE_GLOBS:
        for p in sorted(root.glob(pattern)):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _model_id(model: Any) -> str:
    """A spec string (plus the content of the file it names), or the repr of a ``(Workload, ModelInfo)``."""
    if not isinstance(model, str):
        return "object:" + hashlib.sha256(repr(model).encode()).hexdigest()
    path = Path(model.split(":")[0]) if not model.startswith(("gpt:", "llama:", "mixtral:")) else None
    if path is not None and path.is_file():
        return model + ":" + hashlib.sha256(path.read_bytes()).hexdigest()
    return model


def case_key(*, model: Any, cluster: Any, global_batch: int, seq: int | None, time_limit_s: float | None,
             code: str, fix: str | None = None) -> str:
    """Hash of everything that decides a case's outcome."""
    model_id = _model_id(model)
    blob = json.dumps(
        {"model": model_id, "cluster": repr(cluster), "global_batch": global_batch, "seq": seq,
         "time_limit_s": time_limit_s, "code": code, "fix": fix},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _read_cache(cache_dir: Path | None, key: str) -> Outcome | None:
    if cache_dir is None:
        return None
    p = cache_dir / f"{key}.json"
    try:
        return Outcome.from_dict(json.loads(p.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, AutoparError) as e:
        log.warning("ignoring unreadable cache entry %s: %s", p, e)
        return None


def _write_cache(cache_dir: Path | None, key: str, outcome: Outcome) -> None:
    if cache_dir is None or outcome.status == STATUS_ERROR:
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{key}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(outcome.to_dict(), sort_keys=True))
    tmp.replace(cache_dir / f"{key}.json")  # atomic: concurrent sweeps never read half a file


def _default_plan_fn(model: Any, cluster: Any, *, global_batch: int, seq: int | None,
                     time_limit_s: float | None, fix: str | None = None) -> Plan:
    return plan_model(model, cluster, global_batch=global_batch, seq=seq, time_limit_s=time_limit_s, fix=fix)


def plan_case(*, model: Any, cluster: Any, global_batch: int, seq: int | None = None,
              time_limit_s: float | None = None, fix: str | None = None,
              plan_fn: Callable[..., Plan] | None = None) -> Outcome:
    """Plan one cluster; an infeasible request becomes an ``infeasible`` outcome, other autopar errors ``error``."""
    fn = plan_fn or _default_plan_fn
    t0 = time.perf_counter()
    try:
        plan = fn(model, cluster, global_batch=global_batch, seq=seq, time_limit_s=time_limit_s, fix=fix)
    except InfeasiblePlanError as e:
        return Outcome(status=STATUS_INFEASIBLE, message=str(e), memory_gb_needed=_needed_memory_gb(e),
                       plan_time_s=time.perf_counter() - t0)
    except AutoparError as e:
        return Outcome(status=STATUS_ERROR, message=f"{type(e).__name__}: {e}", plan_time_s=time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    if not plan.prediction.fits:
        return Outcome(status=STATUS_INFEASIBLE, plan=plan, memory_gb_needed=plan.prediction.memory_gb_per_device,
                       message="best candidate does not fit in device memory", plan_time_s=dt)
    return Outcome(status=STATUS_OK, plan=plan, plan_time_s=dt)


def _needed_memory_gb(e: InfeasiblePlanError) -> float:
    """The memory per device the leanest candidate needs, as the planner reports it (NaN if unknown)."""
    v = e.memory_gb_needed
    return float(v) if v is not None else math.nan


def _worker_init() -> None:
    # Ctrl-C goes to the whole process group: only the parent handles it, so finished rows are kept.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _plan_task(task: dict[str, Any]) -> tuple[int, Outcome]:
    outcome = plan_case(**task["kwargs"])
    _write_cache(task["cache_dir"], task["key"], outcome)
    return task["index"], outcome


def _warm_trace(model: Any, seq: int | None) -> bool:
    """Trace once in the parent: ``planner.workload`` caches the result per process, and workers forked
    after this start with the cache warm, so the model is traced once per sweep, not once per worker."""
    if not isinstance(model, str):
        return False
    workload_from_model(model, batch=1, seq=seq)
    return True


def run_whatif(
    model: Any,
    cases: list[ClusterCase],
    *,
    global_batch: int,
    seq: int | None = None,
    tokens: float | None = None,
    time_limit_s: float | None = None,
    fix: str | None = None,
    jobs: int = 1,
    cache_dir: Path | None = None,
    plan_fn: Callable[..., Plan] | None = None,
    share_trace: bool = True,
    on_result: Callable[[int, int, dict[str, Any]], None] | None = None,
) -> WhatIfResult:
    """Plan ``model`` (a spec, or a ``(Workload, ModelInfo)`` pair as ``plan_model`` takes) on every case; rows
    in case order. Ctrl-C (KeyboardInterrupt) keeps finished rows.

    ``plan_fn(model, cluster, *, global_batch, seq, time_limit_s, fix) -> Plan`` replaces the planner (a
    module-level function when ``jobs > 1``); ``on_result(done, total, row)`` is called as each case finishes.
    ``share_trace``: trace the model once in this process and fork the workers from it (warm trace cache).
    """
    if not cases:
        raise ConfigError("no clusters to compare: give --cluster NAME|FILE or --sweep AXIS=V1,V2")
    if jobs < 1:
        raise ConfigError(f"jobs={jobs} must be >= 1")
    t0 = time.perf_counter()
    code = code_fingerprint()
    keys = [case_key(model=model, cluster=c.cluster, global_batch=global_batch, seq=seq,
                     time_limit_s=time_limit_s, code=code, fix=fix) for c in cases]
    outcomes: dict[int, Outcome] = {}
    rows: dict[int, dict[str, Any]] = {}

    def finish(i: int, outcome: Outcome) -> None:
        outcomes[i] = outcome
        rows[i] = outcome_row(cases[i], outcome, tokens=tokens)
        if on_result is not None:
            on_result(len(rows), len(cases), rows[i])

    interrupted = False
    try:
        todo = []
        for i, key in enumerate(keys):
            hit = _read_cache(cache_dir, key)
            if hit is not None:
                finish(i, hit)
            else:
                todo.append(i)
        if todo:
            warm = share_trace and plan_fn is None and _warm_trace(model, seq)
            tasks = [{"index": i, "key": keys[i], "cache_dir": cache_dir,
                      "kwargs": {"model": model, "cluster": cases[i].cluster, "global_batch": global_batch,
                                 "seq": seq, "time_limit_s": time_limit_s, "fix": fix, "plan_fn": plan_fn}}
                     for i in todo]
            _run_tasks(tasks, jobs=min(jobs, len(tasks)), finish=finish, fork=warm)
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: keeping %d of %d finished cases", len(rows), len(cases))
    return WhatIfResult(
        table=make_table([rows[i] for i in sorted(rows)]),
        plans={cases[i].label: o.plan for i, o in outcomes.items() if o.status == STATUS_OK and o.plan},
        interrupted=interrupted,
        elapsed_s=time.perf_counter() - t0,
    )


def _run_tasks(tasks: list[dict[str, Any]], *, jobs: int, finish: Callable[[int, Outcome], None],
               fork: bool = False) -> None:
    """Plan the tasks, in-process for one job; ``fork`` = workers inherit the parent's warm trace cache."""
    if jobs == 1:
        for task in tasks:
            finish(*_plan_task(task))
        return
    methods = multiprocessing.get_all_start_methods()
    method = "fork" if fork and "fork" in methods else "forkserver" if "forkserver" in methods else "spawn"
    ctx = multiprocessing.get_context(method)
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init)
    try:
        futures = [pool.submit(_plan_task, t) for t in tasks]
        for fut in cf.as_completed(futures):
            finish(*fut.result())
    except BaseException:
        _stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def _stop_pool(pool: cf.ProcessPoolExecutor) -> None:
    """Cancel what has not started and stop the workers that are still planning."""
    pool.shutdown(wait=False, cancel_futures=True)
    terminate = getattr(pool, "terminate_workers", None)  # Python >= 3.14
    if terminate is not None:
        terminate()
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.terminate()


# --- the table --------------------------------------------------------------------------------------------

TABLE_COLUMNS = (
    "cluster", "gpu", "gpus", "nodes", "gpus_per_node", "intra", "nic_gbit_s", "status",
    "tp", "pp", "dp", "cp", "ep", "zero", "sp", "schedule", "microbatch", "microbatches", "vstages", "recompute",
    "step_time_s", "tokens_per_s", "mfu", "memory_gb", "memory_gb_needed", "device_memory_gb", "bottleneck",
    "usd_per_hour", "usd_per_mtok", "train_days", "train_cost_usd", "search", "plan_time_s", "cached", "note",
)


def outcome_row(case: ClusterCase, outcome: Outcome, *, tokens: float | None) -> dict[str, Any]:
    """One table row: the case, the best plan's configuration and its predicted numbers."""
    cl = case.cluster
    a = case.axes
    row: dict[str, Any] = {k: math.nan for k in TABLE_COLUMNS}
    row.update(
        cluster=case.label, gpu=a.get("gpu"), gpus=cl.num_devices, nodes=a.get("nodes"),
        gpus_per_node=a.get("gpus-per-node"), intra=a.get("intra"), nic_gbit_s=a.get("inter-node-gbps"),
        status=outcome.status, memory_gb_needed=outcome.memory_gb_needed,
        device_memory_gb=min(g.node.gpu.memory_gb for g in cl.groups), usd_per_hour=price_per_hour(cl),
        plan_time_s=outcome.plan_time_s, cached=outcome.cached, note=outcome.message,
    )
    for k in ("tp", "pp", "dp", "cp", "ep", "zero", "microbatch", "microbatches", "vstages"):
        row[k] = None
    row.update(sp=None, schedule=None, recompute=None, bottleneck=None, search=None)
    plan = outcome.plan
    if plan is None:
        return row
    d, s, pr = plan.degrees, plan.schedule, plan.prediction
    row.update(
        tp=d.tp, pp=d.pp, dp=d.dp, cp=d.cp, ep=d.ep, zero=plan.zero_stage, sp=plan.sequence_parallel,
        schedule=s.name, microbatch=s.microbatch_size, microbatches=s.num_microbatches, vstages=s.virtual_stages,
        recompute=_recompute_summary(plan), memory_gb=pr.memory_gb_per_device, bottleneck=pr.bottleneck or None,
        search=plan.solver.status,
    )
    if outcome.status != STATUS_OK:
        return row
    row.update(step_time_s=pr.step_time_s, tokens_per_s=pr.tokens_per_s, mfu=pr.mfu)
    if pr.tokens_per_s > 0:
        row["usd_per_mtok"] = row["usd_per_hour"] / 3600.0 * 1e6 / pr.tokens_per_s
        if tokens:
            seconds = tokens / pr.tokens_per_s
            row["train_days"] = seconds / 86400.0
            row["train_cost_usd"] = row["usd_per_hour"] * seconds / 3600.0
    return row


def _recompute_summary(plan: Plan) -> str:
    kinds = sorted({st.recompute for st in plan.stages})
    return kinds[0] if len(kinds) == 1 else "mixed:" + "/".join(st.recompute for st in plan.stages)


def make_table(rows: list[dict[str, Any]]) -> Any:
    table = pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
    for k in ("tp", "pp", "dp", "cp", "ep", "zero", "microbatch", "microbatches", "vstages", "gpus", "nodes",
              "gpus_per_node"):
        table[k] = table[k].astype("Int64")
    return table


def plan_breakdowns(plans: dict[str, Plan]) -> dict[str, dict[str, float]]:
    """Where each plan's step time goes (``Prediction.breakdown_s``), by case label."""
    return {label: dict(p.prediction.breakdown_s) for label, p in plans.items()}
