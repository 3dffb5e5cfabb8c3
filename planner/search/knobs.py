"""The knobs of one structure and cut: ZeRO stage, sequence parallelism, recomputation and how many layers of each
pipeline chunk it covers (Megatron's ``--recompute-num-layers``, torchtitan's per-layer checkpointing).

For each (ZeRO stage, sequence parallel) of ``space.knob_choices``, in order:

1. skip it when the cut's lower bound with that sequence parallelism reaches the best step time found (nothing
   it prices can win), or when the model states alone overflow the largest device;
2. price no recomputation; if it fits, stop: recomputation only adds time;
3. else, for each recomputation mode, price it on every layer; if that fits, find per pipeline rank the fewest
   layers recomputed that fit: a rank's memory falls with its own count only, so one estimate per step checks
   every rank at once (linear interpolation between the two estimates, then bisection). A rank's count is
   spread over its chunks so that its largest chunk grows least. Fewer recomputed layers never take longer.

``tests/test_search.py`` checks these properties of ``costmodel.step`` and compares the result with every
recompute count.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from costmodel.step_config import recomputable_per_chunk
from planner.search import space as sp


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    structure: sp.Structure
    knobs: sp.Knobs
    estimate: Any
    stage_layers: tuple[int, ...]
    uneven: bool = False
    """The cuts are not the even split."""

    @property
    def step_time_s(self) -> float:
        return float(self.estimate.step_time_s)

    @property
    def fits(self) -> bool:
        return bool(self.estimate.fits)

    def key(self) -> tuple:
        return (self.step_time_s, self.structure, self.knobs.sort_key(), self.uneven, self.stage_layers)

    def summary(self) -> str:
        cut = " cuts=" + "/".join(map(str, self.stage_layers)) if self.uneven else ""
        return f"{self.structure.summary()} {self.knobs.summary()}{cut}"


def make_config(structure: sp.Structure, knobs: sp.Knobs, *, global_batch: int, config_type: Any = None):
    """The step model's ``ParallelConfig`` (or ``config_type``, same fields) for a structure and knobs."""
    if config_type is None:
        from costmodel.step import ParallelConfig as config_type

    s = structure
    extra = {} if knobs.recompute_layers is None else {"recompute_layers": knobs.recompute_layers}
    return config_type(
        tp=s.tp, pp=s.pp, dp=s.dp, cp=s.cp, ep=s.ep, microbatch=s.microbatch, global_batch=global_batch,
        schedule=s.schedule, virtual_stages=s.virtual_stages, recompute=knobs.recompute,
        sequence_parallel=knobs.sequence_parallel, zero_stage=knobs.zero_stage, **extra,
    )


def best_knobs(
    ctx: Any, structure: sp.Structure, cuts: tuple[int, ...], *, best_s: float,
    bound_s: Mapping[bool, float], uneven: bool = False,
) -> tuple[Candidate | None, list[Candidate]]:
    """The fastest fitting knobs of ``structure`` at ``cuts`` (see the module docstring) and every candidate priced.

    ``bound_s[sp]``: a lower bound on this cut's step time with sequence parallelism ``sp``, any other knobs."""
    knobs = ctx.knob_choices(structure)  # space.knob_choices under the search's options and fix
    exhaustive = ctx.options.exhaustive_knobs
    tried: list[Candidate] = []

    def run(k: sp.Knobs) -> Any | None:
        est = ctx.price(structure, k, cuts)
        if est is not None:
            tried.append(Candidate(structure=structure, knobs=k, estimate=est, stage_layers=cuts, uneven=uneven))
        return est

    pairs = list(dict.fromkeys((k.zero_stage, k.sequence_parallel) for k in knobs))
    modes = [r for r in sp.RECOMPUTE_ORDER if any(k.recompute == r for k in knobs)]
    search_counts = "recompute" not in ctx.fix
    for zero, spar in pairs:
        if not exhaustive and bound_s.get(spar, -math.inf) >= best_s:
            continue  # nothing this sequence parallelism prices at this cut can win
        states_gb = ctx.states_lower_bound_gb(structure, zero)
        if not exhaustive and states_gb > ctx.largest_memory_gb:
            ctx.note_infeasible(states_gb)
            continue  # the model states alone overflow the device, whatever is recomputed
        plain = None
        for mode in modes:
            k = sp.Knobs(recompute=mode, zero_stage=zero, sequence_parallel=spar)
            est = run(k)
            if est is None:
                continue
            if mode == "none":
                plain = est
                if not exhaustive and (est.fits or est.step_time_s >= best_s):
                    break  # fits: recomputing only adds time; too slow already: so is any recomputation
                continue
            if est.fits and plain is not None and search_counts:
                fewer = _least_counts(ctx, structure, k, cuts, plain, est)
                if fewer is not None and fewer != k:
                    run(fewer)
    fits = [c for c in tried if c.fits]
    return (min(fits, key=Candidate.key) if fits else None), tried


def _least_counts(ctx: Any, s: sp.Structure, k: sp.Knobs, cuts: tuple[int, ...], plain: Any,
                  full: Any) -> sp.Knobs | None:
    """``k`` with the fewest recomputed layers per rank that fit (``plain``: nothing recomputed, does not fit;
    ``full``: every layer, fits); None when an estimate fails or gives no per-rank memory."""
    pp = s.pp
    rec = recomputable_per_chunk(ctx.workload, cuts)
    have = [sum(rec[r::pp]) for r in range(pp)]
    limit = _limits(ctx, plain, pp)
    m0, m1 = _per_rank(plain.stage_memory_gb, pp), _per_rank(full.stage_memory_gb, pp)
    t0, t1 = _per_rank(plain.stage_time_s, pp), _per_rank(full.stage_time_s, pp)
    if None in (m0, m1, t0, t1):
        return None
    unit = [t0[r] / have[r] if have[r] else 0.0 for r in range(pp)]
    extra = [(t1[r] - t0[r]) / have[r] if have[r] else 0.0 for r in range(pp)]
    lo = [0] * pp  # known not to fit (0 also when the rank fits without recomputation)
    hi = [0 if m0[r] <= limit[r] else have[r] for r in range(pp)]  # known to fit
    trial = []
    for r in range(pp):  # first guess: the two estimates' straight line (a full-recompute buffer makes it high)
        slope = (m0[r] - m1[r]) / have[r] if have[r] else 0.0
        guess = math.ceil((m0[r] - limit[r]) / slope - 1e-9) if slope > 0 else hi[r]
        trial.append(min(hi[r], max(1, guess)) if hi[r] else 0)
    step = 0
    while any(hi[r] - lo[r] > 1 for r in range(pp)) and step < 64:
        est = ctx.price(s, replace(k, recompute_layers=spread(rec, trial, unit, extra, pp)), cuts)
        mem = None if est is None else _per_rank(est.stage_memory_gb, pp)
        if mem is None:
            return None
        for r in range(pp):
            if hi[r] - lo[r] > 1:
                if mem[r] <= limit[r]:
                    hi[r] = trial[r]
                else:
                    lo[r] = trial[r]
        step += 1
        for r in range(pp):  # next: beside the guess first (it is usually right or one off), then bisection
            if hi[r] - lo[r] <= 1:
                trial[r] = hi[r]
            elif step == 1:
                trial[r] = hi[r] - 1 if trial[r] == hi[r] else lo[r] + 1
            else:
                trial[r] = (lo[r] + hi[r]) // 2
    if hi == have:
        return k
    return replace(k, recompute_layers=spread(rec, hi, unit, extra, pp))


def _per_rank(values: Sequence[float], pp: int) -> list[float] | None:
    vals = [float(x) for x in values]
    return vals if len(vals) == pp else None


def _limits(ctx: Any, est: Any, pp: int) -> list[float]:
    lim = [float(x) for x in (getattr(est, "stage_memory_limit_gb", ()) or ())]
    return lim if len(lim) == pp else [ctx.memory_limit_gb] * pp


def spread(rec: Sequence[int], per_rank: Sequence[int], unit_s: Sequence[float], extra_s: Sequence[float],
           pp: int) -> tuple[int, ...]:
    """Recomputed layers per chunk: rank ``r``'s ``per_rank[r]`` go one at a time to the chunk of the rank that is
    shortest after taking it (``rec[c]`` recomputable layers of ``unit_s[r]`` each, ``extra_s[r]`` per recomputed
    one), so the rank's largest chunk grows least."""
    out = [0] * len(rec)
    for r in range(pp):
        if len(rec) == pp:  # one chunk per rank
            out[r] = per_rank[r]
            continue
        heap = [(rec[c] * unit_s[r] + extra_s[r], c) for c in range(r, len(rec), pp) if rec[c] > 0]
        heapq.heapify(heap)
        for _ in range(per_rank[r]):
            t, c = heapq.heappop(heap)
            out[c] += 1
            if out[c] < rec[c]:
                heapq.heappush(heap, (t + extra_s[r], c))
    return tuple(out)
