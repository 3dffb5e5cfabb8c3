"""The planner's search: bound every structure, explore them in bound order, search the cuts that could win.

Phases (each timed in ``SearchResult.time_per_phase_s``):

1. ``enumerate``: ``space.enumerate_structures`` lists every structure (tp, cp, ep, pp, dp, every micro-batch
   size dividing ``global_batch / dp``, schedule, up to ``layers / pp`` virtual stages), each with the
   perfect-compute bound ``space.step_time_lower_bound_s``.
2. ``explore``: branch and bound, the least bound first. A structure reached with its cheap bound gets the
   tight one, valid for every cut, knob and recompute count (``bounds.structure_bound_s`` on the layer costs
   read off one estimate per (tp, cp, ep, micro-batch, sequence parallel) group, per pp too on a heterogeneous
   cluster) and goes back in line; reached with it, it is priced with even cuts and its best knobs
   (``knobs.best_knobs``: ZeRO, sequence parallel, recomputation and its per-chunk layer counts), until the least
   bound left reaches the best step time found: nothing left can win (pruned).
3. ``cuts``: every explored pipeline whose bound is below the best step time: every cut whose own bound is
   below it (``bounds.rank_counts_below``) is priced with its own knobs, best bound first; the best step time
   falls as cuts win, which prunes the rest. With more than ``cut_vectors_limit`` count vectors to look at, or
   transformer layers that differ (and more than ``exhaustive_cuts`` cuts), the DPs of ``cuts`` propose a cut
   and the structure stays open.

``bound_s`` is the least of the best step time and the bounds of the open structures (cut by a DP only, or not
reached before ``time_limit_s``); ``status`` is ``"optimal"`` when none is open, else ``"feasible"``, and
``proven`` says which space was covered. The bounds rest on properties of the step model that
``tests/test_search.py`` checks on ``costmodel.step``: a rank's time is the sum of its entries' times (so one
estimate gives per-layer costs), recomputation and ZeRO only add time, the rest of a step is not negative.
Same inputs give the same plan: every loop runs in a fixed order and ties break on the structure's sort key.
"""

from __future__ import annotations

import functools
import gc
import heapq
import itertools
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from costmodel.errors import AutoparError, ConfigError, InfeasiblePlanError, UnsupportedModelError
from planner.search import bounds as bd
from planner.search import space as sp
from planner.search.cuts import even_split, propose_cuts, propose_interleaved_cuts
from planner.search.knobs import Candidate, best_knobs, make_config

__all__ = ["Candidate", "SearchResult", "make_config", "plan_model", "search"]

log = logging.getLogger(__name__)

Estimator = Callable[..., Any]
Progress = Callable[[str, int, int, float], None]


@dataclass(kw_only=True, slots=True)
class SearchResult:
    best: Candidate
    alternatives: list[Candidate]
    status: str
    bound_s: float
    candidates_explored: int
    """Structures priced (the others were pruned by their bound or not reached)."""
    evaluations: int
    refined: int = 0
    """Pipelines whose uneven cuts were searched."""
    proven: str = ""
    """Which space ``bound_s`` and ``status`` cover, in words."""
    time_per_phase_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Group:
    costs: bd.RankCosts | None
    total_s: float | None
    """Summed rank times of the probe (the same for every cut on a homogeneous cluster)."""


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
    refuse: Callable[[Any], Sequence[str]] | None = None
    """Why the execution target cannot run a configuration (empty: it can); refused ones are never priced."""
    bound_estimate: Estimator | None = None
    """The estimate the bounds' probes read layer costs from (``estimate`` when None): every rank in its fastest
    dtype regime (``costmodel.step.estimate_step(autocast=False)``), so a bound read off a ZeRO-0 probe holds
    for every ZeRO stage."""
    precision: str = "bf16"
    layout: bd.Layout | None = None
    ideal_s: float = 0.0
    evaluations: int = 0
    least_infeasible_gb: float = math.inf
    refused: dict = field(default_factory=dict)
    """Refusal message -> how often the execution target gave it first for a proposed configuration (for the
    error when it refuses every one)."""
    cache: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)
    probes: dict = field(default_factory=dict)
    """Group key -> the structure whose estimate reads the group's costs (its largest pp)."""
    states_gb: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict)
    """Answers that depend on the search's immutable inputs only (knob choices, even cuts, rank costs, least
    maxima), keyed by what they are of."""

    def config(self, structure: sp.Structure, knobs: sp.Knobs) -> Any:
        cfg = make_config(structure, knobs, global_batch=self.global_batch, config_type=self.config_type)
        return cfg if self.precision == "bf16" else replace(cfg, precision=self.precision)

    def price(self, structure: sp.Structure, knobs: sp.Knobs, stage_layers=None, *, runnable: bool = True
              ) -> Any | None:
        """The step model's estimate, None when it or the execution target refuses the configuration;
        ``runnable=False`` prices what the target may not run, with ``bound_estimate`` (the bounds' probes:
        layer costs do not depend on the knobs or schedule a target refuses)."""
        cfg = self.config(structure, knobs)
        why = self.refuse(cfg) if runnable and self.refuse is not None else ()
        if why:
            log.debug("skip %s %s: the execution target cannot run it", structure.summary(), knobs.summary())
            self.refused[why[0]] = self.refused.get(why[0], 0) + 1
            return None
        key = (structure, knobs, stage_layers, runnable)
        if key in self.cache:
            return self.cache[key]
        self.evaluations += 1
        estimate = self.estimate if runnable else (self.bound_estimate or self.estimate)
        try:
            est = estimate(self.workload, cfg, self.cluster, stage_layers=stage_layers)
        except ConfigError as e:  # the step model refuses what the space let through: skip, but say so
            log.debug("skip %s %s: %s", structure.summary(), knobs.summary(), e)
            est = None
        if est is not None and not est.fits:
            self.note_infeasible(float(est.memory_gb_per_device))
        self.cache[key] = est
        return est

    def note_infeasible(self, gb: float) -> None:
        self.least_infeasible_gb = min(self.least_infeasible_gb, gb)

    @property
    def hetero(self) -> bool:
        return len(self.cluster.groups) > 1

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
        plus the allocator reserve on them: a lower bound on the step model's memory per device, any cut."""
        from costmodel.memory import memory_estimate, model_state_bytes

        key = (structure.tp, structure.cp, structure.ep, structure.pp, structure.dp, zero_stage)
        if key not in self.states_gb:
            self.states_gb[key] = self._states_gb(structure, zero_stage, memory_estimate, model_state_bytes)
        return self.states_gb[key]

    def _states_gb(self, structure, zero_stage, memory_estimate, model_state_bytes) -> float:
        s, w = structure, self.workload
        dense = sum(l.params - l.expert_params for l in w.layers) / (s.tp * s.pp)
        expert = sum(l.expert_params for l in w.layers) / (s.tp * s.ep * s.pp)
        terms = model_state_bytes(params=dense, zero_stage=zero_stage, dp=s.dp * s.cp)
        if expert:
            ex = model_state_bytes(params=expert, zero_stage=zero_stage, dp=max(1, s.dp // s.ep) * s.cp)
            terms = {k: terms[k] + ex[k] for k in terms}
        return memory_estimate(terms).total_gb

    def even_cuts(self, structure: sp.Structure) -> tuple[int, ...] | None:
        """Explicit even cuts, so that the plan's stages are exactly the ones priced (memoized per chunk count)."""
        key = ("even", structure.pp * structure.virtual_stages)
        if key not in self.memo:
            self.memo[key] = even_split([l.kind for l in self.workload.layers], key[1])
        return self.memo[key]

    def knob_choices(self, structure: sp.Structure) -> list[sp.Knobs]:
        """``space.knob_choices`` under this search's options and fix (memoized per structure; not to be
        changed)."""
        key = ("knobs", structure)
        if key not in self.memo:
            self.memo[key] = sp.knob_choices(structure, options=self.options, fix=self.fix)
        return self.memo[key]

    def sp_choices(self, structure: sp.Structure) -> list[bool]:
        key = ("sp", structure)
        if key not in self.memo:
            self.memo[key] = sorted({k.sequence_parallel for k in self.knob_choices(structure)})
        return self.memo[key]

    def group_key(self, s: sp.Structure, spar: bool) -> tuple:
        return (s.tp, s.cp, s.ep, s.microbatch, spar) + ((s.pp,) if self.hetero else ())

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


# --- bounds ------------------------------------------------------------------------------------------------


def _group(ctx: _Ctx, s: sp.Structure, spar: bool) -> _Group:
    """The layer costs of ``s``'s group, read off one estimate (no recomputation, ZeRO-0) of its probe."""
    key = ctx.group_key(s, spar)
    if key not in ctx.groups:
        probe = ctx.probes.get(key, s)
        knobs = sp.Knobs(sequence_parallel=spar)
        cuts = ctx.even_cuts(probe)
        est = ctx.price(probe, knobs, cuts, runnable=False) if cuts is not None else None
        if est is None:
            ctx.groups[key] = _Group(None, None)
        else:
            costs = None
            if ctx.layout is not None:
                costs = bd.read_rank_costs(layout=ctx.layout, stage_layers=cuts, estimate=est, pp=probe.pp,
                                           price=lambda c: ctx.price(probe, knobs, c, runnable=False))
            cut_free = not ctx.hetero or probe.pp == 1  # the summed rank times are the same for every cut
            ctx.groups[key] = _Group(costs, float(sum(est.stage_time_s)) if cut_free else None)
    return ctx.groups[key]


def _costs(ctx: _Ctx, s: sp.Structure, spar: bool) -> bd.RankCosts | None:
    g = _group(ctx, s, spar)
    if g.costs is None or ctx.hetero:
        return g.costs  # a heterogeneous cluster's groups are per pp
    key = ("costs", ctx.group_key(s, spar), s.pp)  # the group's costs are set once: one per pp
    if key not in ctx.memo:
        ctx.memo[key] = replace(g.costs, layer_s=(g.costs.layer_s[0],) * s.pp)
    return ctx.memo[key]


def _structure_bound(ctx: _Ctx, costs: bd.RankCosts, s: sp.Structure) -> float:
    """``bounds.structure_bound_s`` with its ``least_max`` memoized per rank costs (by identity: ``_costs`` keeps
    one per group and pp) and least counts."""
    lows = tuple(bd.rank_lows(costs.layout, costs.pp, s.virtual_stages))
    key = ("least_max", id(costs), lows)
    if key not in ctx.memo:
        ctx.memo[key] = (costs, bd.least_max(costs, lows))
    return bd.structure_bound_from(costs, ctx.memo[key][1], schedule=s.schedule, v=s.virtual_stages,
                                   m=s.num_microbatches)


def _sp_bounds(ctx: _Ctx, s: sp.Structure, cuts: tuple[int, ...] | None = None) -> dict[bool, float]:
    """Per sequence-parallel choice, a lower bound on ``s`` at ``cuts`` (None: over every cut)."""
    cheap = sp.step_time_lower_bound_s(s, ideal_step_s=ctx.ideal_s)
    m, v = s.num_microbatches, s.virtual_stages
    out = {}
    for spar in ctx.sp_choices(s):
        costs, total = _costs(ctx, s, spar), _group(ctx, s, spar).total_s
        if costs is not None and cuts is not None:
            b = bd.cut_bound_s(costs, bd.transformer_counts(ctx.layout, cuts), schedule=s.schedule, v=v, m=m)
        elif costs is not None:
            b = _structure_bound(ctx, costs, s)
        elif total is not None:
            b = m * total if s.pp == 1 else sp.pipeline_lower_bound_s(s, layer_time_sum_s=total)
        else:
            b = -math.inf
        out[spar] = max(cheap, b)
    return out


def _may_fit(ctx: _Ctx, s: sp.Structure) -> bool:
    """Some knobs of ``s`` pass the model-state memory bound (with ``exhaustive_knobs`` every structure)."""
    knobs = ctx.knob_choices(s)
    return bool(knobs) and (ctx.options.exhaustive_knobs or any(
        ctx.states_lower_bound_gb(s, z) <= ctx.largest_memory_gb for z in {k.zero_stage for k in knobs}))


def _probes(ctx: _Ctx, structures: Sequence[sp.Structure]) -> None:
    """Per group, the structure with the most pipeline ranks (a middle rank reads a layer's time directly)."""
    for s in structures:
        for spar in ctx.sp_choices(s):
            key = ctx.group_key(s, spar)
            if key not in ctx.probes or s.pp > ctx.probes[key].pp:
                ctx.probes[key] = s


# --- explore and cut ---------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _State:
    best: Candidate | None = None
    per_structure: dict = field(default_factory=dict)
    """Structure -> its best fitting candidate, or its leanest priced one (none fits)."""
    explored: list = field(default_factory=list)
    open: dict = field(default_factory=dict)
    """Structure -> why it is not proven ("dp", "budget", "time", "even")."""
    promise: dict = field(default_factory=dict)
    """Structure -> its bound plus what the rest of the step (p2p, data parallel, optimizer) added at even cuts."""
    refined: int = 0

    @property
    def best_s(self) -> float:
        return self.best.step_time_s if self.best is not None else math.inf

    def offer(self, s: sp.Structure, cand: Candidate | None, tried: Sequence[Candidate]) -> None:
        mine = self.per_structure.get(s)
        if cand is not None:
            if mine is None or not mine.fits or cand.key() < mine.key():
                self.per_structure[s] = cand
            if self.best is None or cand.key() < self.best.key():
                self.best = cand
        elif tried and (mine is None or not mine.fits):
            lean = min(tried, key=lambda c: (c.estimate.memory_gb_per_device, c.key()))
            if mine is None or lean.estimate.memory_gb_per_device < mine.estimate.memory_gb_per_device:
                self.per_structure[s] = lean


def _explore(ctx: _Ctx, bounds: dict[sp.Structure, float], st: _State) -> None:
    """Branch and bound over structures in bound order, even cuts. ``bounds`` starts with the perfect-compute
    bound and is tightened (``_sp_bounds``: one estimate per group) only for the structures the loop reaches,
    so groups whose structures the cheap bound already prunes are never priced."""
    total = len(bounds)
    heap = [(b, 1, s) for s, b in bounds.items()]
    heapq.heapify(heap)
    while heap:
        b, loose, s = heapq.heappop(heap)
        if st.best is not None and b >= st.best_s:
            return  # every bound left is at least this one: nothing can win
        if st.best is not None and ctx.expired():
            for _, _, rest in [(b, loose, s)] + heap:
                st.open[rest] = "time"
            return
        if loose:
            bounds[s] = max(b, min(_sp_bounds(ctx, s).values()))
            heapq.heappush(heap, (bounds[s], 0, s))
            continue
        cuts = ctx.even_cuts(s)
        cut_bounds = _sp_bounds(ctx, s, cuts)
        cand, tried = best_knobs(ctx, s, cuts, best_s=st.best_s, bound_s=cut_bounds)
        if cand is not None:
            st.promise[s] = bounds[s] + cand.step_time_s - cut_bounds[cand.knobs.sequence_parallel]
        st.explored.append(s)
        st.offer(s, cand, tried)
        if ctx.progress:
            ctx.progress("explored", len(st.explored), total, st.best_s)


def _search_cuts(ctx: _Ctx, bounds: Mapping[sp.Structure, float], st: _State) -> None:
    """Uneven cuts for every explored pipeline whose bound is below the best step time, the most promising first
    (bound plus what the rest of the step added at the even cut), within ``cut_evaluations`` step-model calls."""
    todo = sorted((s for s in st.explored if s.pp > 1 and bounds[s] < st.best_s),
                  key=lambda s: (st.promise.get(s, bounds[s]), bounds[s], s))
    start = ctx.evaluations
    budget = ctx.options.cut_evaluations
    for n, s in enumerate(todo):
        if bounds[s] >= st.best_s:
            continue  # a cut of an earlier structure won: this one cannot
        if not ctx.options.uneven_stages:
            st.open[s] = "even"
        elif st.best is not None and (ctx.expired() or (budget is not None and ctx.evaluations - start >= budget)):
            st.open[s] = "time" if ctx.expired() else "budget"
        else:
            st.refined += 1
            left = None if budget is None else start + budget
            done = _all_cuts(ctx, s, st, left)
            if done == "dp":
                _dp_cuts(ctx, s, st)
            if done != "done":
                st.open[s] = done
            if ctx.progress:
                ctx.progress("cut search", n + 1, len(todo), st.best_s)


def _all_cuts(ctx: _Ctx, s: sp.Structure, st: _State, until: int | None) -> str:
    """Price every cut of ``s`` whose bound is below the best step time: "done", or why not ("dp": too many to
    list, or layers that differ; "budget" / "time": stopped before the end, at ``until`` evaluations)."""
    choices = ctx.sp_choices(s)
    costs = {spar: _costs(ctx, s, spar) for spar in choices}
    if ctx.layout is None or not all(costs.values()):
        return "done" if _every_position(ctx, s, st) else "dp"
    m, v, limit = s.num_microbatches, s.virtual_stages, ctx.options.cut_vectors_limit
    todo: dict[tuple[int, ...], float] = {}
    for spar, c in costs.items():
        found = bd.rank_counts_below(c, schedule=s.schedule, v=v, m=m, below_s=st.best_s, limit=limit)
        if found is None:
            return "dp"
        for b, counts in found:
            todo[counts] = min(todo.get(counts, math.inf), b)
    even = ctx.even_cuts(s)
    cheap = sp.step_time_lower_bound_s(s, ideal_step_s=ctx.ideal_s)
    for counts, b in sorted(todo.items(), key=lambda kv: (kv[1], kv[0])):
        if b >= st.best_s:
            break
        if st.best is not None and ctx.expired():
            return "time"
        if st.best is not None and until is not None and ctx.evaluations >= until:
            return "budget"
        cuts = bd.stage_layers_of(ctx.layout, counts)
        if cuts == even:
            continue
        bs = {spar: max(cheap, bd.cut_bound_s(c, counts, schedule=s.schedule, v=v, m=m)) for spar, c in costs.items()}
        st.offer(s, *best_knobs(ctx, s, cuts, best_s=st.best_s, bound_s=bs, uneven=True))
    return "done"


def _every_position(ctx: _Ctx, s: sp.Structure, st: _State) -> bool:
    """Layers that differ: every cut, when there are at most ``exhaustive_cuts``."""
    chunks, n = s.pp * s.virtual_stages, len(ctx.workload.layers)
    if math.comb(n - 1, chunks - 1) > ctx.options.exhaustive_cuts:
        return False
    bound = _sp_bounds(ctx, s)
    even = ctx.even_cuts(s)
    for inner in itertools.combinations(range(1, n), chunks - 1):
        cuts = tuple(b - a for a, b in zip((0, *inner), (*inner, n)))
        if cuts != even:
            st.offer(s, *best_knobs(ctx, s, cuts, best_s=st.best_s, bound_s=bound, uneven=True))
    return True


def _dp_cuts(ctx: _Ctx, s: sp.Structure, st: _State) -> None:
    """The DPs' cut for ``s`` (probed at its best knobs, every layer recomputed if it recomputes), priced."""
    seed = st.per_structure.get(s)
    if seed is None:
        return
    knobs = replace(seed.knobs, recompute_layers=None)
    price = lambda cuts: _price_or_raise(ctx, s, knobs, cuts)  # noqa: E731
    inflight = _inflight(s.schedule, s.pp, s.num_microbatches, s.virtual_stages)
    if s.schedule in ("gpipe", "1f1b"):
        proposal = propose_cuts(layers=ctx.workload.layers, pp=s.pp, num_microbatches=s.num_microbatches,
                                inflight=inflight, memory_limit_gb=ctx.memory_limit_gb, price=price)
    else:
        proposal = propose_interleaved_cuts(
            layers=ctx.workload.layers, pp=s.pp, virtual_stages=s.virtual_stages,
            num_microbatches=s.num_microbatches, schedule=s.schedule, inflight=inflight,
            memory_limit_gb=ctx.memory_limit_gb, price=price)
    if proposal is not None and proposal.stage_layers != ctx.even_cuts(s):
        cuts = proposal.stage_layers
        st.offer(s, *best_knobs(ctx, s, cuts, best_s=st.best_s, bound_s=_sp_bounds(ctx, s), uneven=True))


def _inflight(schedule: str, pp: int, m: int, v: int = 1) -> list[float]:
    from costmodel.pipeline import inflight_array

    return [float(x) for x in inflight_array(schedule, pp=pp, num_microbatches=m, virtual_stages=v)]


def _price_or_raise(ctx: _Ctx, s: sp.Structure, k: sp.Knobs, cuts: tuple[int, ...]):
    est = ctx.price(s, k, cuts)
    if est is None:
        raise ConfigError(f"the step model refused cuts {cuts}")
    return est


# --- the search --------------------------------------------------------------------------------------------


def _without_cycle_collection(fn: Callable) -> Callable:
    """``fn`` run with Python's cyclic garbage collector paused (as it was, after). The search's own code makes
    no reference cycles (every object it drops is freed by its reference count: ``tests/test_search.py`` checks
    it on an analytic workload); a traced workload's one-time autocast export (``planner.trace``, when the first
    autocast rank is priced) makes some, collected once the search returns (GPT-3 175B: peak RSS 555 MB with
    the pause, 550 MB without). Yet the
    objects it keeps (memos, estimates) trigger collections of the oldest generation, and each walks every
    object of the process (torch's and transformers' too): ~0.3 s apiece on the 2-core machine, three in the
    GPT-3 175B search on 1,024 A100s."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return run


@_without_cycle_collection
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
    refuse: Callable[[Any], Sequence[str]] | None = None,
    precision: str = "bf16",
    bound_estimate: Estimator | None = None,
) -> SearchResult:
    """The best configuration for ``workload`` on ``cluster`` under the step model ``estimate``
    (``costmodel.step.estimate_step`` by default; tests pass stand-ins with their own ``config_type``).
    ``time_limit_s`` bounds this search (anytime: it stops after a first plan that fits). ``refuse(config)``:
    why the execution target cannot run a configuration (``costmodel.targets.Target.refusals``): refused ones
    are never proposed. ``precision``: the GEMM precision every configuration is priced at. ``bound_estimate``:
    what the lower bounds' probes are priced with (``_Ctx.bound_estimate``; ``estimate`` when None, and
    ``estimate_step(autocast=False)`` with the default ``estimate``)."""
    if estimate is None:
        from costmodel.step import estimate_step as estimate

        bound_estimate = bound_estimate or functools.partial(estimate, autocast=False)
    options = options or sp.SearchOptions()
    fixed = sp.parse_fix(fix)
    if workload.experts and "recompute" not in fixed and set(options.recompute) - {"selective"}:
        # the runtime's selective checkpointing fails on MoE routers (an in-place op on a saved tensor)
        options = replace(options, recompute=tuple(r for r in options.recompute if r != "selective"))
    t0 = time.perf_counter()
    deadline = None if time_limit_s is None else t0 + max(0.0, float(time_limit_s))
    ctx = _Ctx(workload=workload, cluster=cluster, global_batch=int(global_batch), estimate=estimate,
               options=options, fix=fixed, deadline=deadline, progress=progress, config_type=config_type,
               refuse=refuse, precision=precision, layout=bd.layout_of(workload.layers), ideal_s=_ideal_step_s(workload, cluster, global_batch),
               bound_estimate=bound_estimate)
    dims = sp.ModelDimsLite(heads=workload.heads, kv_heads=workload.kv_heads, layers=workload.num_layers,
                            seq=workload.seq, experts=workload.experts)
    structures = sp.enumerate_structures(dims=dims, num_devices=cluster.num_devices,
                                         gpus_per_node=min(g.node.gpus_per_node for g in cluster.groups),
                                         global_batch=int(global_batch), options=options, fix=fixed,
                                         group_devices=tuple(g.node.gpus_per_node * g.count for g in cluster.groups))
    if not structures:
        raise _no_structure_error(ctx, dims)
    _probes(ctx, structures)
    bounds = {s: sp.step_time_lower_bound_s(s, ideal_step_s=ctx.ideal_s) if _may_fit(ctx, s) else math.inf
              for s in structures}  # inf: the model states alone overflow the device at every ZeRO stage allowed
    t1 = time.perf_counter()
    st = _State()
    _explore(ctx, bounds, st)
    if progress:
        progress("pruned by bound", len(bounds) - len(st.explored) - len(st.open), len(bounds), st.best_s)
    t2 = time.perf_counter()
    _search_cuts(ctx, bounds, st)
    t3 = time.perf_counter()
    pool = sorted((c for c in st.per_structure.values() if c.fits), key=Candidate.key)
    if not pool:
        raise _infeasible_error(ctx, workload, cluster)
    best = pool[0]
    open_bounds = [bounds[s] for s in st.open if bounds[s] < best.step_time_s]
    bound = min([best.step_time_s] + open_bounds)
    status = "optimal" if not open_bounds else "feasible"
    return SearchResult(
        best=best, alternatives=_alternatives(pool, best, options.num_alternatives), status=status,
        bound_s=bound, candidates_explored=len(st.explored), evaluations=ctx.evaluations, refined=st.refined,
        proven=_proven(len(structures), st, open_bounds, bounds, best),
        time_per_phase_s={"enumerate": t1 - t0, "explore": t2 - t1, "cuts": t3 - t2},
    )


def _proven(total: int, st: _State, open_bounds: list[float], bounds, best: Candidate) -> str:
    """What the bound covers, in words."""
    explored = set(st.explored)
    pruned = sum(1 for s, b in bounds.items() if s not in explored and (s not in st.open or b >= best.step_time_s))
    head = (f"{total} structures x knobs x recompute counts x cuts: {len(st.explored)} explored, {pruned} "
            f"pruned by bound, uneven cuts searched for {st.refined}")
    if not open_bounds:
        return f"optimal over the whole space ({head})"
    why = {"dp": "whose cuts a DP proposed (too many to list)", "time": "not reached before the time limit",
           "budget": "whose uneven cuts were not all priced (cut_evaluations spent)",
           "even": "with even cuts only (uneven_stages=False)"}
    parts = []
    for key, text in why.items():
        ss = [s for s, w in st.open.items() if w == key and bounds[s] < best.step_time_s]
        if ss:
            parts.append(f"{len(ss)} {text} (bound {min(bounds[s] for s in ss):.4g} s)")
    return f"proven over {total - len(open_bounds)} of {total} structures ({head}); open: " + "; ".join(parts)


def _ideal_step_s(workload: Any, cluster: Any, global_batch: int) -> float:
    flops = (workload.flops_fwd_per_seq + workload.flops_bwd_per_seq) * global_batch
    peak = sum(g.node.gpu.tflops("bf16") * 1e12 * g.node.gpus_per_node * g.count for g in cluster.groups)
    return flops / peak


def _alternatives(pool: Sequence[Candidate], best: Candidate, n: int) -> list[Candidate]:
    """The next-best distinct structures (one entry per structure: its best knobs and cuts)."""
    return [c for c in pool if c.structure != best.structure][:n]


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
        top = max(ctx.refused.items(), key=lambda kv: kv[1], default=None)
        why = "" if top is None else f"; the execution target refused what the search proposed, most often: {top[0]}"
        return InfeasiblePlanError(
            f"the step model accepted no configuration of {workload.name} on {n} devices"
            + (f" with --fix {ctx.fix}: relax --fix" if ctx.fix else "") + why
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
    example_inputs: Any = None,
    target: str = "autopar",
    precision: str = "bf16",
    compute_dtype: str | None = None,
):
    """Plan ``model`` (a spec string, an ``nn.Module`` with its ``example_inputs``, or a ``(Workload,
    ModelInfo)`` pair) on ``cluster``: a ``Plan``.

    ``time_limit_s`` bounds the search, which starts once the model is traced (anytime: the best plan so far,
    ``solver.status == "feasible"``; ``solver.time_per_phase_s["trace"]`` is the trace's time);
    ``fix`` pins any choice (``{"tp": 8, "pp": 4}`` or ``"tp=8,pp=4"``). ``record_timings=False`` leaves the
    wall-clock phase times out of the plan, so that equal inputs give byte-identical plan files.
    ``target``: the execution target (``costmodel.targets.load_target`` spec) whose constants price every
    candidate and whose refusals are never proposed. ``precision``: the GEMM precision, or ``"auto"``: each
    precision the target trains with on this cluster's accelerators is searched and the fastest plan kept.
    ``compute_dtype`` (``bf16`` / ``fp32``; None: the traced dtype): the dtype the run computes and communicates
    in (``planner.workload.workload_for_dtype``), so the block shardings are chosen, and the plan priced, for the
    bytes that run moves.
    """
    from costmodel.step import estimate_step
    from costmodel.targets import load_target

    spec = load_target(target)
    if precision != "auto":
        spec.check_precision(precision, cluster)
    plans = [_plan_one(model, cluster, global_batch=global_batch, seq=seq, time_limit_s=time_limit_s, fix=fix,
                       options=options, progress=progress, record_timings=record_timings, target=spec, precision=p,
                       estimate=functools.partial(estimate_step, target=spec),
                       bound_estimate=functools.partial(estimate_step, target=spec, autocast=False),
                       example_inputs=example_inputs,
                       compute_dtype=compute_dtype)
             for p in (spec.precisions_on(cluster) if precision == "auto" else (precision,))]
    return min(plans, key=lambda p: (not p.prediction.fits, p.prediction.step_time_s))


def _unpipelined(fix: Any, *, blocker: str, name: str) -> Any:
    """``fix`` with pp pinned to 1 when the traced blocks are no chain (``planner.graph.pipeline_blocker``): the
    runtime cannot cut such a model into pipeline stages. A fix asking for pp > 1 is refused naming why."""
    if not blocker:
        return fix
    fixed = sp.parse_fix(fix)
    if fixed.get("pp", 1) != 1:
        raise UnsupportedModelError(f"{name}: {blocker}; pipeline parallelism cannot run it: plan with --fix pp=1")
    log.info("%s: %s; planning with pp=1", name, blocker)
    return {**fixed, "pp": 1}


def _plan_one(model: Any, cluster: Any, *, global_batch: int, seq: int | None, time_limit_s: float | None, fix: Any,
              options: sp.SearchOptions | None, progress: Progress | None, record_timings: bool, target: Any,
              precision: str, estimate: Estimator, example_inputs: Any, compute_dtype: str | None = None,
              bound_estimate: Estimator | None = None):
    """``plan_model`` for one target and precision."""
    from planner.search import model_input
    from planner.search.assemble import build_plan

    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ConfigError(f"global_batch={global_batch!r} must be a positive integer")
    if time_limit_s is not None and not time_limit_s >= 0:
        raise ConfigError(f"time_limit_s={time_limit_s!r} must be >= 0 seconds (or None for no limit)")
    t0 = time.perf_counter()
    loaded = model_input.load(model, seq=seq, global_batch=global_batch, example_inputs=example_inputs)
    if compute_dtype is not None:
        from planner.workload import workload_for_dtype

        loaded = replace(loaded, workload=workload_for_dtype(loaded.workload, compute_dtype))
    t_trace = time.perf_counter() - t0
    sp_tps = model_input.sequence_parallel_tps(loaded, cluster=cluster, max_tp=int(cluster.gpus_per_node))
    if sp_tps is not None:
        options = replace(options or sp.SearchOptions(), sequence_parallel_tps=sp_tps)
    w = loaded.workload
    fix = _unpipelined(fix, blocker=str(w.meta.get("pipeline_blocker", "")), name=loaded.model_info.name)
    refuse = functools.partial(target.refusals, experts=w.experts, tied_embeddings=w.tied_embeddings, glu=w.glu)
    result = search(workload=w, cluster=cluster, global_batch=global_batch, options=options, estimate=estimate,
                    fix=fix, time_limit_s=time_limit_s, progress=progress, refuse=refuse, precision=precision,
                    bound_estimate=bound_estimate)
    t1 = time.perf_counter()
    best_config = replace(make_config(result.best.structure, result.best.knobs, global_batch=global_batch),
                          precision=precision)
    shardings, intra_stats = model_input.shardings_for(loaded, result.best, cluster=cluster, config=best_config,
                                                       target=target)
    t_intra = time.perf_counter() - t1
    phases = {"trace": t_trace, **result.time_per_phase_s, "intra_op": t_intra}
    log.info("planned %s: %s, %.4f s/step (%s; %s)", loaded.model_info.name, result.best.summary(),
             result.best.step_time_s, result.status, result.proven)
    plan = build_plan(model_info=loaded.model_info, workload=loaded.workload, cluster=cluster, result=result,
                      global_batch=global_batch, shardings=shardings, time_per_phase_s=phases,
                      record_timings=record_timings, module_groups=loaded.module_groups, intra_op=intra_stats)
    return replace(plan, precision=precision, target=target.spec)
