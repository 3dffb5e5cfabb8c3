"""Lower bounds on a structure's step time over every cut, knob and recompute count; the cuts that can beat a time.

The step model prices pipeline rank ``r`` (``stage_time_s[r]``: forward + backward of one micro-batch through its
chunks) as the sum of its entries' times, each at the rank's accelerator and layer context; recomputation and
ZeRO only add to it, and the rest of a step (p2p, data-parallel traffic, optimizer) is not negative
(``tests/test_search.py`` checks these of ``costmodel.step``). For a workload laid out as leading entries
(embedding), ``N`` identical transformer layers, trailing entries (head), one or two estimates read
``RankCosts``: ``u_r`` per layer on rank ``r``, ``E_0`` (leading entries, always on chunk 0 and so rank 0) and
``E_{p-1}`` (trailing entries, on the last chunk). With ``n_r`` layers on rank ``r``, ``P_r = E_r + n_r u_r`` and
the closed forms of ``costmodel.pipeline`` (``m`` micro-batches, ``v`` chunks per rank, ``t_c`` chunk times):

    GPipe / 1F1B   sum_r P_r + (m - 1) max_r P_r
    interleaved    m max_r P_r + sum_{r < p-1} max_{c on r} t_c   >=  m max P + (sum P - max P) / v
    zero-bubble    m max_r P_r + (its fill / drain, >= 0)

Minimising ``max_r P_r`` (``least_max``: layers added one at a time to the rank they lengthen least, from each
rank's least count) and ``sum_r P_r`` separately gives ``structure_bound_s``, valid for every cut. A chunk holds
at least one entry, so the embedding's or the head's chunk may hold no transformer layer. For given per-rank
counts the forms are exact with the rank's layers water-filled over its chunks (``chunk_counts``);
``rank_counts_below`` lists every count vector whose bound is below a step time (depth-first, each rank
capped by the largest ``P_r`` the bound allows), so the driver can price all cuts that could win.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

_TOL = 1e-9


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Workload entries as leading entries, ``layers`` identical transformer layers, trailing entries."""

    lead: int
    layers: int
    trail: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCosts:
    """Per-micro-batch seconds of the additive model for one layer context and ``pp`` ranks."""

    layer_s: tuple[float, ...]
    """``u_r``: one transformer layer on rank ``r``."""
    first_s: float
    """``E_0``: the leading entries (on rank 0)."""
    last_s: float
    """``E_{p-1}``: the trailing entries (on the last rank)."""
    layout: Layout

    @property
    def pp(self) -> int:
        return len(self.layer_s)

    def fixed_s(self, r: int) -> float:
        return (self.first_s if r == 0 else 0.0) + (self.last_s if r == self.pp - 1 else 0.0)


def layout_of(layers: Sequence[Any]) -> Layout | None:
    """The layout of a workload's entries, or None when its transformer layers are not contiguous and identical."""
    kinds = [l.kind for l in layers]
    idx = [i for i, k in enumerate(kinds) if k == "transformer"]
    if not idx or idx[-1] - idx[0] + 1 != len(idx):
        return None
    first = replace(layers[idx[0]], name="")
    if any(replace(layers[i], name="") != first for i in idx[1:]):
        return None
    return Layout(lead=idx[0], layers=len(idx), trail=len(kinds) - 1 - idx[-1])


def chunk_lows(layout: Layout, chunks: int) -> list[int]:
    """Least transformer layers per chunk: one, but none in a chunk that the embedding or the head fills."""
    lows = [1] * chunks
    if layout.lead:
        lows[0] = 0
    if layout.trail:
        lows[-1] = 0
    if chunks == 1:
        lows[0] = 0 if (layout.lead or layout.trail) else 1
    return lows


def rank_lows(layout: Layout, pp: int, v: int) -> list[int]:
    lows = chunk_lows(layout, pp * v)
    return [sum(lows[r::pp]) for r in range(pp)]


def stage_layers_of(layout: Layout, counts: Sequence[int]) -> tuple[int, ...]:
    """Entries per chunk for transformer layers per chunk (the leading entries on chunk 0, trailing on the last)."""
    out = list(counts)
    out[0] += layout.lead
    out[-1] += layout.trail
    return tuple(int(x) for x in out)


def transformer_counts(layout: Layout, stage_layers: Sequence[int]) -> list[int]:
    out = list(stage_layers)
    out[0] -= layout.lead
    out[-1] -= layout.trail
    return out


def read_rank_costs(
    *, layout: Layout, stage_layers: Sequence[int], estimate: Any, pp: int,
    price: Callable[[tuple[int, ...]], Any] | None = None,
) -> RankCosts | None:
    """``RankCosts`` from an estimate at ``stage_layers`` (and, when an accelerator has no rank between the first
    and the last, one more priced with a layer moved next to it). None when the estimate is not additive in
    identical layers (a rank's time does not match ``E_r + n_r u_r``) or ``pp == 1``."""
    times = [float(t) for t in estimate.stage_time_s]
    if pp < 2 or len(times) != pp:
        return None
    devices = tuple(getattr(estimate, "stage_device", ()) or ()) or ("",) * pp
    counts = transformer_counts(layout, stage_layers)
    per_rank = [sum(counts[r::pp]) for r in range(pp)]
    unit: dict[str, float] = {}
    for r in range(1, pp - 1):
        if per_rank[r] > 0:
            unit.setdefault(devices[r], times[r] / per_rank[r])
    missing = [d for d in (devices[0], devices[-1]) if d not in unit]
    if missing:
        moved = _probe(layout, counts, pp, devices, set(missing), times, price)
        if moved is None:
            return None
        unit.update(moved)
    u = tuple(unit[devices[r]] for r in range(pp))
    first = times[0] - per_rank[0] * u[0]
    last = times[-1] - per_rank[-1] * u[-1]
    scale = max(times) or 1.0
    for r in range(1, pp - 1):
        if abs(times[r] - per_rank[r] * u[r]) > _TOL * scale:
            return None
    if min(u) < 0 or first < -_TOL * scale or last < -_TOL * scale:
        return None
    return RankCosts(layer_s=u, first_s=max(first, 0.0), last_s=max(last, 0.0), layout=layout)


def _probe(layout, counts, pp, devices, want, times, price) -> dict[str, float] | None:
    """Unit times of the accelerators in ``want`` from estimates with one layer moved between chunks 0 and 1 or
    between the last two chunks: the two ranks' time differences are one layer each, the others' are 0."""
    if price is None:
        return None
    chunks, lows, scale = len(counts), chunk_lows(layout, len(counts)), max(times) or 1.0
    out: dict[str, float] = {}
    for a, b in ((1, 0), (0, 1), (chunks - 2, chunks - 1), (chunks - 1, chunks - 2)):
        todo = want - set(out)
        if not todo:
            break
        ranks = {devices[a % pp], devices[b % pp]} if min(a, b) >= 0 else set()
        if not ranks & todo or a % pp == b % pp or counts[a] - 1 < lows[a]:
            continue
        after = list(counts)
        after[a] -= 1
        after[b] += 1
        est = price(stage_layers_of(layout, after))
        if est is None:
            continue
        t2 = [float(t) for t in est.stage_time_s]
        ra, rb = a % pp, b % pp
        if any(abs(t2[r] - times[r]) > _TOL * scale for r in range(pp) if r not in (ra, rb)):
            return None
        for r, du in ((ra, times[ra] - t2[ra]), (rb, t2[rb] - times[rb])):
            if devices[r] in out and abs(out[devices[r]] - du) > _TOL * scale:
                return None
            out.setdefault(devices[r], du)
    return out if want <= set(out) else None


def least_max(costs: RankCosts, lows: Sequence[int]) -> tuple[float, float]:
    """(least ``max_r P_r``, least ``sum_r P_r``) over counts ``n_r >= lows[r]`` summing to the layers."""
    pp, n = costs.pp, costs.layout.layers
    base = [costs.fixed_s(r) + lows[r] * costs.layer_s[r] for r in range(pp)]
    extra = n - sum(lows)
    if extra < 0:
        return math.inf, math.inf
    least_sum = sum(base) + extra * min(costs.layer_s)
    heap = [(base[r] + costs.layer_s[r], r) for r in range(pp)]
    heapq.heapify(heap)
    top = max(base)
    for _ in range(extra):
        t, r = heapq.heappop(heap)
        top = max(top, t)
        heapq.heappush(heap, (t + costs.layer_s[r], r))
    return top, least_sum


def pipeline_form_s(schedule: str, m: int, v: int, max_s: float, sum_s: float, fill_s: float | None) -> float:
    """The schedules' closed forms from ``max_r P_r``, ``sum_r P_r`` and the fill / drain term (``fill_s``: the
    sum over ranks but the last of their largest chunk; None: its lower bound ``(sum - max) / v``)."""
    if schedule == "zero-bubble":
        return m * max_s
    if v == 1 and schedule in ("gpipe", "1f1b"):
        return sum_s + (m - 1) * max_s
    fill = (sum_s - max_s) / v if fill_s is None else fill_s
    return m * max_s + fill


def structure_bound_s(costs: RankCosts, *, schedule: str, v: int, m: int) -> float:
    """A lower bound on the step time of every cut of this structure (any knobs, any recompute counts)."""
    return structure_bound_from(costs, least_max(costs, rank_lows(costs.layout, costs.pp, v)), schedule=schedule,
                                v=v, m=m)


def structure_bound_from(costs: RankCosts, least: tuple[float, float], *, schedule: str, v: int, m: int) -> float:
    """``structure_bound_s`` from ``least_max(costs, rank_lows(...))`` (``least``), which does not depend on the
    schedule or the micro-batches: the search reads it once per rank costs and least counts."""
    top, least_sum = least
    if not math.isfinite(top):
        return math.inf
    if costs.pp == 1:
        return m * top
    return pipeline_form_s(schedule, m, v, top, least_sum, None)


def chunk_counts(costs: RankCosts, per_rank: Sequence[int], v: int) -> list[int]:
    """Transformer layers per chunk: each rank's layers water-filled over its chunks (the first least loaded
    chunk takes the next layer), which minimises the rank's largest chunk."""
    pp = costs.pp
    if v == 1:
        return list(per_rank)
    lows = chunk_lows(costs.layout, pp * v)
    counts = list(lows)
    for r in range(pp):
        counts[r::pp] = _rank_fill(costs, lows, r, per_rank[r], v)
    return counts


def _rank_fill(costs: RankCosts, lows: Sequence[int], r: int, n: int, v: int) -> list[int]:
    """``chunk_counts`` of rank ``r`` alone (its chunks ``r, r + pp, ...``) holding ``n`` transformer layers: a
    rank's fill does not depend on the other ranks'."""
    pp = costs.pp
    chunks = pp * v
    mine = range(r, chunks, pp)
    counts = [lows[c] for c in mine]
    extra = n - sum(counts)
    fixed = [(costs.first_s if c == 0 else 0.0) + (costs.last_s if c == chunks - 1 else 0.0) for c in mine]
    if not any(fixed) and len(set(counts)) == 1:
        q, rem = divmod(extra, v)  # equal chunks: round robin from the first
        return [k + q + (1 if i < rem else 0) for i, k in enumerate(counts)]
    u = costs.layer_s[r]
    for _ in range(extra):
        i = min(range(v), key=lambda i: (fixed[i] + (counts[i] + 1) * u, i))
        counts[i] += 1
    return counts


def cut_bound_s(costs: RankCosts, counts: Sequence[int], *, schedule: str, v: int, m: int) -> float:
    """The closed form (without p2p and the rest of the step) of given transformer layers per chunk: a lower
    bound on the step time of that cut with any knobs and recompute counts."""
    pp, last = costs.pp, len(counts) - 1
    u = costs.layer_s
    chunk_s = [counts[c] * u[c % pp] for c in range(len(counts))]
    chunk_s[0] += costs.first_s
    chunk_s[last] += costs.last_s
    if pp == 1:
        return m * sum(chunk_s)
    if v == 1:
        rank_s, fill = chunk_s, 0.0
    else:
        rank_s = [sum(chunk_s[r::pp]) for r in range(pp)]
        fill = sum(max(chunk_s[r::pp]) for r in range(pp - 1))
    return pipeline_form_s(schedule, m, v, max(rank_s), sum(rank_s), fill)


def _spreads(costs: RankCosts, per_rank: Sequence[int], v: int) -> list[list[int]]:
    """Zero-bubble: its fill / drain takes the largest forward, backward and weight-gradient parts of each rank's
    chunks (but the last rank's) apart. Chunks of transformer layers alone are balanced best; the embedding's
    chunk has other proportions, so each count of layers beside the embedding is tried, the rest balanced."""
    pp = costs.pp
    lows = chunk_lows(costs.layout, pp * v)
    base = chunk_counts(costs, per_rank, v)
    others = list(range(pp, pp * v, pp))  # rank 0's chunks but the embedding's
    free = per_rank[0] - sum(lows[c] for c in others)
    out = []
    for k0 in range(lows[0], free + 1):
        counts = list(base)
        counts[0] = k0
        q, rem = divmod(per_rank[0] - k0 - sum(lows[c] for c in others), len(others))
        for i, c in enumerate(others):
            counts[c] = lows[c] + q + (1 if i < rem else 0)
        out.append(counts)
    return out


def _max_rank_s(schedule: str, m: int, v: int, below_s: float, least_sum: float) -> float:
    """The largest ``max_r P_r`` whose bound can stay below ``below_s``."""
    if schedule == "zero-bubble":
        return below_s / m
    if v == 1 and schedule in ("gpipe", "1f1b"):
        return (below_s - least_sum) / (m - 1) if m > 1 else below_s
    return (below_s - least_sum / v) / (m - 1 / v)


def rank_counts_below(
    costs: RankCosts, *, schedule: str, v: int, m: int, below_s: float, limit: int,
) -> list[tuple[float, tuple[int, ...]]] | None:
    """Every cut (transformer layers per chunk, water-filled within ranks) whose ``cut_bound_s`` is below
    ``below_s``, sorted by bound; None when more than ``limit`` count vectors would have to be looked at."""
    pp = costs.pp
    lows = rank_lows(costs.layout, pp, v)
    top, least_sum = least_max(costs, lows)
    if not math.isfinite(top):
        return []
    cap_s = _max_rank_s(schedule, m, v, below_s, least_sum)
    caps = []
    for r in range(pp):
        u = costs.layer_s[r]
        room = cap_s - costs.fixed_s(r)
        most = costs.layout.layers
        fit = most if u <= 0 or not math.isfinite(room) else math.floor(room / u + _TOL)
        caps.append(min(most, max(lows[r] - 1, fit)))
    found: list[tuple[float, tuple[int, ...]]] = []
    parts = _RankParts(costs, v)
    visited = 0
    suffix_lo = [sum(lows[r:]) for r in range(pp + 1)]
    suffix_hi = [sum(caps[r:]) for r in range(pp + 1)]
    stack: list[tuple[int, int, tuple[int, ...]]] = [(0, costs.layout.layers, ())]
    while stack:
        r, left, chosen = stack.pop()
        visited += 1
        if visited > limit:
            return None
        if r == pp:
            # cut_bound_s of chunk_counts (of each of _spreads for zero-bubble), from each rank's own part
            for first in (parts.spreads(chosen[0]) if schedule == "zero-bubble" and v > 1 else (None,)):
                visited += 1
                b = parts.bound_s(chosen, schedule=schedule, m=m, first=first)
                if b < below_s:
                    found.append((b, parts.counts(chosen, first=first)))
            if visited > limit:
                return None
            continue
        lo = max(lows[r], left - suffix_hi[r + 1])
        hi = min(caps[r], left - suffix_lo[r + 1])
        for k in range(hi, lo - 1, -1):
            stack.append((r + 1, left - k, chosen + (k,)))
    found.sort()
    return found


class _RankParts:
    """``chunk_counts`` and ``cut_bound_s`` of a count vector (of each of its ``_spreads``) from per-rank parts:
    a rank's water-fill, its time and its largest chunk depend on its own count only (rank 0's spreads on
    rank 0's), memoized per (rank, count): ``rank_counts_below`` meets each rank's count in many vectors. The
    same sums in the same order as ``cut_bound_s``."""

    def __init__(self, costs: RankCosts, v: int) -> None:
        self.costs, self.v = costs, v
        self.lows = chunk_lows(costs.layout, costs.pp * v)
        self.memo: dict[tuple[int, int], tuple[list[int], float, float]] = {}
        self.spread_memo: dict[int, list[tuple[list[int], float, float]]] = {}

    def _of(self, r: int, counts: list[int]) -> tuple[list[int], float, float]:
        """(rank ``r``'s chunk counts, its seconds, its largest chunk's seconds)."""
        c, pp, last = self.costs, self.costs.pp, self.costs.pp * self.v - 1
        chunk_s = []
        for i, k in enumerate(counts):
            t = k * c.layer_s[r]
            if r + i * pp == 0:
                t += c.first_s
            if r + i * pp == last:
                t += c.last_s
            chunk_s.append(t)
        return counts, sum(chunk_s), max(chunk_s)

    def part(self, r: int, n: int) -> tuple[list[int], float, float]:
        """Rank ``r``'s part with ``n`` layers water-filled over its chunks."""
        hit = self.memo.get((r, n))
        if hit is None:
            counts = [n] if self.v == 1 else _rank_fill(self.costs, self.lows, r, n, self.v)
            hit = self.memo[(r, n)] = self._of(r, counts)
        return hit

    def spreads(self, n0: int) -> list[tuple[list[int], float, float]]:
        """Rank 0's parts in ``_spreads`` with ``n0`` layers: each count beside the embedding, the rest balanced."""
        hit = self.spread_memo.get(n0)
        if hit is None:
            pp, lows = self.costs.pp, self.lows
            others = list(range(pp, pp * self.v, pp))
            rest = sum(lows[c] for c in others)
            hit = []
            for k0 in range(lows[0], n0 - rest + 1):
                q, rem = divmod(n0 - k0 - rest, len(others))
                hit.append(self._of(0, [k0] + [lows[c] + q + (1 if i < rem else 0) for i, c in enumerate(others)]))
            self.spread_memo[n0] = hit
        return hit

    def _parts(self, per_rank: Sequence[int], first) -> list[tuple[list[int], float, float]]:
        return [first if r == 0 and first is not None else self.part(r, n) for r, n in enumerate(per_rank)]

    def bound_s(self, per_rank: Sequence[int], *, schedule: str, m: int, first=None) -> float:
        """``cut_bound_s`` of the chunk counts (rank 0's part ``first`` when given)."""
        parts = self._parts(per_rank, first)
        rank_s = [p[1] for p in parts]
        if len(parts) == 1:
            return m * rank_s[0]
        fill = 0.0 if self.v == 1 else sum(p[2] for p in parts[:-1])
        return pipeline_form_s(schedule, m, self.v, max(rank_s), sum(rank_s), fill)

    def counts(self, per_rank: Sequence[int], first=None) -> tuple[int, ...]:
        pp = len(per_rank)
        out = [0] * (pp * self.v)
        for r, p in enumerate(self._parts(per_rank, first)):
            out[r::pp] = p[0]
        return tuple(out)
