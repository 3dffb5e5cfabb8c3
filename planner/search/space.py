"""The search space: which parallel configurations exist for a model on a cluster, and the cheap bounds.

A configuration is split in two:

- ``Structure``: tp, cp, ep, pp, dp, micro-batch size, schedule, virtual stages: what the devices are and
  how the batch flows. Validity is decided here from divisibility (tp a power of two within a node dividing
  heads and kv heads; cp a power of two with ``2 cp`` dividing the sequence, for the load-balanced causal split;
  ep dividing experts and dp; pp at most the number of layers, uneven cuts allowed; dp dividing the global
  batch; every micro-batch size dividing ``global_batch / dp``; the schedule's constraints on micro-batch counts;
  up to ``layers / pp`` chunks per rank for interleaved 1F1B and zero-bubble, as torch runs them).
- ``Knobs``: recompute none/selective/full and how many layers of each chunk it covers, ZeRO stage 0-3,
  sequence parallel: memory-for-time trades that ``knobs.best_knobs`` decides per structure and cut.

What is left out, and why (``tests/test_search.py`` compares the search with every configuration):

- ZeRO-1 by default: ZeRO-2 moves the same bytes and also shards the gradients (``--fix zero=1`` still works).
- With ``dp * cp == 1`` ZeRO has nothing to shard over: only ZeRO-0.
- Context parallel (cp > 1) with pp = 1 and ep = 1 only, what the runtime executes
  (``runtime/context_parallel.py``); ``--fix`` with both cp and pp (or cp and ep) still prices the combination.
- Zero-bubble with ZeRO 1-3: the runtime runs those as FSDP2, which its zero-bubble pipeline refuses.
- With ``pp == 1`` the schedule and virtual stages are moot: one structure with ``1f1b`` and ``v = 1``.

``step_time_lower_bound_s`` (perfect compute at peak, stretched by the schedule's bubble) and
``pipeline_lower_bound_s`` (summed layer times) hold for any cut and knobs; ``bounds`` has the tighter ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from costmodel.errors import ConfigError

RECOMPUTE_ORDER = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)

_FIX_ALIASES = {
    "tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp": "dp",
    "mb": "microbatch", "microbatch": "microbatch", "micro_batch": "microbatch",
    "schedule": "schedule", "v": "virtual_stages", "virtual_stages": "virtual_stages",
    "recompute": "recompute", "zero": "zero_stage", "zero_stage": "zero_stage",
    "sp": "sequence_parallel", "sequence_parallel": "sequence_parallel",
}
_INT_KEYS = ("tp", "cp", "ep", "pp", "dp", "microbatch", "virtual_stages", "zero_stage")


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchOptions:
    max_microbatch: int | None = None
    """Largest micro-batch size enumerated; None: every divisor of ``global_batch / dp`` (bounds prune them)."""
    max_cp: int = 8
    min_tokens_per_cp_rank: int = 1024
    """Context parallel only while each rank keeps this many tokens: below that, ring attention's blocks are
    too small to hide their send/recv (and sequences that short do not need cp to fit)."""
    max_virtual_stages: int | None = None
    """Most chunks per pipeline rank (interleaved 1F1B, zero-bubble); None: up to ``layers / pp``, as torch's
    ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble`` run any number (uneven chunks allowed)."""
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
    recompute: tuple[str, ...] = RECOMPUTE_ORDER
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO-1 and ZeRO-2 differ in gradient accumulation where the target's ZeRO-2 reduces every micro-batch
    (``StepConstants.zero2_reduce_per_microbatch``, autopar's runtime): ZeRO-1 keeps the full gradient until the
    last micro-batch and reduces once, ZeRO-2 shards it and reduces m times; neither dominates, both are
    searched."""
    uneven_stages: bool = True
    """Search uneven layer cuts (embedding and LM head weigh in); False: even cuts only."""
    cut_vectors_limit: int = 20000
    """Per structure, the most layer-count vectors looked at to list every cut whose bound is below the best
    step time (identical transformer layers); above it the DPs of ``cuts`` propose the cut and the structure
    stays unproven (its bound counts in the search's bound)."""
    cut_evaluations: int | None = 1000
    """Step-model calls the cut search may make after the even-cut exploration (the most promising pipelines
    first); the pipelines left open keep their bound in the search's bound. None: no limit."""
    exhaustive_cuts: int = 256
    """Models whose transformer layers differ: price every cut when there are at most this many, else the DPs
    propose one (unproven)."""
    num_alternatives: int = 5
    exhaustive_knobs: bool = False
    """Evaluate every knob combination instead of the dominance ladder (for tests)."""
    sequence_parallel_tps: frozenset[int] | None = None
    """The tp degrees at which the model's blocks have an executable sequence-parallel sharding (None: all).
    ``plan_model`` fills it from the traced blocks: MoE routers / experts and GPT-2's Conv1D layers, for
    example, cannot take sequence-sharded input in the runtime."""


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class Structure:
    tp: int
    cp: int
    ep: int
    pp: int
    dp: int
    microbatch: int
    schedule: str
    virtual_stages: int
    num_microbatches: int

    def summary(self) -> str:
        sched = self.schedule if self.virtual_stages == 1 else f"{self.schedule} v={self.virtual_stages}"
        par = f"tp={self.tp} pp={self.pp} dp={self.dp}"
        if self.cp > 1:
            par += f" cp={self.cp}"
        if self.ep > 1:
            par += f" ep={self.ep}"
        return f"{par} mb={self.microbatch} m={self.num_microbatches} {sched}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Knobs:
    recompute: str = "none"
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute_layers: tuple[int, ...] | None = None
    """Per pipeline chunk, how many of its transformer layers (from its first) use ``recompute``; None: all."""

    def sort_key(self) -> tuple:
        return (self.recompute, self.zero_stage, self.sequence_parallel, self.recompute_layers or ())

    def summary(self) -> str:
        rec = self.recompute
        if self.recompute_layers is not None and rec != "none":
            rec += f"({sum(self.recompute_layers)} layers)"
        return f"recompute={rec} zero={self.zero_stage}" + (" sp" if self.sequence_parallel else "")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelDimsLite:
    """The dimensions the space depends on (taken from a Workload)."""

    heads: int
    kv_heads: int
    layers: int
    seq: int
    experts: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class SpaceStats:
    structures: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


def parse_fix(fix: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """``{"tp": 8, "mb": 2}`` or ``"tp=8,mb=2"`` -> canonical keys; unknown keys -> ConfigError."""
    if fix is None:
        return {}
    items: Iterable[tuple[str, Any]]
    if isinstance(fix, str):
        pairs = [p.strip() for p in fix.split(",") if p.strip()]
        bad = [p for p in pairs if "=" not in p]
        if bad:
            raise ConfigError(f"--fix entries must be key=value, got {bad!r}; e.g. --fix tp=8,pp=4")
        items = [tuple(p.split("=", 1)) for p in pairs]  # type: ignore[misc]
    else:
        items = fix.items()
    out: dict[str, Any] = {}
    for key, value in items:
        k = _FIX_ALIASES.get(str(key).strip().lower())
        if k is None:
            raise ConfigError(f"cannot fix {key!r}: known keys are {sorted(set(_FIX_ALIASES))}")
        out[k] = _fix_value(k, value)
    return out


def _fix_value(key: str, value: Any) -> Any:
    if key in _INT_KEYS:
        try:
            v = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"fix {key}={value!r}: expected an integer") from None
        if v < (0 if key == "zero_stage" else 1):
            raise ConfigError(f"fix {key}={v}: must be >= {0 if key == 'zero_stage' else 1}")
        return v
    if key == "sequence_parallel":
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"fix sp={value!r}: expected true or false")
    v = str(value).strip().lower()
    allowed = RECOMPUTE_ORDER if key == "recompute" else ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
    if v not in allowed:
        raise ConfigError(f"fix {key}={value!r}: choose one of {allowed}")
    return v


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def tp_choices(dims: ModelDimsLite, *, gpus_per_node: int) -> list[int]:
    return [t for t in _pow2_upto(gpus_per_node) if dims.heads % t == 0 and dims.kv_heads % t == 0]


def cp_choices(dims: ModelDimsLite, *, options: SearchOptions) -> list[int]:
    return [c for c in _pow2_upto(options.max_cp)
            if c == 1 or (dims.seq % (2 * c) == 0 and dims.seq // c >= options.min_tokens_per_cp_rank)]


def ep_choices(dims: ModelDimsLite, *, dp: int) -> list[int]:
    if dims.experts <= 1:
        return [1]
    return [e for e in divisors(dp) if dims.experts % e == 0]


def _schedules(*, pp: int, m: int, layers: int, options: SearchOptions) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out: list[tuple[str, int]] = []
    if "gpipe" in options.schedules:
        out.append(("gpipe", 1))
    if "1f1b" in options.schedules and m >= pp:
        out.append(("1f1b", 1))
    if m % pp == 0:
        most = layers // pp if options.max_virtual_stages is None else min(layers // pp, options.max_virtual_stages)
        if "interleaved-1f1b" in options.schedules:
            out.extend(("interleaved-1f1b", v) for v in range(2, most + 1))
        if "zero-bubble" in options.schedules:
            out.extend(("zero-bubble", v) for v in range(1, most + 1))
    return out


def _both_fixed(fix: Mapping[str, Any], a: str, b: str) -> bool:
    return a in fix and b in fix


def enumerate_structures(
    *,
    dims: ModelDimsLite,
    num_devices: int,
    gpus_per_node: int,
    global_batch: int,
    options: SearchOptions,
    fix: Mapping[str, Any] | None = None,
    group_devices: tuple[int, ...] = (),
) -> list[Structure]:
    """Every valid structure, sorted (deterministic); ``fix`` pins any field.

    ``group_devices``: devices per node group of a heterogeneous cluster, in rank order. A pipeline rank's
    devices (a contiguous block of ``N / pp`` ranks) must not straddle two groups, so that each stage runs on
    one GPU type: every group boundary must be a multiple of ``N / pp``.
    """
    fix = dict(fix or {})
    boundaries = [sum(group_devices[: i + 1]) for i in range(len(group_devices) - 1)]
    if global_batch < 1:
        raise ConfigError(f"global_batch={global_batch} must be >= 1")
    out: list[Structure] = []

    def pinned(key: str, values: Iterable[Any]) -> list[Any]:
        vals = list(values)
        return [fix[key]] if key in fix and fix[key] in vals else ([] if key in fix else vals)

    for tp in pinned("tp", tp_choices(dims, gpus_per_node=gpus_per_node)):
        # a pinned cp needs only to split the sequence (the tokens-per-rank floor is a search heuristic)
        cps = cp_choices(dims, options=replace(options, min_tokens_per_cp_rank=1) if "cp" in fix else options)
        for cp in pinned("cp", cps):
            rest = num_devices // (tp * cp) if num_devices % (tp * cp) == 0 else 0
            pps = [p for p in divisors(rest) if p <= dims.layers and all(b % (num_devices // p) == 0 for b in boundaries)]
            if cp > 1 and not _both_fixed(fix, "cp", "pp"):
                pps = [p for p in pps if p == 1]  # the runtime runs cp without pp
            for pp in pinned("pp", pps if rest else []):
                dp = rest // pp
                if global_batch % dp or ("dp" in fix and fix["dp"] != dp):
                    continue
                eps = ep_choices(dims, dp=dp) if cp == 1 or _both_fixed(fix, "cp", "ep") else [1]  # cp without ep
                for ep in pinned("ep", eps):
                    per_dp = global_batch // dp
                    mbs = [b for b in divisors(per_dp) if options.max_microbatch is None or b <= options.max_microbatch]
                    for mb in pinned("microbatch", mbs):
                        m = per_dp // mb
                        for sched, v in _schedules(pp=pp, m=m, layers=dims.layers, options=options):
                            if fix.get("schedule", sched) != sched or fix.get("virtual_stages", v) != v:
                                continue
                            out.append(Structure(tp=tp, cp=cp, ep=ep, pp=pp, dp=dp, microbatch=mb, schedule=sched,
                                                 virtual_stages=v, num_microbatches=m))
    out.sort()
    return out


def valid_dps(*, dims: ModelDimsLite, num_devices: int, gpus_per_node: int, options: SearchOptions,
              fix: Mapping[str, Any] | None = None) -> list[int]:
    """Data-parallel degrees some (tp, cp, pp) allows, whatever the batch (for 'nearest valid batch' hints)."""
    fix = dict(fix or {})
    out = set()
    for tp in tp_choices(dims, gpus_per_node=gpus_per_node):
        for cp in cp_choices(dims, options=options):
            if num_devices % (tp * cp) or fix.get("tp", tp) != tp or fix.get("cp", cp) != cp:
                continue
            rest = num_devices // (tp * cp)
            for pp in divisors(rest):
                if cp > 1 and pp > 1 and not _both_fixed(fix, "cp", "pp"):
                    continue  # the runtime runs cp without pp
                if pp <= dims.layers and fix.get("pp", pp) == pp and fix.get("dp", rest // pp) == rest // pp:
                    out.add(rest // pp)
    return sorted(out)


def knob_choices(structure: Structure, *, options: SearchOptions, fix: Mapping[str, Any] | None = None) -> list[Knobs]:
    """Knob combinations for a structure, in ladder order (fastest recompute first)."""
    fix = dict(fix or {})
    rec = [fix["recompute"]] if "recompute" in fix else list(options.recompute)
    zeros = [fix["zero_stage"]] if "zero_stage" in fix else list(options.zero_stages)
    if "zero_stage" not in fix and structure.dp * structure.cp == 1 and not options.exhaustive_knobs:
        zeros = [0]  # ZeRO shards over the dp x cp ranks: with one there is nothing to shard
    if "zero_stage" not in fix and structure.schedule == "zero-bubble":
        zeros = [0]  # the runtime runs ZeRO 1-3 as FSDP2, which its zero-bubble pipeline refuses (runtime/pipeline.py)
    if "sequence_parallel" in fix:
        sps = [fix["sequence_parallel"]] if (structure.tp > 1 or not fix["sequence_parallel"]) else []
    elif structure.tp > 1 and (options.sequence_parallel_tps is None or structure.tp in options.sequence_parallel_tps):
        sps = [True, False]
    elif structure.tp > 1:
        sps = [False]
    else:
        sps = [False]
    return [Knobs(recompute=r, zero_stage=z, sequence_parallel=s) for r in rec for z in zeros for s in sps]


def bubble_factor(structure: Structure) -> float:
    """Pipeline time over busy time for equal stages: 1 + (p - 1)/(v m) (GPipe/1F1B v = 1, SC21 interleaving)."""
    if structure.pp == 1 or structure.schedule == "zero-bubble":
        return 1.0
    return 1.0 + (structure.pp - 1) / (structure.virtual_stages * structure.num_microbatches)


def step_time_lower_bound_s(structure: Structure, *, ideal_step_s: float) -> float:
    """A bound no plan of this structure can beat: all FLOPs at peak on every device, plus the bubble.

    ``ideal_step_s`` = model FLOPs per step / (devices * peak FLOP/s). Unequal stages only lengthen the
    pipeline (``sum_s T_s + (m - 1) max_s T_s >= (m + p - 1) * mean_s T_s``), recomputation and
    communication only add. Zero-bubble schedules get no bubble credit (their bubble can vanish).
    """
    return ideal_step_s * bubble_factor(structure)


def pipeline_lower_bound_s(structure: Structure, *, layer_time_sum_s: float,
                           least_sum_s: float | None = None) -> float:
    """A bound on the step time from the summed per-micro-batch layer time ``T`` of all pipeline ranks.

    Whatever the cuts, the busiest rank does at least ``T / pp`` per micro-batch. GPipe / 1F1B take
    ``sum_s T_s + (m - 1) max_s T_s >= T (m + pp - 1) / pp``; interleaved ``T (m + (pp - 1) / v) / pp``;
    zero-bubble at least ``m T / pp`` (the busiest rank's work). p2p, data-parallel communication and the
    optimizer only add.

    Heterogeneous ranks (``least_sum_s`` given): ``T`` is then ``pp`` times the busiest rank's least time
    (all layers spread in proportion to the ranks' speeds) and ``least_sum_s`` the least ``sum_s T_s`` (all
    layers at the fastest rank's speed): GPipe / 1F1B take at least ``least_sum + (m - 1) T / pp``, the
    others ``m T / pp`` (the cuts may move work off the slow ranks, so the equal-rank terms do not hold).
    """
    s = structure
    if least_sum_s is not None:
        busiest = layer_time_sum_s / s.pp
        if s.schedule in ("gpipe", "1f1b") and s.virtual_stages == 1:
            return least_sum_s + (s.num_microbatches - 1) * busiest
        return s.num_microbatches * busiest
    if s.schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        # interleaved: m max_r T_r + sum_{r < pp-1} max-chunk_r >= m M + (T - M) / v, least at M = T / pp
        return layer_time_sum_s * (s.num_microbatches + (s.pp - 1) / s.virtual_stages) / s.pp
    return layer_time_sum_s * s.num_microbatches / s.pp


def nearest_valid_batches(*, global_batch: int, dps: Iterable[int], count: int = 4) -> list[int]:
    """The valid global batches closest to ``global_batch``: multiples of some data-parallel degree."""
    dps = sorted(set(d for d in dps if d >= 1))
    if not dps:
        return []
    cands: set[int] = set()
    for d in dps:
        lo = (global_batch // d) * d
        cands.update(x for x in (lo, lo + d) if x >= 1)
    return sorted(cands, key=lambda x: (abs(x - global_batch), x))[:count]
