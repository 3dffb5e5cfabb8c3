"""What an export target cannot run, and the plan's memory under the target's model-state layout.

``target_refusals(plan, target, dims)`` applies the target's [[cannot_run]] rules (``costmodel.targets``) to the
plan's configuration. ``check_memory(plan, target, dims)`` gives, per pipeline rank, the plan's predicted memory
with its model states as the planner priced them (``costmodel.memory.model_state_bytes``) replaced by the
target's (``Target.model_state_bytes`` for the target's sharding mode), against the rank's device memory; the
rest of the plan's memory (activations, logits, buffers, allocator reserve) is kept as recorded until plans are
priced per target. Parameters per device come from the model's dimensions (``rank_params``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from costmodel.errors import ConfigError, PlanMismatchError, ProfileError
from costmodel.memory import model_state_bytes as planned_state_bytes
from costmodel.profiles import get_accelerator
from costmodel.step_config import ParallelConfig
from costmodel.targets import Target
from planner.models import ModelDims, model_dims
from planner.plan import Plan

CLOSE_FRACTION = 0.95
"""Warn above this share of device memory: PyTorch's caching allocator fragments 5-10% (costmodel.memory)."""
GB = 1e9
_LAYER_RE = re.compile(r"(?:^|\.)(\d+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMemory:
    """One pipeline rank's memory as planned and under the target's model-state layout (bytes)."""

    pp_rank: int
    gpu: str
    capacity_bytes: float
    planned_bytes: float
    planned_states_bytes: float
    target_states_bytes: float

    @property
    def target_bytes(self) -> float:
        return self.planned_bytes - self.planned_states_bytes + self.target_states_bytes

    @property
    def status(self) -> str:
        """``fits``, ``close`` (above CLOSE_FRACTION of capacity), ``exceeds`` or ``unknown`` (no capacity)."""
        if self.capacity_bytes <= 0:
            return "unknown"
        if self.target_bytes > self.capacity_bytes:
            return "exceeds"
        return "close" if self.target_bytes > CLOSE_FRACTION * self.capacity_bytes else "fits"

    def line(self) -> str:
        cap = f"{self.capacity_bytes / GB:.1f} GB ({self.gpu})" if self.capacity_bytes > 0 else f"? ({self.gpu})"
        return (f"pp rank {self.pp_rank}: {self.target_bytes / GB:.1f} GB of {cap}: {self.status} "
                f"(model states {self.target_states_bytes / GB:.1f} GB, planned {self.planned_states_bytes / GB:.1f}"
                f" GB; other memory as planned {(self.planned_bytes - self.planned_states_bytes) / GB:.1f} GB)")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryCheck:
    """The plan's memory under the target's model-state layout, per pipeline rank."""

    target: str
    mode: str
    """The target's sharding mode (a ``[memory.<mode>]`` table of its constants file)."""
    formula: str
    """Its model-state bytes per parameter, ``replicated + sharded/d``."""
    dp: int
    """The data-parallel degree d that the dense parameters shard over (dp x cp)."""
    ranks: tuple[RankMemory, ...]

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.target_bytes / r.capacity_bytes if r.capacity_bytes > 0 else 0.0)

    def lines(self) -> list[str]:
        head = (f"memory under {self.target}'s layout ({self.mode}: {self.formula} bytes of model states per "
                f"parameter, d={self.dp}); the plan's other memory as recorded, until plans are priced per target:")
        return [head, *(f"  {r.line()}" for r in self.ranks)]


# --- the plan as a configuration ----------------------------------------------------------------------------


def plan_dims(plan: Plan) -> ModelDims:
    """The model's dimensions from its spec; ConfigError for user code (give ``dims``)."""
    try:
        dims = model_dims(plan.model.name, seq=plan.model.seq_len)
    except ConfigError as e:
        raise ConfigError(
            f"export needs the model's shape, which plan model {plan.model.name!r} does not name ({e}); pass the "
            "same shape as a preset, inline dims or config.json (autopar export --model SPEC)"
        ) from None
    if dims.layers != plan.model.num_layers:
        raise PlanMismatchError(f"model {plan.model.name!r} has {dims.layers} layers but the plan was made for "
                                f"{plan.model.num_layers}: pass the plan's model with --model")
    return dims


def layers_per_stage(plan: Plan) -> list[int]:
    """Transformer layers in each pipeline chunk, in chunk order (modules whose FQN ends in an index)."""
    return [sum(1 for m in st.modules if _LAYER_RE.search(m)) for st in sorted(plan.stages, key=lambda s: s.index)]


def recompute_per_chunk(plan: Plan) -> list[tuple[str, int]]:
    """(mode, layers recomputed from the chunk's first) per chunk; ``StagePlan.recompute_layers`` when the plan
    has it, else all of the chunk's layers."""
    out = []
    for st, n in zip(sorted(plan.stages, key=lambda s: s.index), layers_per_stage(plan)):
        k = getattr(st, "recompute_layers", -1)  # -1 (and plans written before the counts): all of them
        k = n if k is None or int(k) < 0 else min(int(k), n)
        out.append((st.recompute, k) if st.recompute != "none" and k > 0 else ("none", 0))
    return out


def heaviest_recompute(plan: Plan) -> str:
    modes = {m for m, _ in recompute_per_chunk(plan)}
    return next((m for m in ("full", "selective") if m in modes), "none")


def config_of(plan: Plan) -> ParallelConfig:
    d, s = plan.degrees, plan.schedule
    per_chunk = recompute_per_chunk(plan)
    return ParallelConfig(
        tp=d.tp, pp=d.pp, dp=d.dp, cp=d.cp, ep=d.ep, microbatch=s.microbatch_size, global_batch=plan.global_batch,
        schedule=s.name, virtual_stages=s.virtual_stages, recompute=heaviest_recompute(plan),
        recompute_layers=tuple(k for _, k in per_chunk), sequence_parallel=plan.sequence_parallel,
        zero_stage=plan.zero_stage,
    )


def target_refusals(plan: Plan, target: Target, dims: ModelDims) -> list[str]:
    return target.refusals(config_of(plan), experts=dims.experts, tied_embeddings=dims.tied_embeddings, glu=dims.glu)


# --- memory under the target's layout -------------------------------------------------------------------------


def layer_params(dims: ModelDims) -> tuple[float, float]:
    """(dense, expert) parameters of one transformer layer: Q, O (h x h), K, V (h x h_kv), the MLP (three
    h x f matrices with SwiGLU, two plus biases with GeLU), router, norms (GPT: LayerNorm with biases)."""
    h, f = dims.hidden, dims.ffn_hidden
    kv = h * dims.kv_heads // dims.heads
    attn = 2 * h * h + 2 * h * kv + (0 if dims.glu else 2 * h + 2 * kv)
    mlp = 3 * h * f if dims.glu else 2 * h * f + f + h
    norms = 2 * h if dims.glu else 4 * h
    if dims.experts:
        return attn + norms + h * dims.experts, dims.experts * mlp
    return attn + mlp + norms, 0.0


def rank_params(plan: Plan, dims: ModelDims) -> list[tuple[float, float]]:
    """(dense, expert) parameters each device of each pipeline rank holds: dense sharded over tp, experts over ep
    (whole experts on each tp rank, as the runtime and the cost model hold them); the embedding on chunk 0, the
    final norm and LM head on the last (a tied head keeps its copy there when pp > 1). Scaled so that the model
    totals ``plan.model.params``."""
    d = plan.degrees
    layers = layers_per_stage(plan)
    dense_l, expert_l = layer_params(dims)
    positions = dims.seq * dims.hidden if dims.arch == "gpt" else 0
    embed = dims.vocab * dims.hidden + positions
    head = (dims.hidden if dims.glu else 2 * dims.hidden) + (0 if dims.tied_embeddings else dims.vocab * dims.hidden)
    chunks = [[n * dense_l, n * expert_l] for n in layers]
    chunks[0][0] += embed
    chunks[-1][0] += head
    total = sum(a + b for a, b in chunks)
    scale = plan.model.params / total if total > 0 and plan.model.params > 0 else 1.0
    if dims.tied_embeddings and d.pp > 1:
        chunks[-1][0] += dims.vocab * dims.hidden  # the head rank's copy of the tied embedding
    out = [[0.0, 0.0] for _ in range(d.pp)]
    for i, (dense, expert) in enumerate(chunks):
        out[i % d.pp][0] += dense * scale / d.tp
        out[i % d.pp][1] += expert * scale / d.ep
    return [(a, b) for a, b in out]


def _capacity(gpu: str) -> float:
    try:
        return get_accelerator(gpu).memory_bytes
    except ProfileError:
        return 0.0


def _states(zero_stage: int, dense: float, expert: float, plan: Plan, *, target: Target | None = None,
            mode: str = "") -> float:
    """Model-state bytes of a device: the planner's (target None) or the target's ``mode``; dense parameters
    shard over dp x cp, experts over dp / ep x cp."""
    d = plan.degrees
    groups = ((dense, d.dp * d.cp), (expert, max(1, d.dp // d.ep) * d.cp))
    if target is None:
        terms = [planned_state_bytes(params=p, zero_stage=zero_stage, dp=g) for p, g in groups]
    else:
        terms = [target.model_state_bytes(params=p, mode=mode, dp=g) for p, g in groups]
    return sum(sum(t.values()) for t in terms)


def check_memory(plan: Plan, target: Target, dims: ModelDims, *, zero_stage: int | None = None) -> MemoryCheck:
    """Each pipeline rank's memory with the target's model states for ``zero_stage`` (default: the plan's)."""
    zero = plan.zero_stage if zero_stage is None else zero_stage
    cfg = replace(config_of(plan), zero_stage=zero)
    mode = target.memory_mode(cfg, experts=dims.experts, tied_embeddings=dims.tied_embeddings, glu=dims.glu)
    by_rank: dict[int, tuple[float, str]] = {}
    for st in plan.stages:
        gb, gpu = by_rank.get(st.pp_rank, (0.0, ""))
        by_rank[st.pp_rank] = (max(gb, st.predicted_memory_gb), st.gpu or gpu)
    ranks = []
    for r, (dense, expert) in enumerate(rank_params(plan, dims)):
        gb, gpu = by_rank.get(r, (0.0, ""))
        gpu = gpu or plan.cluster.gpu.split("+")[0]
        ranks.append(RankMemory(
            pp_rank=r, gpu=gpu, capacity_bytes=_capacity(gpu),
            planned_bytes=(gb or plan.prediction.memory_gb_per_device) * GB,
            planned_states_bytes=_states(plan.zero_stage, dense, expert, plan),
            target_states_bytes=_states(zero, dense, expert, plan, target=target, mode=mode.name),
        ))
    return MemoryCheck(target=target.name, mode=mode.name, formula=mode.formula(),
                       dp=plan.degrees.dp * plan.degrees.cp, ranks=tuple(ranks))


def memory_refusal(plan: Plan, target: Target, dims: ModelDims, memory: MemoryCheck) -> str:
    """The worst rank's figures, and the other ZeRO stages the target runs that would fit."""
    w = memory.worst
    fits = []
    for zero in (0, 1, 2, 3):
        if zero == plan.zero_stage:
            continue
        alt = check_memory(plan, target, dims, zero_stage=zero)
        cfg = replace(config_of(plan), zero_stage=zero)
        runs = not target.refusals(cfg, experts=dims.experts, tied_embeddings=dims.tied_embeddings, glu=dims.glu)
        if runs and alt.worst.status in ("fits", "close"):
            fits.append(f"--fix zero={zero} ({alt.mode}: {alt.worst.target_bytes / GB:.1f} GB)")
    fix = ("re-plan with " + " or ".join(fits)) if fits else (
        "re-plan with more model parallelism (tp / pp), more recomputation or a smaller micro-batch")
    return (f"does not fit: pipeline rank {w.pp_rank} needs {w.target_bytes / GB:.1f} GB of "
            f"{w.capacity_bytes / GB:.1f} GB ({w.gpu}) with {target.name}'s model states ({memory.mode}: "
            f"{memory.formula} bytes per parameter, d={memory.dp}: {w.target_states_bytes / GB:.1f} GB against "
            f"{w.planned_states_bytes / GB:.1f} GB planned); {fix}")
