"""The planner's search: loop the space, price with the step model, cut stages, assemble the Plan.

Phases (each timed in ``SolverStats.time_per_phase_s``):

1. ``trace``: the model spec becomes a ``Workload`` (``planner.workload``, cached) unless one is given.
2. ``enumerate``: ``space.enumerate_structures`` lists the valid structures (tp, cp, ep, pp, dp, micro-batch,
   schedule, virtual stages); each gets a lower bound on its step time: the larger of perfect compute at peak
   (``space.step_time_lower_bound_s``) and the pipeline bound from its group's summed layer times
   (``space.pipeline_lower_bound_s``, one step-model call per (tp, cp, ep, micro-batch) group), valid for any
   cuts and knobs. Structures are sorted by it.
3. ``screen``: branch and bound. Each structure gets its best knobs (recompute, ZeRO, sequence parallel) by the
   dominance ladder of ``_best_knobs`` with even stages; the loop stops when a structure's lower bound
   reaches the best step time found (all later ones have larger bounds).
4. ``stage_dp``: for the best pipelined structures (within ``dp_margin`` of the best, at most ``dp_top_k``,
   bound below the best), the stage DP (GPipe / 1F1B) or the layer-count DP (interleaved 1F1B, zero-bubble)
   proposes uneven cuts (embedding and LM head weigh in, each rank at its node group's speed, memory with the
   schedule's in-flight micro-batches and each rank's own limit), each priced again by the step model with
   its own knob ladder.

``status="optimal"`` means: every structure was screened or pruned by its bound, under the dominance rules of
``space`` (each checked against the step model in ``tests/test_search.py``); uneven cuts are searched among the
``dp_top_k`` best structures by the stage DP for GPipe / 1F1B pipelines (v = 1) and by the layer-count DP for
interleaved 1F1B and zero-bubble (``cuts``; exact for identical transformer layers), or by ``exhaustive_cuts``
enumeration. On a heterogeneous cluster each stage is priced on its own node group's accelerator, so the cuts
give the faster groups more layers.
5. ``intra_op``: the per-block sharding of the chosen configuration (engineer P1's ILP).

Anytime: with ``time_limit_s`` the loop stops when the time is up (after at least one plan that fits) and the
plan is marked ``status="feasible"`` with ``bound`` the least lower bound of what was not explored. Same inputs
give the same plan: every loop runs in a fixed order and ties break on the structure's sort key.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from costmodel.errors import AutoparError, ConfigError, InfeasiblePlanError
from planner.search import space as sp
from planner.search.cuts import even_split, propose_cuts, propose_interleaved_cuts

log = logging.getLogger(__name__)

Estimator = Callable[..., Any]
Progress = Callable[[str, int, int, float], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    structure: sp.Structure
    knobs: sp.Knobs
    estimate: Any
    stage_layers: tuple[int, ...]
    uneven: bool = False
    """The cuts came from the stage DP (otherwise the even split)."""

    @property
    def step_time_s(self) -> float:
        return float(self.estimate.step_time_s)

    @property
    def fits(self) -> bool:
        return bool(self.estimate.fits)

    def key(self) -> tuple:
        return (self.step_time_s, self.structure, self.knobs, self.uneven, self.stage_layers)

    def summary(self) -> str:
        cut = " cuts=" + "/".join(map(str, self.stage_layers)) if self.uneven else ""
        return f"{self.structure.summary()} {self.knobs.summary()}{cut}"


@dataclass(kw_only=True, slots=True)
class SearchResult:
    best: Candidate
    alternatives: list[Candidate]
    status: str
    bound_s: float
    candidates_explored: int
    evaluations: int
    refined: int = 0
    time_per_phase_s: dict[str, float] = field(default_factory=dict)


def make_config(structure: sp.Structure, knobs: sp.Knobs, *, global_batch: int, config_type: Any = None):
    """The step model's ``ParallelConfig`` (or ``config_type``, same fields) for a structure and knobs."""
    if config_type is None:
        from costmodel.step import ParallelConfig as config_type

    s = structure
    return config_type(
        tp=s.tp, pp=s.pp, dp=s.dp, cp=s.cp, ep=s.ep, microbatch=s.microbatch, global_batch=global_batch,
        schedule=s.schedule, virtual_stages=s.virtual_stages, recompute=knobs.recompute,
        sequence_parallel=knobs.sequence_parallel, zero_stage=knobs.zero_stage,
    )


@dataclass(kw_only=True, slots=True)
class _Ctx:
    workload: Any
    cluster: Any
    global_batch: int
    estimate: Estimator
    options: sp.SearchOptions
    fix: dict[str, Any]
    deadline: float | None
    progress: Progress | None
    config_type: Any = None
    evaluations: int = 0
    least_infeasible_gb: float = math.inf
    cache: dict = field(default_factory=dict)
    group_time_s: dict = field(default_factory=dict)

    def price(self, structure: sp.Structure, knobs: sp.Knobs, stage_layers=None) -> Any | None:
        key = (structure, knobs, stage_layers)
        if key in self.cache:
            return self.cache[key]
        self.evaluations += 1
        cfg = make_config(structure, knobs, global_batch=self.global_batch, config_type=self.config_type)
        try:
            est = self.estimate(self.workload, cfg, self.cluster, stage_layers=stage_layers)
        except ConfigError as e:  # the step model refuses what the space let through: skip, but say so
            log.debug("skip %s %s: %s", structure.summary(), knobs.summary(), e)
            est = None
        if est is not None and not est.fits:
            self.least_infeasible_gb = min(self.least_infeasible_gb, float(est.memory_gb_per_device))
        self.cache[key] = est
        return est

    @property
    def memory_limit_gb(self) -> float:
        """The least device memory of the cluster (the error messages' figure)."""
        return min(g.node.gpu.memory_bytes for g in self.cluster.groups) / 1e9

    @property
    def largest_memory_gb(self) -> float:
        """The largest device memory: what a pruning bound may compare with (on a heterogeneous cluster the
        stages on the larger devices can take more layers)."""
        return max(g.node.gpu.memory_bytes for g in self.cluster.groups) / 1e9

    def states_lower_bound_gb(self, structure: sp.Structure, zero_stage: int) -> float:
        """Weights + gradients + optimizer state of the average pipeline rank (the fullest holds at least that)
        plus the allocator reserve on them: a lower bound on the step model's memory per device."""
        from costmodel.memory import memory_estimate, model_state_bytes

        s, w = structure, self.workload
        dense = sum(l.params - l.expert_params for l in w.layers) / (s.tp * s.pp)
        expert = sum(l.expert_params for l in w.layers) / (s.tp * s.ep * s.pp)
        terms = model_state_bytes(params=dense, zero_stage=zero_stage, dp=s.dp * s.cp)
        if expert:
            ex = model_state_bytes(params=expert, zero_stage=zero_stage, dp=max(1, s.dp // s.ep) * s.cp)
            terms = {k: terms[k] + ex[k] for k in terms}
        return memory_estimate(terms).total_gb

    def layer_time_sum_s(self, structure: sp.Structure, knobs: sp.Knobs) -> tuple[float, float | None] | None:
        """Forward + backward seconds of one micro-batch through all layers (summed over pipeline ranks) for
        the structure's (tp, cp, ep, micro-batch) and the knobs' recomputation / sequence parallelism. The step
        model's layer times do not depend on pp, dp, the schedule or the cuts (tests check this), so one
        estimate per group serves every structure in it.

        Returns ``(T, None)``, or on a heterogeneous cluster, whose ranks run at different speeds (and where
        which ranks share a group depends on pp, so pp joins the key), ``(T, least)``: ``T`` as if the layers
        were spread over the ranks in proportion to their speeds, ``least`` as if all ran at the fastest
        rank's speed (``space.pipeline_lower_bound_s``)."""
        s = structure
        group = (s.tp, s.cp, s.ep, s.microbatch, knobs.recompute, knobs.sequence_parallel)
        hetero = len(self.cluster.groups) > 1
        group += (s.pp,) if hetero else ()
        if group not in self.group_time_s:
            cuts = self.even_cuts(s)
            est = self.price(s, knobs, cuts)
            if est is None:
                self.group_time_s[group] = None
            elif hetero:
                self.group_time_s[group] = _speed_weighted_sums(self.workload, self.cluster, est, cuts, s.pp)
            else:
                self.group_time_s[group] = (float(sum(est.stage_time_s)), None)
        return self.group_time_s[group]

    def even_cuts(self, structure: sp.Structure) -> tuple[int, ...] | None:
        """Explicit even cuts, so that the plan's stages are exactly the ones priced."""
        return even_split([l.kind for l in self.workload.layers], structure.pp * structure.virtual_stages)

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


def _speed_weighted_sums(workload: Any, cluster: Any, est: Any, cuts: Sequence[int],
                         pp: int) -> tuple[float, float | None]:
    """``(T, least)`` of ``layer_time_sum_s`` from one estimate of a heterogeneous cluster: each rank's speed
    (FLOPs per second at the even cut) and the work of all ranks.

    An accelerator's speed is the fastest of its ranks that hold neither the embedding nor the head (their
    memory-bound time would understate it). One whose ranks all hold one of them (the first or the last rank)
    takes the larger of its own reading and any other rank's scaled by the ratio of dense peaks: an upper
    bound when the step model's faster device gains at most its peak ratio, as it does, so the bound stays
    below what any cut reaches."""
    times = [float(t) for t in est.stage_time_s]
    devices = tuple(getattr(est, "stage_device", ()) or ())
    peak = {g.node.gpu.name: g.node.gpu.tflops("bf16") for g in cluster.groups}
    if len(set(devices)) <= 1 or len(times) != pp or not set(devices) <= set(peak) or min(times) <= 0:
        return float(sum(times)), None
    owner = [c % pp for c, n in enumerate(cuts) for _ in range(n)]
    work = [0.0] * pp
    for layer, r in zip(workload.layers, owner):
        work[r] += float(layer.flops_fwd + layer.flops_bwd)
    measured = [work[r] / times[r] for r in range(pp)]
    speed: dict[str, float] = {}
    for d in set(devices):
        clean = [measured[r] for r in range(1, pp - 1) if devices[r] == d]
        if clean:
            speed[d] = max(clean)
        else:
            speed[d] = max(measured[r] * peak[d] / peak[devices[r]] for r in range(pp))
    total = sum(work)
    return pp * total / sum(speed[d] for d in devices), total / max(speed.values())


def _level_bound_s(ctx: _Ctx, structure: sp.Structure, knobs: Sequence[sp.Knobs], level: str) -> float:
    """Lower bound on the step time of ``structure`` with recomputation ``level`` (any zero stage, any cuts)."""
    sums = []
    for sp_on in sorted({k.sequence_parallel for k in knobs if k.recompute == level}):
        probe = next(k for k in knobs if k.recompute == level and k.sequence_parallel == sp_on)
        t = ctx.layer_time_sum_s(structure, probe)
        if t is not None:
            sums.append(t)
    if not sums:
        return math.inf
    return min(sp.pipeline_lower_bound_s(structure, layer_time_sum_s=t, least_sum_s=least) for t, least in sums)


def structure_bound_s(ctx: _Ctx, structure: sp.Structure) -> float:
    """The best lower bound on any plan of ``structure``: its fastest recomputation level's pipeline bound."""
    knobs = sp.knob_choices(structure, options=ctx.options, fix=ctx.fix)
    levels = [r for r in sp.RECOMPUTE_ORDER if any(k.recompute == r for k in knobs)]
    if not knobs or ctx.even_cuts(structure) is None:
        return math.inf
    return _level_bound_s(ctx, structure, knobs, levels[0])


def _best_knobs(
    ctx: _Ctx, structure: sp.Structure, cuts: tuple[int, ...] | None = None, *, uneven: bool = False,
    best_s: float = math.inf,
) -> tuple[Candidate | None, list[Candidate]]:
    """Fastest fitting knobs by dominance. Recomputation only adds time, so once (r, zero, sp) fits,
    (r', zero, sp) with r' recomputing more cannot be faster and is not priced; a recomputation level whose
    pipeline bound reaches ``best_s`` is not priced at all; a ZeRO stage whose model states alone exceed the
    device memory is skipped. Returns the best fitting candidate (or None) and everything priced."""
    knobs = sp.knob_choices(structure, options=ctx.options, fix=ctx.fix)
    cuts = cuts if cuts is not None else ctx.even_cuts(structure)
    if not knobs or cuts is None:
        return None, []
    tried: list[Candidate] = []
    fitted: set[tuple[int, bool]] = set()
    exhaustive = ctx.options.exhaustive_knobs

    def run(k: sp.Knobs) -> Any | None:
        est = ctx.price(structure, k, cuts)
        if est is not None:
            tried.append(Candidate(structure=structure, knobs=k, estimate=est, stage_layers=cuts, uneven=uneven))
        return est

    levels = [r for r in sp.RECOMPUTE_ORDER if any(k.recompute == r for k in knobs)]
    for n, level in enumerate(levels):
        if n > 0 and _level_bound_s(ctx, structure, knobs, level) >= best_s:
            break  # recomputing more cannot beat the best plan found: it only adds time
        for k in knobs:
            if k.recompute != level or ((k.zero_stage, k.sequence_parallel) in fitted and not exhaustive):
                continue
            states_gb = ctx.states_lower_bound_gb(structure, k.zero_stage)
            if not exhaustive and states_gb > ctx.largest_memory_gb:
                ctx.least_infeasible_gb = min(ctx.least_infeasible_gb, states_gb)
                continue  # the model states alone overflow the device, whatever is recomputed
            est = run(k)
            if est is not None and est.fits:
                fitted.add((k.zero_stage, k.sequence_parallel))
    fits = [c for c in tried if c.fits]
    return (min(fits, key=Candidate.key) if fits else None), tried


def _ideal_step_s(workload: Any, cluster: Any, global_batch: int) -> float:
    flops = (workload.flops_fwd_per_seq + workload.flops_bwd_per_seq) * global_batch
    peak = sum(g.node.gpu.tflops("bf16") * 1e12 * g.node.gpus_per_node * g.count for g in cluster.groups)
    return flops / peak


def _screen(ctx: _Ctx, structures: list[sp.Structure], bounds: dict[sp.Structure, float]):
    """Branch and bound over structures sorted by lower bound, even cuts. Returns the best candidate, the
    best candidate per structure, the leanest non-fitting candidate per structure (for the stage DP, whose
    cuts may make it fit), the count explored, status and the bound of what was left."""
    best: Candidate | None = None
    fitting: list[Candidate] = []
    misses: list[Candidate] = []
    explored, status, bound = 0, "optimal", math.inf
    for n, s in enumerate(structures):
        if best is not None and bounds[s] >= best.step_time_s:
            break  # sorted by bound: nothing later can win
        if best is not None and ctx.expired():
            status, bound = "feasible", bounds[s]
            break
        cand, tried = _best_knobs(ctx, s, best_s=best.step_time_s if best else math.inf)
        explored += 1
        if cand is not None:
            fitting.append(cand)
            if best is None or cand.key() < best.key():
                best = cand
        elif tried:
            misses.append(min(tried, key=lambda c: (c.estimate.memory_gb_per_device, c.key())))
        if ctx.progress and n % 64 == 0:
            ctx.progress("screen", n + 1, len(structures), best.step_time_s if best else math.nan)
    if ctx.progress:
        ctx.progress("screen", len(structures), len(structures), best.step_time_s if best else math.nan)
    return best, fitting, misses, explored, status, bound


def _inflight(schedule: str, pp: int, m: int, v: int = 1) -> list[float]:
    from costmodel.pipeline import inflight_array

    return [float(x) for x in inflight_array(schedule, pp=pp, num_microbatches=m, virtual_stages=v)]


def _stage_dp(ctx: _Ctx, ranked: list[Candidate], misses: list[Candidate],
              bounds: Mapping[sp.Structure, float]) -> tuple[list[Candidate], int, bool]:
    """Uneven cuts for the best pipelined candidates (and for near misses that uneven cuts may make fit):
    every cut when there are at most ``exhaustive_cuts`` of them, else the stage DP's cut; each cut then gets
    its own best knobs. Returns the new candidates, the number of structures refined and whether all were."""
    if not ctx.options.uneven_stages or not (ranked or misses):
        return [], 0, True
    best_s = ranked[0].step_time_s if ranked else math.inf
    limit = best_s * (1 + ctx.options.dp_margin)
    pool = sorted([c for c in ranked + misses if c.structure.pp > 1 and c.step_time_s <= limit
                   and bounds[c.structure] < best_s], key=Candidate.key)
    out, runs = [], 0
    todo = pool[: ctx.options.dp_top_k]
    for c in todo:
        if ctx.expired() and (ranked or out):
            return out, runs, False
        runs += 1
        for cuts in _cut_proposals(ctx, c):
            if cuts == c.stage_layers:
                continue
            cand, _ = _best_knobs(ctx, c.structure, cuts, uneven=True, best_s=best_s)
            if cand is not None:
                out.append(cand)
                best_s = min(best_s, cand.step_time_s)
    return out, runs, True


def _cut_proposals(ctx: _Ctx, c: Candidate) -> list[tuple[int, ...]]:
    s = c.structure
    chunks, n = s.pp * s.virtual_stages, len(ctx.workload.layers)
    if math.comb(n - 1, chunks - 1) <= ctx.options.exhaustive_cuts:
        return [tuple(b - a for a, b in zip((0, *inner), (*inner, n)))
                for inner in itertools.combinations(range(1, n), chunks - 1)]
    price = lambda cuts: _price_or_raise(ctx, s, c.knobs, cuts)  # noqa: E731
    inflight = _inflight(s.schedule, s.pp, s.num_microbatches, s.virtual_stages)
    if s.schedule in ("gpipe", "1f1b"):
        proposal = propose_cuts(layers=ctx.workload.layers, pp=s.pp, num_microbatches=s.num_microbatches,
                                inflight=inflight, memory_limit_gb=ctx.memory_limit_gb, price=price)
    else:
        proposal = propose_interleaved_cuts(
            layers=ctx.workload.layers, pp=s.pp, virtual_stages=s.virtual_stages,
            num_microbatches=s.num_microbatches, schedule=s.schedule, inflight=inflight,
            memory_limit_gb=ctx.memory_limit_gb, price=price)
    return [] if proposal is None else [proposal.stage_layers]


def _price_or_raise(ctx: _Ctx, s: sp.Structure, k: sp.Knobs, cuts: tuple[int, ...]):
    est = ctx.price(s, k, cuts)
    if est is None:
        raise ConfigError(f"the step model refused cuts {cuts}")
    return est


def search(
    *,
    workload: Any,
    cluster: Any,
    global_batch: int,
    estimate: Estimator | None = None,
    options: sp.SearchOptions | None = None,
    fix: Mapping[str, Any] | str | None = None,
    time_limit_s: float | None = None,
    progress: Progress | None = None,
    config_type: Any = None,
) -> SearchResult:
    """The best configuration for ``workload`` on ``cluster`` under the step model ``estimate``
    (``costmodel.step.estimate_step`` by default; tests pass stand-ins with their own ``config_type``)."""
    if estimate is None:
        from costmodel.step import estimate_step as estimate
    options = options or sp.SearchOptions()
    fixed = sp.parse_fix(fix)
    if workload.experts and "recompute" not in fixed and set(options.recompute) - {"selective"}:
        # the runtime's selective checkpointing fails on MoE routers (an in-place op on a saved tensor)
        options = replace(options, recompute=tuple(r for r in options.recompute if r != "selective"))
    t0 = time.perf_counter()
    deadline = None if time_limit_s is None else t0 + max(0.0, float(time_limit_s))
    ctx = _Ctx(workload=workload, cluster=cluster, global_batch=int(global_batch), estimate=estimate,
               options=options, fix=fixed, deadline=deadline, progress=progress, config_type=config_type)
    dims = sp.ModelDimsLite(heads=workload.heads, kv_heads=workload.kv_heads, layers=workload.num_layers,
                            seq=workload.seq, experts=workload.experts)
    structures = sp.enumerate_structures(dims=dims, num_devices=cluster.num_devices,
                                         gpus_per_node=min(g.node.gpus_per_node for g in cluster.groups),
                                         global_batch=int(global_batch), options=options, fix=fixed,
                                         group_devices=tuple(g.node.gpus_per_node * g.count for g in cluster.groups))
    if not structures:
        raise _no_structure_error(ctx, dims)
    ideal = _ideal_step_s(workload, cluster, global_batch)
    bounds = {}
    for s in structures:  # with the time up, the cheap bound alone (still valid) keeps the search anytime
        cheap = sp.step_time_lower_bound_s(s, ideal_step_s=ideal)
        bounds[s] = cheap if ctx.expired() else max(cheap, structure_bound_s(ctx, s))
    structures.sort(key=lambda s: (bounds[s], s))
    t1 = time.perf_counter()
    best, fitting, misses, explored, status, bound = _screen(ctx, structures, bounds)
    t2 = time.perf_counter()
    ranked = sorted(fitting, key=Candidate.key)
    improved, dp_runs, dp_complete = _stage_dp(ctx, ranked, misses, bounds)
    t3 = time.perf_counter()
    pool = sorted(ranked + improved, key=Candidate.key)
    if not pool:
        raise _infeasible_error(ctx, workload, cluster)
    best = pool[0]
    if status == "optimal":
        bound = best.step_time_s
    if not dp_complete:  # cut off while refining: those structures' bounds are all that is known
        status = "feasible"
        bound = min([bound] + [bounds[c.structure] for c in ranked + misses])
    alternatives = _alternatives(pool, best, options.num_alternatives)
    return SearchResult(
        best=best, alternatives=alternatives, status=status, bound_s=min(bound, best.step_time_s),
        candidates_explored=explored, evaluations=ctx.evaluations, refined=dp_runs,
        time_per_phase_s={"enumerate": t1 - t0, "screen": t2 - t1, "stage_dp": t3 - t2},
    )


def _alternatives(pool: Sequence[Candidate], best: Candidate, n: int) -> list[Candidate]:
    """The next-best distinct structures (one entry per structure: its best knobs and cuts)."""
    seen = {best.structure}
    out = []
    for c in pool:
        if c.structure in seen:
            continue
        seen.add(c.structure)
        out.append(c)
        if len(out) == n:
            break
    return out


def _no_structure_error(ctx: _Ctx, dims: sp.ModelDimsLite) -> AutoparError:
    n = ctx.cluster.num_devices
    dps = sp.valid_dps(dims=dims, num_devices=n, gpus_per_node=ctx.cluster.gpus_per_node, options=ctx.options,
                       fix=ctx.fix)
    if dps:
        near = sp.nearest_valid_batches(global_batch=ctx.global_batch, dps=dps)
        what = f" with --fix {ctx.fix}" if ctx.fix else ""
        return ConfigError(
            f"global_batch={ctx.global_batch} is not divisible by any data-parallel degree that {n} devices "
            f"allow{what} (dp in {dps}); nearest valid global batches: {near}"
        )
    gpn = min(g.node.gpus_per_node for g in ctx.cluster.groups)
    tps = sp.tp_choices(dims, gpus_per_node=gpn)
    return ConfigError(
        f"no parallel configuration of {n} devices matches the model (heads={dims.heads}, "
        f"kv_heads={dims.kv_heads}, layers={dims.layers}) and --fix {ctx.fix}: tp must be one of {tps} "
        f"(a power of two dividing heads and kv heads, within a node of {gpn}), tp*cp*pp must divide {n} and "
        f"pp <= {dims.layers}; relax --fix"
    )


def _infeasible_error(ctx: _Ctx, workload: Any, cluster: Any) -> InfeasiblePlanError:
    need = ctx.least_infeasible_gb
    have = ctx.memory_limit_gb
    n = cluster.num_devices
    if not math.isfinite(need):
        return InfeasiblePlanError(
            f"the step model accepted no configuration of {workload.name} on {n} devices"
            + (f" with --fix {ctx.fix}: relax --fix" if ctx.fix else "")
        )
    more = int(math.ceil(n * need / have)) if have > 0 else 0
    tried = "ZeRO-3, full recompute, sequence parallel where executable and micro-batch 1 included" if not ctx.fix else \
        f"within --fix {ctx.fix}"
    return InfeasiblePlanError(
        f"{workload.name} ({workload.params / 1e9:.1f}B parameters) fits in no configuration on {n} x "
        f"{have:.0f} GB devices ({tried}): the leanest needs at least {need:.1f} GB per device. To fit: "
        f"roughly {more} or more devices (model states shard over ZeRO-3's data-parallel ranks), devices with "
        f">= {math.ceil(need)} GB, a shorter sequence or a smaller micro-batch"
        + ("; or relax --fix" if ctx.fix else ""),
        memory_gb_needed=float(need),
    )


# --- the public entry -------------------------------------------------------------------------------------


def plan_model(
    model: Any,
    cluster: Any,
    *,
    global_batch: int,
    seq: int | None = None,
    time_limit_s: float | None = None,
    fix: Mapping[str, Any] | str | None = None,
    options: sp.SearchOptions | None = None,
    progress: Progress | None = None,
    record_timings: bool = True,
):
    """Plan ``model`` (a spec string, or a ``(Workload, ModelInfo)`` pair) on ``cluster``: a ``Plan``.

    ``time_limit_s`` bounds the search (anytime: the best plan so far, ``solver.status == "feasible"``);
    ``fix`` pins any choice (``{"tp": 8, "pp": 4}`` or ``"tp=8,pp=4"``). ``record_timings=False`` leaves the
    wall-clock phase times out of the plan, so that equal inputs give byte-identical plan files.
    """
    from planner.search import model_input
    from planner.search.assemble import build_plan

    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ConfigError(f"global_batch={global_batch!r} must be a positive integer")
    if time_limit_s is not None and not time_limit_s >= 0:
        raise ConfigError(f"time_limit_s={time_limit_s!r} must be >= 0 seconds (or None for no limit)")
    t0 = time.perf_counter()
    loaded = model_input.load(model, seq=seq, global_batch=global_batch)
    t_trace = time.perf_counter() - t0
    sp_tps = model_input.sequence_parallel_tps(loaded, cluster=cluster, max_tp=int(cluster.gpus_per_node))
    if sp_tps is not None:
        options = replace(options or sp.SearchOptions(), sequence_parallel_tps=sp_tps)
    result = search(workload=loaded.workload, cluster=cluster, global_batch=global_batch, options=options,
                    fix=fix, time_limit_s=None if time_limit_s is None else max(0.0, time_limit_s - t_trace),
                    progress=progress)
    t1 = time.perf_counter()
    shardings, intra_stats = model_input.shardings_for(loaded, result.best, cluster=cluster,
                                                       global_batch=global_batch)
    t_intra = time.perf_counter() - t1
    phases = {"trace": t_trace, **result.time_per_phase_s, "intra_op": t_intra}
    log.info("planned %s: %s, %.4f s/step (%s)", loaded.model_info.name, result.best.summary(),
             result.best.step_time_s, result.status)
    plan = build_plan(model_info=loaded.model_info, workload=loaded.workload, cluster=cluster, result=result,
                      global_batch=global_batch, shardings=shardings, time_per_phase_s=phases,
                      record_timings=record_timings, module_groups=loaded.module_groups, intra_op=intra_stats)
    return plan
