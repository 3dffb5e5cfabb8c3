"""The partition file: frozen dataclasses <-> versioned JSON.

The plan is the contract between planner and runtime. It is keyed by module FQN and parameter name (never by
FX node objects) and carries a fingerprint of the model so that it is never applied to another model by
accident. ``Plan.to_dict`` / ``Plan.from_dict`` round-trip exactly; ``load_plan`` validates against the JSON
Schema in ``planner/plan_schema.json`` (generated from these dataclasses by ``plan_json_schema``).

Mesh layout: ranks are laid out row-major over ``MeshSpec.axis_names`` = ("pp", "dp", "ep", "cp", "tp"),
tp innermost. The batch is split over dp x ep ranks (``ParallelDegrees.dp`` is the total data-parallel degree,
``ep`` divides it); expert weights are sharded over "ep" and replicated over "dp".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

from costmodel.errors import PlanMismatchError

SCHEMA_VERSION = 1
MESH_AXES = ("pp", "dp", "ep", "cp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
RECOMPUTE = ("none", "selective", "full")
SHARDING_STYLES = (
    "replicate",  # weights replicated over tp; input and output replicated
    "colwise",  # nn.Linear weight Shard(0) over tp (Megatron column parallel)
    "rowwise",  # nn.Linear weight Shard(1) over tp, output all-reduced (Megatron row parallel)
    "vocab_embedding",  # nn.Embedding weight Shard(0) over tp (vocabulary parallel)
    "vocab_head",  # LM head colwise, logits stay sharded for the parallel cross-entropy
    "sequence_parallel",  # norm / dropout on a sequence-sharded activation
    "expert",  # MoE experts sharded over ep, tokens dispatched with all-to-all
)

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelInfo:
    """What the plan was made for."""

    name: str
    """The model spec as the user gave it (``gpt3-175b``, ``llama:layers=...``, a path)."""
    fingerprint: str
    """sha256 over (parameter FQN, shape, dtype) in order: see ``model_fingerprint``."""
    params: int
    flops_per_step: float
    """Model FLOPs of one optimizer step (forward + backward, no recomputation)."""
    num_layers: int
    seq_len: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterInfo:
    """Summary of the cluster the plan was made for."""

    name: str
    num_devices: int
    nodes: int
    gpus_per_node: int
    gpu: str
    """Accelerator name; several joined by ``+`` for heterogeneous clusters."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDegrees:
    """Parallel degrees; their product tp * cp * pp * dp equals the world size (ep divides dp)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshSpec:
    """The DeviceMesh the runtime builds: axis names outer -> inner and their sizes."""

    axis_names: tuple[str, ...] = MESH_AXES
    axis_sizes: tuple[int, ...] = (1, 1, 1, 1, 1)

    @staticmethod
    def from_degrees(d: ParallelDegrees) -> "MeshSpec":
        return MeshSpec(axis_names=MESH_AXES, axis_sizes=(d.pp, d.dp // d.ep, d.ep, d.cp, d.tp))

    def size(self, axis: str) -> int:
        return self.axis_sizes[self.axis_names.index(axis)]


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline model chunk: which modules, on which ranks, with which recomputation.

    With interleaving there are ``pp * virtual_stages`` chunks; chunk ``i`` runs on pipeline rank ``i % pp``.
    """

    index: int
    pp_rank: int
    modules: tuple[str, ...]
    """Module FQNs, in execution order (``model.embed_tokens``, ``model.layers.0``, ...)."""
    ranks: tuple[int, ...]
    """Global ranks holding this chunk."""
    recompute: Recompute = "none"
    recompute_layers: int = -1
    """How many of the chunk's transformer layers (its recomputable layers: all but the embedding and the head),
    counted from its first, run with ``recompute``; the rest keep their activations. -1 (and a plan file without
    the field): all of them; a count above the chunk's layers means all of them too. With ``recompute="none"`` no
    layer is recomputed. The search writes the count it priced (the fewest that fit)."""
    gpu: str = ""
    """Accelerator of the node group the chunk is placed on: the one its time was predicted on (on a
    heterogeneous cluster each pipeline rank's ranks lie in one node group, and the cuts balance the groups)."""
    predicted_time_s: float = 0.0
    """Forward + backward time of one micro-batch through this chunk, on ``gpu``."""
    predicted_memory_gb: float = 0.0
    """Memory of each device of the chunk's pipeline rank (all its chunks together: the same on each of them)."""

    @classmethod
    def placed(cls, index: int, *, pp: int, world_size: int, modules: tuple[str, ...], **fields: Any) -> "StagePlan":
        """Chunk ``index`` where the mesh puts it: on pipeline rank ``index % pp`` (loop placement), whose ranks are
        the contiguous block ``[r * N / pp, (r + 1) * N / pp)`` of the row-major (pp, dp, ep, cp, tp) mesh."""
        r, per_rank = index % pp, world_size // pp
        return cls(index=index, pp_rank=r, modules=tuple(modules), ranks=tuple(range(r * per_rank, (r + 1) * per_rank)),
                   **fields)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleSharding:
    """How one module's parameters and activations are split over the tp (or ep) axis."""

    fqn: str
    style: str
    """One of ``SHARDING_STYLES``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleSpec:
    name: Schedule = "1f1b"
    microbatch_size: int = 1
    num_microbatches: int = 1
    virtual_stages: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """What the cost model predicts for one optimizer step."""

    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hw_tflops_per_gpu: float
    mfu: float
    memory_gb_per_device: float
    """The largest over devices."""
    fits: bool
    breakdown_s: dict[str, float] = field(default_factory=dict)
    """compute, comm_<link kind> (exposed), bubble, optimizer, ... summing to ``step_time_s``."""
    memory_breakdown_gb: dict[str, float] = field(default_factory=dict)
    bottleneck: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """A candidate the search costed but did not pick (for ``autopar explain``)."""

    summary: str
    step_time_s: float
    memory_gb_per_device: float
    fits: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverStats:
    time_per_phase_s: dict[str, float] = field(default_factory=dict)
    status: str = "optimal"
    """``optimal`` | ``feasible`` (time limit hit, best so far) | ``fixed`` (configuration given)."""
    objective: float = 0.0
    bound: float = 0.0
    """A lower bound on the step time of every plan in the space that ``proven`` names."""
    gap: float = 0.0
    candidates_explored: int = 0
    proven: str = ""
    """Which space ``status``, ``bound`` and ``gap`` cover, in words (``optimal over the whole space (...)``, or
    what was left open: pipelines whose cuts a DP proposed, not reached before the time limit, ...)."""
    intra_op: dict[str, float] = field(default_factory=dict)
    """The per-block sharding ILPs behind the plan's shardings: ``blocks`` (workload entries),
    ``distinct_solutions``, how many ended ``optimal`` / ``feasible`` / ``greedy``, and ``max_gap``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A complete parallelization plan for one model on one cluster."""

    schema_version: int = SCHEMA_VERSION
    model: ModelInfo
    cluster: ClusterInfo
    degrees: ParallelDegrees
    mesh: MeshSpec
    stages: tuple[StagePlan, ...]
    shardings: tuple[ModuleSharding, ...] = ()
    zero_stage: int = 0
    sequence_parallel: bool = False
    schedule: ScheduleSpec
    global_batch: int
    precision: str = "bf16"
    """GEMM precision of the linears (``costmodel.step_config.PRECISIONS``: bf16, fp8, fp8-cs, mxfp8, nvfp4), as
    the target's ``[precision.<name>]`` table prices it."""
    target: str = "autopar"
    """The execution target the plan was priced for (``costmodel.targets.load_target`` spec, e.g. ``megatron``):
    its constants, refusals and memory layout; ``autopar export --to X`` exports plans made for X."""
    prediction: Prediction
    solver: SolverStats = field(default_factory=SolverStats)
    alternatives: tuple[Alternative, ...] = ()

    @classmethod
    def build(
        cls,
        *,
        model: ModelInfo,
        cluster: ClusterInfo,
        degrees: ParallelDegrees,
        stages: Iterable[StagePlan],
        schedule: ScheduleSpec,
        prediction: Prediction,
        shardings: Iterable[ModuleSharding] = (),
        zero_stage: int = 0,
        sequence_parallel: bool = False,
        solver: SolverStats | None = None,
        alternatives: Iterable[Alternative] = (),
    ) -> "Plan":
        """A plan from its parts (stages from ``StagePlan.placed``): the mesh follows the degrees, the global batch
        is microbatch_size x num_microbatches x dp; checked as a loaded plan is (``PlanMismatchError``)."""
        plan = cls(
            model=model, cluster=cluster, degrees=degrees, mesh=MeshSpec.from_degrees(degrees), stages=tuple(stages),
            shardings=tuple(shardings), zero_stage=zero_stage, sequence_parallel=sequence_parallel, schedule=schedule,
            global_batch=schedule.microbatch_size * schedule.num_microbatches * degrees.dp, prediction=prediction,
            solver=solver if solver is not None else SolverStats(), alternatives=tuple(alternatives),
        )
        _check_consistency(plan)
        return plan

    def to_dict(self) -> dict[str, Any]:
        return _to_jsonable(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        if not isinstance(data, dict):
            raise PlanMismatchError(f"plan must be a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanMismatchError(
                f"plan schema_version={version!r}; this autopar reads version {SCHEMA_VERSION}: "
                "re-run `autopar plan` to write a current plan"
            )
        validate_plan_dict(data)
        plan = _from_jsonable(cls, data, "plan")
        _check_consistency(plan)
        return plan

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, fixed float repr, so equal plans give byte-identical files."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def modules_of_pp_rank(self, pp_rank: int) -> tuple[str, ...]:
        return tuple(m for s in self.stages if s.pp_rank == pp_rank for m in s.modules)


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(plan.to_json())


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; every problem becomes a ``PlanMismatchError`` naming the file."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise PlanMismatchError(f"cannot read plan file {p}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise PlanMismatchError(f"{p}: not a plan file (byte {e.start} is not UTF-8 text); give the JSON that "
                                "`autopar plan --out` wrote") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanMismatchError(
            f"{p}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
            "re-create it with `autopar plan --out`"
        ) from None
    try:
        return Plan.from_dict(data)
    except PlanMismatchError as e:
        raise PlanMismatchError(f"{p}: {e}") from None


def model_fingerprint(params: Iterable[tuple[str, tuple[int, ...], str]]) -> str:
    """sha256 of the ordered (FQN, shape, dtype) triples of a model's parameters.

    ``params`` comes from ``[(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]``;
    it needs no torch import here, so planner and runtime compute the same string.
    """
    h = hashlib.sha256()
    for name, shape, dtype in params:
        h.update(f"{name}:{','.join(map(str, shape))}:{dtype};".encode())
    return "sha256:" + h.hexdigest()[:32]


def module_fingerprint(module: Any) -> str:
    """``model_fingerprint`` of a torch module (anything with ``named_parameters()``; no torch import here)."""
    return model_fingerprint((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters())


def check_plan_matches(plan: Plan, *, fingerprint: str, world_size: int) -> None:
    """Refuse a plan made for another model or another world size, with the numbers."""
    if plan.model.fingerprint != fingerprint:
        raise PlanMismatchError(
            f"plan was made for model {plan.model.name!r} (fingerprint {plan.model.fingerprint}), "
            f"but this model has fingerprint {fingerprint}: re-plan with `autopar plan` for this model"
        )
    if plan.degrees.world_size != world_size:
        raise PlanMismatchError(
            f"plan needs world size {plan.degrees.world_size} (tp={plan.degrees.tp} cp={plan.degrees.cp} "
            f"pp={plan.degrees.pp} dp={plan.degrees.dp}) but {world_size} ranks are running: launch "
            f"{plan.degrees.world_size} ranks or re-plan for {world_size}"
        )


# --- consistency ------------------------------------------------------------------------------------------


def _check_consistency(plan: Plan) -> None:
    d = plan.degrees
    errors = []
    for axis in ("tp", "cp", "pp", "dp", "ep"):
        if getattr(d, axis) < 1:
            errors.append(f"{axis}={getattr(d, axis)} must be >= 1")
    if not errors and d.dp % d.ep:
        errors.append(f"ep={d.ep} must divide dp={d.dp}")
    if not errors and tuple(plan.mesh.axis_sizes) != MeshSpec.from_degrees(d).axis_sizes:
        errors.append(f"mesh sizes {plan.mesh.axis_sizes} do not match degrees {d}")
    if not errors and d.world_size != plan.cluster.num_devices:
        errors.append(
            f"degrees use {d.world_size} devices but the cluster has {plan.cluster.num_devices}"
        )
    s = plan.schedule
    if len(plan.stages) != d.pp * s.virtual_stages:
        errors.append(f"{len(plan.stages)} stages, expected pp*virtual_stages={d.pp * s.virtual_stages}")
    if s.microbatch_size * s.num_microbatches * d.dp != plan.global_batch:
        errors.append(
            f"microbatch_size={s.microbatch_size} x num_microbatches={s.num_microbatches} x dp={d.dp} "
            f"!= global_batch={plan.global_batch}"
        )
    if plan.zero_stage not in (0, 1, 2, 3):
        errors.append(f"zero_stage={plan.zero_stage} must be 0, 1, 2 or 3")
    for m in plan.shardings:
        if m.style not in SHARDING_STYLES:
            errors.append(f"module {m.fqn}: unknown style {m.style!r}; allowed {SHARDING_STYLES}")
    gpus = tuple(g for g in plan.cluster.gpu.split("+") if g)
    rank_gpu: dict[int, str] = {}
    for st in plan.stages:
        if st.recompute not in RECOMPUTE:
            errors.append(f"stage {st.index}: recompute={st.recompute!r}; allowed {RECOMPUTE}")
        if st.recompute_layers < -1:
            errors.append(f"stage {st.index}: recompute_layers={st.recompute_layers} must be >= 0 (or -1: all)")
        if st.gpu and gpus and st.gpu not in gpus:
            errors.append(f"stage {st.index}: gpu={st.gpu!r} is not in the cluster's accelerators {gpus}")
        if st.gpu and rank_gpu.setdefault(st.pp_rank, st.gpu) != st.gpu:
            errors.append(f"stage {st.index}: gpu={st.gpu!r} but pipeline rank {st.pp_rank}'s other chunks run "
                          f"on {rank_gpu[st.pp_rank]!r}; a rank's chunks share its devices")
    if errors:
        raise PlanMismatchError("inconsistent plan: " + "; ".join(errors))


# --- generic dataclass <-> JSON -----------------------------------------------------------------------------


def _to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return None
        return float(f"{obj:.9g}")
    return obj


def _from_jsonable(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _from_jsonable(hints[f.name], value[f.name], f"{where}.{f.name}")
        return tp(**kwargs)
    if origin is tuple:
        args = typing.get_args(tp)
        inner = args[0]
        return tuple(_from_jsonable(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _, vt = typing.get_args(tp)
        return {k: _from_jsonable(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        return float("nan") if value is None else float(value)
    return value


# --- JSON Schema ------------------------------------------------------------------------------------------

_SCHEMA_PATH = Path(__file__).with_name("plan_schema.json")


def _schema_of(tp: Any) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        props = {f.name: _schema_of(hints[f.name]) for f in dataclasses.fields(tp)}
        required = [
            f.name
            for f in dataclasses.fields(tp)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        return {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }
    if origin is tuple:
        return {"type": "array", "items": _schema_of(typing.get_args(tp)[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema_of(typing.get_args(tp)[1])}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": ["number", "null"]}
    if tp is str:
        return {"type": "string"}
    raise TypeError(f"no JSON schema for {tp!r}")


def plan_json_schema() -> dict[str, Any]:
    """The JSON Schema of a plan file, derived from the dataclasses (committed as plan_schema.json)."""
    schema = _schema_of(Plan)
    schema["properties"]["schema_version"] = {"const": SCHEMA_VERSION}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"autopar partition plan, schema version {SCHEMA_VERSION}",
        **schema,
    }


def validate_plan_dict(data: dict[str, Any]) -> None:
    import jsonschema

    schema = json.loads(_SCHEMA_PATH.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errs = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errs:
        e = errs[0]
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
        raise PlanMismatchError(f"plan field {where}: {e.message}{more}")
