"""Uneven pipeline cuts for one configuration: per-layer cost arrays from the step model, then the stage DP.

The step model (``costmodel.step.estimate_step``) prices whole stages; the stage DP needs per-layer arrays.
They are read off the step model itself with two probes of the same configuration (no second cost model):

- probe A: an even split of the transformer layers (embedding in the first chunk, LM head in the last);
- probe B: A with one transformer layer moved from a middle chunk ``j`` to chunk ``j + 1``.

From the per-chunk stage times, ``t_layer = T_B[j+1] - T_A[j+1]`` (scaled per layer by its FLOPs when the
layers differ), the per-chunk overhead ``o`` is a middle chunk's time minus its layers, and the embedding and
head times are the first and last chunks' residuals. Memory per pipeline rank follows
``M_s = c + sum_{i in s} (w_i + inflight_s * a_i)``: the two rank deltas of the probe give ``w`` and ``a``
(one equation each, ``inflight`` differing between ranks), the first/last ranks' residuals are the embedding's
and head's. The DP result is then priced by the step model again, so any term the arrays miss (data-parallel
gradient traffic that follows the stage's parameters, the optimizer) is judged by the model, not assumed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from costmodel.errors import AutoparError
from planner.search.stage_dp import make_problem, solve_stages

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class CutProposal:
    stage_layers: tuple[int, ...]
    dp_objective_s: float
    dp_runs: int


def even_split(kinds: Sequence[str], num_chunks: int) -> tuple[int, ...] | None:
    """Transformer layers spread evenly over chunks (remainder to the middle ones); non-transformer entries
    before the first transformer go to chunk 0, those after the last to the last chunk."""
    idx = [i for i, k in enumerate(kinds) if k == "transformer"]
    n = len(idx)
    if n < num_chunks or num_chunks < 1:
        return None
    base, extra = divmod(n, num_chunks)
    per = [base] * num_chunks
    order = _middle_first(num_chunks)
    for k in range(extra):
        per[order[k]] += 1
    counts = list(per)
    counts[0] += idx[0]  # leading entries (embedding)
    counts[-1] += len(kinds) - 1 - idx[-1]  # trailing entries (final norm, head)
    inner_other = sum(1 for i in range(idx[0], idx[-1] + 1) if kinds[i] != "transformer")
    if inner_other:  # non-transformer entries between transformer layers: keep them with their neighbours
        return _split_by_positions(kinds, per)
    return tuple(counts)


def _middle_first(n: int) -> list[int]:
    mid = (n - 1) / 2
    return sorted(range(n), key=lambda c: (abs(c - mid), c))


def _split_by_positions(kinds: Sequence[str], per: Sequence[int]) -> tuple[int, ...]:
    counts, seen, c = [0] * len(per), 0, 0
    for k in kinds:
        counts[c] += 1
        if k == "transformer":
            seen += 1
            if seen == sum(per[: c + 1]) and c < len(per) - 1:
                c += 1
    return tuple(counts)


def _linear_arrays(
    *, layers: Sequence[Any], cuts_a: Sequence[int], cuts_b: Sequence[int], j: int, est_a: Any, est_b: Any,
    pp: int, inflight: Sequence[float],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float] | None:
    ta, tb = np.asarray(est_a.stage_time_s, float), np.asarray(est_b.stage_time_s, float)
    ma, mb = np.asarray(est_a.stage_memory_gb, float), np.asarray(est_b.stage_memory_gb, float)
    chunks = len(cuts_a)
    if ta.size != chunks or tb.size != chunks or ma.size != pp or mb.size != pp or chunks != pp:
        return None
    n = len(layers)
    work = np.array([float(l.flops_fwd + l.flops_bwd) for l in layers])
    params = np.array([float(l.params) for l in layers])
    is_tr = np.array([l.kind == "transformer" for l in layers])
    moved = int(np.cumsum(cuts_a)[j]) - 1  # the last layer of chunk j in A moves to chunk j+1 in B
    t_unit = (tb[j + 1] - ta[j + 1]) / max(work[moved], 1e-30)
    t_layer = np.where(is_tr, work * t_unit, 0.0)
    d_lo, d_hi = ma[j] - mb[j], mb[j + 1] - ma[j + 1]  # = w + I_j a, w + I_{j+1} a of the moved layer
    if abs(inflight[j + 1] - inflight[j]) > 1e-9:
        a = (d_lo - d_hi) / (inflight[j] - inflight[j + 1])
    else:
        a = 0.0
    w_moved = d_hi - inflight[j + 1] * a
    w = np.where(is_tr, params / max(params[moved], 1.0) * w_moved, 0.0)
    act = np.where(is_tr, a, 0.0)
    bounds = np.concatenate(([0], np.cumsum(cuts_a)))
    if chunks >= 3:
        mid = chunks // 2
        sl = slice(bounds[mid], bounds[mid + 1])
        o_t = float(ta[mid] - t_layer[sl].sum())
        o_m = float(ma[mid] - (w[sl] + inflight[mid] * act[sl]).sum())
    else:
        o_t = o_m = 0.0
    for c in (0, chunks - 1):  # residuals of the first / last chunk are the embedding's / head's
        sl = slice(bounds[c], bounds[c + 1])
        rest = [i for i in range(sl.start, sl.stop) if not is_tr[i]]
        if rest:
            t_layer[rest[0]] = ta[c] - o_t - t_layer[sl].sum()
            w[rest[0]] = ma[c] - o_m - (w[sl] + inflight[c] * act[sl]).sum()
    if np.any(t_layer < -1e-12) or not np.all(np.isfinite(t_layer)):
        return None
    return t_layer.clip(min=0.0), w, act, o_t, o_m


def propose_cuts(
    *,
    layers: Sequence[Any],
    pp: int,
    num_microbatches: int,
    inflight: Sequence[float],
    memory_limit_gb: float,
    price: Callable[[tuple[int, ...]], Any],
) -> CutProposal | None:
    """Stage-DP cuts for a v = 1 pipeline; ``price(stage_layers)`` runs the step model. None if not derivable."""
    kinds = [l.kind for l in layers]
    cuts_a = even_split(kinds, pp)
    if cuts_a is None or pp < 2:
        return None
    cands = [c for c in range(pp - 1) if _movable(kinds, cuts_a, c)]
    if not cands:
        return None
    j = min(cands, key=lambda c: (abs(c - (pp - 2) / 2), c))
    cuts_b = list(cuts_a)
    cuts_b[j] -= 1
    cuts_b[j + 1] += 1
    try:
        est_a, est_b = price(tuple(cuts_a)), price(tuple(cuts_b))
    except AutoparError as e:
        log.debug("probe failed: %s", e)
        return None
    arrays = _linear_arrays(layers=layers, cuts_a=cuts_a, cuts_b=cuts_b, j=j, est_a=est_a, est_b=est_b, pp=pp,
                            inflight=inflight)
    if arrays is None:
        return None
    t, w, act, o_t, o_m = arrays
    problem = make_problem(layer_time_s=t, layer_static_bytes=w, layer_act_bytes=act, num_stages=pp,
                           num_microbatches=num_microbatches, inflight=inflight, memory_limit_bytes=memory_limit_gb,
                           stage_overhead_s=o_t, stage_overhead_bytes=o_m)
    try:
        sol = solve_stages(problem)
    except AutoparError:
        return None
    return CutProposal(stage_layers=sol.stage_layers, dp_objective_s=sol.objective_s, dp_runs=sol.dp_runs)


def _movable(kinds: Sequence[str], cuts: Sequence[int], c: int) -> bool:
    """Chunk c's last entry is a transformer layer and c keeps at least one transformer layer without it."""
    start = sum(cuts[:c])
    seg = kinds[start : start + cuts[c]]
    return len(seg) >= 2 and seg[-1] == "transformer" and sum(k == "transformer" for k in seg) >= 2
