"""The knobs of one structure and cut: ZeRO stage, sequence parallelism, recomputation.

For each (ZeRO stage, sequence parallel) of ``space.knob_choices``, in order:

1. skip it when the cut's lower bound with that sequence parallelism reaches the best step time found (nothing
   it prices can win), or when the model states alone overflow the largest device;
2. price the recomputation modes in order (none, selective, full); stop at the first that fits, or that is
   already slower than the best step time: recomputing more only adds time.

``tests/test_search.py`` checks these properties of ``costmodel.step``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

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
    return config_type(
        tp=s.tp, pp=s.pp, dp=s.dp, cp=s.cp, ep=s.ep, microbatch=s.microbatch, global_batch=global_batch,
        schedule=s.schedule, virtual_stages=s.virtual_stages, recompute=knobs.recompute,
        sequence_parallel=knobs.sequence_parallel, zero_stage=knobs.zero_stage,
    )


def best_knobs(
    ctx: Any, structure: sp.Structure, cuts: tuple[int, ...], *, best_s: float,
    bound_s: Mapping[bool, float], uneven: bool = False,
) -> tuple[Candidate | None, list[Candidate]]:
    """The fastest fitting knobs of ``structure`` at ``cuts`` (see the module docstring) and every candidate priced.

    ``bound_s[sp]``: a lower bound on this cut's step time with sequence parallelism ``sp``, any other knobs."""
    knobs = sp.knob_choices(structure, options=ctx.options, fix=ctx.fix)
    exhaustive = ctx.options.exhaustive_knobs
    tried: list[Candidate] = []

    def run(k: sp.Knobs) -> Any | None:
        est = ctx.price(structure, k, cuts)
        if est is not None:
            tried.append(Candidate(structure=structure, knobs=k, estimate=est, stage_layers=cuts, uneven=uneven))
        return est

    pairs = list(dict.fromkeys((k.zero_stage, k.sequence_parallel) for k in knobs))
    modes = [r for r in sp.RECOMPUTE_ORDER if any(k.recompute == r for k in knobs)]
    for zero, spar in pairs:
        if not exhaustive and bound_s.get(spar, -math.inf) >= best_s:
            continue  # nothing this sequence parallelism prices at this cut can win
        states_gb = ctx.states_lower_bound_gb(structure, zero)
        if not exhaustive and states_gb > ctx.largest_memory_gb:
            ctx.note_infeasible(states_gb)
            continue  # the model states alone overflow the device, whatever is recomputed
        for mode in modes:
            k = sp.Knobs(recompute=mode, zero_stage=zero, sequence_parallel=spar)
            est = run(k)
            if est is None:
                continue
            if not exhaustive and (est.fits or est.step_time_s >= best_s):
                break  # fits: recomputing more only adds time; too slow already: so is any recomputation
    fits = [c for c in tried if c.fits]
    return (min(fits, key=Candidate.key) if fits else None), tried
