"""Uneven pipeline cuts for one configuration: per-layer cost arrays read off the step model, then a DP.

The step model (``costmodel.step.estimate_step``) prices whole pipeline ranks; the DPs need per-layer arrays.
They are read off the step model itself with a few probes of the same configuration (no second cost model):

- probe A: an even split of the transformer layers (embedding in the first chunk, LM head in the last);
- one probe per accelerator the ranks run on (``stage_device``; one on a homogeneous cluster): A with one
  transformer layer moved between adjacent chunks, into (or out of) a rank of that accelerator.

A moved layer's time is the difference of its rank's time between the probes: per accelerator, seconds per
FLOP (``unit_s``), so on a heterogeneous cluster an H100 rank prices a layer faster than an A100 rank. What a
rank holds whatever the cut (the embedding on the first, the head on the last, overheads) is its residual at
probe A. Memory per pipeline rank follows ``M_r = c_r + sum_{i in r} (w_i + inflight_r * a_i)``: the two rank
deltas of the probe give ``w`` and ``a`` (one equation each, ``inflight`` differing between ranks), limits are
each rank's own device memory.

- GPipe / 1F1B (v = 1): the contiguous stage DP (``stage_dp``), per-stage layer times and limits.
- Interleaved 1F1B and zero-bubble: the layer-count DP (``interleaved_dp``), exact for identical transformer
  layers under the step model's closed forms.

Either result is priced by the step model again, so any term the arrays miss (data-parallel gradient traffic
that follows the stage's parameters, the optimizer) is judged by the model, not assumed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from costmodel.errors import AutoparError
from planner.search.interleaved_dp import CountProblem, solve_counts
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
    """Entries per chunk for ``per[c]`` transformer layers in chunk ``c``: other entries stay with the layer
    before them (the leading ones in chunk 0, the trailing ones in the last chunk, which may hold no layer)."""
    counts, c, have = [0] * len(per), 0, 0
    last = max((i for i, k in enumerate(kinds) if k == "transformer"), default=-1)
    for i, k in enumerate(kinds):
        if k == "transformer":
            while have >= per[c] and c < len(per) - 1:
                c, have = c + 1, 0
            have += 1
        elif i > last:
            c = len(per) - 1
        counts[c] += 1
    return tuple(counts)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearCosts:
    """The step model near the even cut, per layer and per pipeline rank (read off the probes).

    Rank ``r`` with layers ``S`` takes ``rank_s[r] + unit_s[r] * sum_{i in S} work[i]`` seconds per micro-batch
    and ``rank_gb[r] + sum_{i in S} (static_gb[i] + inflight[r] * act_gb[i])`` GB. The entries before the first
    transformer layer (embedding) and after the last (final norm, head) always sit on the first and last rank:
    their work is 0 here and their cost is in that rank's ``rank_s`` / ``rank_gb``."""

    work: np.ndarray
    """(L,) forward + backward FLOPs of each entry (0 for the leading and trailing entries)."""
    unit_s: np.ndarray
    """(pp,) seconds per FLOP on each rank (its node group's accelerator)."""
    rank_s: np.ndarray
    static_gb: np.ndarray
    act_gb: np.ndarray
    rank_gb: np.ndarray
    limit_gb: np.ndarray
    """(pp,) device memory of each rank."""


def _probe_moves(kinds: Sequence[str], cuts: Sequence[int]) -> list[tuple[int, int]]:
    """(source chunk, adjacent target chunk) pairs where moving one transformer layer keeps both chunks
    holding at least one: the last entry of the source moves forward, or its first entry moves back."""
    out, start = [], 0
    for c, n in enumerate(cuts):
        seg = kinds[start : start + n]
        if sum(k == "transformer" for k in seg) >= 2:
            if c + 1 < len(cuts) and seg[-1] == "transformer":
                out.append((c, c + 1))
            if c > 0 and seg[0] == "transformer":
                out.append((c, c - 1))
        start += n
    return out


def _moved(cuts: Sequence[int], src: int, dst: int) -> tuple[tuple[int, ...], int]:
    """The cut after the move, and the index of the entry moved."""
    after = list(cuts)
    after[src] -= 1
    after[dst] += 1
    moved = sum(cuts[: src + 1]) - 1 if dst > src else sum(cuts[:src])
    return tuple(after), moved


def read_costs(
    *, layers: Sequence[Any], pp: int, virtual_stages: int, inflight: Sequence[float], memory_limit_gb: float,
    price: Callable[[tuple[int, ...]], Any],
) -> tuple[LinearCosts, Any] | None:
    """``LinearCosts`` from the step model at the even cut (probe A) and one probe per accelerator that a rank
    runs on (``stage_device`` of the estimate): a layer moved into a rank of that kind, its time there is the
    rank's time difference. Memory per layer from the same probe (two ranks, two in-flight counts). Also
    returns probe A's estimate. None when the cuts cannot be probed or the step model is not linear there."""
    kinds = [l.kind for l in layers]
    chunks = pp * virtual_stages
    cuts_a = even_split(kinds, chunks)
    moves = _probe_moves(kinds, cuts_a) if cuts_a is not None and pp >= 2 else []
    if not moves:
        return None
    est_a = price(tuple(cuts_a))
    ta, ma = np.asarray(est_a.stage_time_s, float), np.asarray(est_a.stage_memory_gb, float)
    if ta.size != pp or ma.size != pp:
        return None
    devices = tuple(getattr(est_a, "stage_device", ()) or ()) or ("",) * pp
    limits = np.asarray(getattr(est_a, "stage_memory_limit_gb", ()) or (memory_limit_gb,) * pp, float)
    work = np.array([float(l.flops_fwd + l.flops_bwd) for l in layers])
    tr = [i for i, k in enumerate(kinds) if k == "transformer"]
    work[: tr[0]] = 0.0
    work[tr[-1] + 1 :] = 0.0
    unit: dict[str, float] = {}
    mem_probe = None
    mid = (chunks - 1) / 2
    while len(unit) < len(set(devices)):
        todo = [m for m in moves if {devices[m[0] % pp], devices[m[1] % pp]} - set(unit)
                and m[0] % pp != m[1] % pp]
        if not todo:
            return None
        src, dst = min(todo, key=lambda m: (-len({devices[m[0] % pp], devices[m[1] % pp]} - set(unit)),
                                            abs((m[0] + m[1]) / 2 - mid), m))
        cuts_b, moved = _moved(cuts_a, src, dst)
        est_b = price(cuts_b)
        tb, mb = np.asarray(est_b.stage_time_s, float), np.asarray(est_b.stage_memory_gb, float)
        rs, rd = src % pp, dst % pp
        unit.setdefault(devices[rd], (tb[rd] - ta[rd]) / max(work[moved], 1e-30))
        unit.setdefault(devices[rs], (ta[rs] - tb[rs]) / max(work[moved], 1e-30))
        if mem_probe is None:
            mem_probe = (rs, rd, ma[rs] - mb[rs], mb[rd] - ma[rd], moved)
    return _fit(layers, kinds, cuts_a, pp, inflight, ta, ma, work, np.array([unit[d] for d in devices]),
                mem_probe, limits), est_a


def _fit(layers, kinds, cuts_a, pp, inflight, ta, ma, work, unit_s, mem_probe, limits) -> LinearCosts | None:
    rs, rd, d_src, d_dst, moved = mem_probe  # d = w + inflight * a of the moved layer on either rank
    is_tr = np.array([k == "transformer" for k in kinds])
    a = (d_src - d_dst) / (inflight[rs] - inflight[rd]) if abs(inflight[rs] - inflight[rd]) > 1e-9 else 0.0
    params = np.array([float(l.params) for l in layers])
    static = np.where(is_tr, params / max(params[moved], 1.0) * (d_dst - inflight[rd] * a), 0.0)
    act = np.where(is_tr, a, 0.0)
    owner = np.repeat(np.arange(len(cuts_a)) % pp, cuts_a)  # the rank of each entry under the even cut
    rank_s = ta - unit_s * np.bincount(owner, weights=work, minlength=pp)
    per_entry_gb = static + np.asarray(inflight, float)[owner] * act
    rank_gb = ma - np.bincount(owner, weights=per_entry_gb, minlength=pp)
    scale = float(np.abs(ta).max()) or 1.0
    if not (np.all(np.isfinite(unit_s)) and np.all(unit_s >= 0) and np.all(rank_s > -1e-9 * scale)):
        return None
    return LinearCosts(work=work, unit_s=unit_s, rank_s=rank_s.clip(min=0.0), static_gb=static, act_gb=act,
                       rank_gb=rank_gb, limit_gb=limits)


def _probed(**kw: Any) -> tuple | None:
    """``read_costs(**kw)``, or None when the probes fail or give no per-layer costs (logged at debug)."""
    try:
        read = read_costs(**kw)
    except AutoparError as e:
        log.debug("probe failed: %s", e)
        return None
    return None if read is None or read[0] is None else read


def propose_cuts(
    *,
    layers: Sequence[Any],
    pp: int,
    num_microbatches: int,
    inflight: Sequence[float],
    memory_limit_gb: float,
    price: Callable[[tuple[int, ...]], Any],
) -> CutProposal | None:
    """Stage-DP cuts for a v = 1 GPipe / 1F1B pipeline; ``price(stage_layers)`` runs the step model. Each stage
    has its own layer times (its rank's accelerator), memory limit and fixed part. None if not derivable."""
    read = _probed(layers=layers, pp=pp, virtual_stages=1, inflight=inflight, memory_limit_gb=memory_limit_gb,
                   price=price)
    if read is None:
        return None
    lc = read[0]
    problem = make_problem(layer_time_s=lc.unit_s[:, None] * lc.work[None, :], layer_static_bytes=lc.static_gb,
                           layer_act_bytes=lc.act_gb, num_stages=pp, num_microbatches=num_microbatches,
                           inflight=inflight, memory_limit_bytes=lc.limit_gb, stage_overhead_s=lc.rank_s,
                           stage_overhead_bytes=lc.rank_gb)
    try:
        sol = solve_stages(problem)
    except AutoparError:
        return None
    return CutProposal(stage_layers=sol.stage_layers, dp_objective_s=sol.objective_s, dp_runs=sol.dp_runs)


def propose_interleaved_cuts(
    *,
    layers: Sequence[Any],
    pp: int,
    virtual_stages: int,
    num_microbatches: int,
    schedule: str,
    inflight: Sequence[float],
    memory_limit_gb: float,
    price: Callable[[tuple[int, ...]], Any],
) -> CutProposal | None:
    """Cuts for interleaved 1F1B (chunk ``c`` on rank ``c % pp``) and zero-bubble pipelines: the layer-count DP
    of ``interleaved_dp`` on the probed costs (``read_costs``), transformer layers taken as identical (their
    mean). Zero-bubble's bubble weight is read off probe A's ``bubble`` time. None if not derivable."""
    read = _probed(layers=layers, pp=pp, virtual_stages=virtual_stages, inflight=inflight,
                   memory_limit_gb=memory_limit_gb, price=price)
    if read is None:
        return None
    lc, est_a = read
    kinds = [l.kind for l in layers]
    problem = _count_problem(lc, kinds, pp=pp, v=virtual_stages, m=num_microbatches, schedule=schedule,
                             inflight=inflight, est_a=est_a)
    try:
        sol = solve_counts(problem)
    except AutoparError:
        return None
    return CutProposal(stage_layers=_split_by_positions(kinds, sol.chunk_layers), dp_objective_s=sol.objective_s,
                       dp_runs=sol.dp_runs)


def _count_problem(lc: LinearCosts, kinds: Sequence[str], *, pp: int, v: int, m: int, schedule: str,
                   inflight: Sequence[float], est_a: Any) -> CountProblem:
    is_tr = np.array([k == "transformer" for k in kinds])
    n = int(is_tr.sum())
    layer_work = float(lc.work[is_tr].mean())
    chunk_s = np.zeros(pp * v)
    chunk_s[0], chunk_s[-1] = lc.rank_s[0], lc.rank_s[-1]  # the embedding's chunk, the head's chunk
    for r in range(1, pp - 1):  # a middle rank's fixed time (about 0) spread over its chunks
        chunk_s[r::pp] += lc.rank_s[r] / v
    weight = np.ones(pp)
    weight[-1] = 0.0  # the last rank's largest chunk adds no fill / drain (costmodel.pipeline)
    if schedule == "zero-bubble":
        weight *= _bubble_share(lc, kinds, pp=pp, v=v, est_a=est_a)
    lows = [1] * (pp * v)
    lows[0] = 0 if not is_tr[0] else 1  # the embedding's chunk may hold nothing else
    lows[-1] = 0 if not is_tr[-1] else 1  # nor the head's
    return CountProblem(
        num_layers=n, virtual_stages=v, layer_time_s=tuple((lc.unit_s * layer_work).tolist()),
        min_per_chunk=tuple(lows),
        chunk_time_s=tuple(chunk_s.tolist()), pace=float(m), bubble_weight=tuple(weight.tolist()),
        rank_bytes=tuple(lc.rank_gb.tolist()),
        layer_bytes=tuple((float(lc.static_gb[is_tr].mean()) + np.asarray(inflight, float) * float(
            lc.act_gb[is_tr].mean())).tolist()),
        memory_limit_bytes=tuple(lc.limit_gb.tolist()),
    )


def _bubble_share(lc: LinearCosts, kinds: Sequence[str], *, pp: int, v: int, est_a: Any) -> float:
    """Zero-bubble: the bubble of probe A over its ranks' largest chunks (but the last rank's), clipped to
    [0, 1]; the W work hides part of each hop (``costmodel.pipeline``: ``max(F + B - W, F, B)``)."""
    bubble = float(dict(getattr(est_a, "breakdown_s", {}) or {}).get("bubble", math.nan))
    cuts = even_split(kinds, pp * v)
    bounds = np.concatenate(([0], np.cumsum(cuts)))
    chunk = np.array([lc.unit_s[c % pp] * lc.work[bounds[c] : bounds[c + 1]].sum() for c in range(pp * v)])
    chunk[0] += lc.rank_s[0]
    largest = chunk.reshape(v, pp).max(axis=0)[:-1].sum()
    if not math.isfinite(bubble) or largest <= 0:
        return 1.0
    return min(1.0, max(0.0, bubble / largest))
