"""Layer counts per chunk when chunks interleave over pipeline ranks (interleaved 1F1B, zero-bubble): a DP.

Inputs are plain arrays; nothing here knows about models, configs or the cost model.

Formulation. ``N`` identical layers are cut into ``C = p v`` contiguous chunks; chunk ``c`` runs on rank
``r(c) = c % p`` (torch.distributed.pipelining's stage order). With ``n_c >= lo_c`` layers on chunk ``c`` (one, or
none for a chunk that the embedding or the head fills on its own), ``u_r``
the time of one layer on rank ``r`` (ranks may sit on different devices), ``e_c`` a fixed time of the chunk
(the embedding on chunk 0, the head on chunk ``C - 1``, overheads):

    t_c       = e_c + u_{r(c)} n_c                    P_r = sum_{c on r} t_c        M_r = max_{c on r} t_c
    objective = a * max_r P_r + sum_r beta_r M_r                                              (minimise)
    memory    : f_r + b_r N_r <= limit_r   with N_r = sum_{c on r} n_c

This is the step model's closed form (``costmodel.pipeline``): interleaved 1F1B is ``m max_r P_r`` plus one
chunk per rank of fill and drain (``a = m``, ``beta_r = 1`` but 0 on the last rank); zero-bubble's bubble is a
share ``beta`` of the largest chunk of each rank but the last; GPipe / 1F1B with ``v = 1`` is ``a = m - 1``,
``beta_r = 1`` (but ``costmodel``'s contiguous ``stage_dp`` also handles unequal layers there).

Since the layers are identical, any counts are realisable as a contiguous cut, and the objective splits:
given ``N_r``, ``P_r`` is fixed and the least ``M_r`` puts the rank's layers one by one on its currently
shortest chunk (water-filling; optimal for identical items, every prefix at once). So for a bound ``T`` on
every ``P_r``:

    g_{r+1}(n) = min_{k : P_r(k) <= T, memory_r(k) ok}  g_r(n - k) + beta_r M_r(k),     g_0(0) = 0

and the answer is ``min over T of a T + g_p(N)`` over the distinct values ``P_r(k)``: bisection finds the
least feasible ``T`` (feasibility is monotone), an ascending scan stops once ``a T`` plus the least possible
sum reaches the best objective. Each DP is ``O(p N^2)`` numpy work. ``brute_force_counts`` enumerates every
count vector (the tests' reference).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from costmodel.errors import InfeasiblePlanError

_INF = math.inf


@dataclass(frozen=True, kw_only=True, slots=True)
class CountProblem:
    num_layers: int
    """``N``: layers to place (each chunk takes at least ``min_per_chunk``)."""
    virtual_stages: int
    """``v``: chunks per rank."""
    layer_time_s: tuple[float, ...]
    """``u_r``: time of one layer on rank ``r`` for one micro-batch (``p`` values)."""
    chunk_time_s: tuple[float, ...]
    """``e_c``: fixed time of chunk ``c`` (``p v`` values)."""
    pace: float
    """``a``: weight of the busiest rank's time (the number of micro-batches it runs)."""
    bubble_weight: tuple[float, ...]
    """``beta_r``: weight of rank ``r``'s largest chunk (fill and drain)."""
    rank_bytes: tuple[float, ...]
    """``f_r``: memory of rank ``r`` whatever its layers."""
    layer_bytes: tuple[float, ...]
    """``b_r``: memory of one layer on rank ``r`` (weights, states, in-flight activations)."""
    memory_limit_bytes: tuple[float, ...]
    min_per_chunk: int | tuple[int, ...] = 1
    """Least layers per chunk, one value or one per chunk (0 lets the embedding's or the head's chunk hold
    nothing else)."""

    @property
    def num_ranks(self) -> int:
        return len(self.layer_time_s)

    def lows(self) -> np.ndarray:
        """(v, p) least layers of each chunk (row = local chunk, column = rank)."""
        chunks = self.num_ranks * self.virtual_stages
        lo = np.broadcast_to(np.asarray(self.min_per_chunk, dtype=int), (chunks,))
        return lo.reshape(self.virtual_stages, self.num_ranks)


@dataclass(frozen=True, kw_only=True, slots=True)
class CountSolution:
    chunk_layers: tuple[int, ...]
    """Layers per chunk, chunk order (chunk ``c`` on rank ``c % p``)."""
    objective_s: float
    rank_time_s: tuple[float, ...]
    dp_runs: int = 0


def evaluate_counts(p: CountProblem, chunk_layers: Sequence[int]) -> tuple[float, np.ndarray, bool]:
    """(objective, per-rank time, fits memory) of given layer counts per chunk."""
    ranks, v = p.num_ranks, p.virtual_stages
    n = np.asarray(chunk_layers, dtype=float).reshape(v, ranks)
    t = np.asarray(p.chunk_time_s).reshape(v, ranks) + np.asarray(p.layer_time_s)[None, :] * n
    per_rank = t.sum(axis=0)
    obj = p.pace * float(per_rank.max()) + float(np.asarray(p.bubble_weight) @ t.max(axis=0))
    mem = np.asarray(p.rank_bytes) + np.asarray(p.layer_bytes) * n.sum(axis=0)
    fits = bool(np.all(mem <= np.asarray(p.memory_limit_bytes)))
    return obj, per_rank, fits


def _water_fill(base: np.ndarray, unit: float, lo: np.ndarray, extra: int) -> tuple[np.ndarray, list[int]]:
    """Least largest chunk time for ``sum(lo) + k`` layers on chunks with fixed times ``base`` holding at least
    ``lo`` each, k = 0..extra: (max times (extra + 1,), the chunk each added layer goes to)."""
    t = base + unit * lo
    out, order = [float(t.max())], []
    for _ in range(extra):
        c = int(np.argmin(t))  # the first shortest chunk: deterministic
        t[c] += unit
        order.append(c)
        out.append(float(t.max()))
    return np.asarray(out), order


@dataclass(frozen=True, slots=True)
class _Tables:
    kmin: np.ndarray  # (p,) least layers of each rank
    rank_time: np.ndarray  # (p, K) P_r(k) for k = kmin_r .. kmin_r + K - 1
    cost: np.ndarray  # (p, K) beta_r M_r(k)
    mem_ok: np.ndarray  # (p, K)
    orders: list[list[int]]  # per rank: the local chunk of each added layer


def _tables(p: CountProblem) -> _Tables:
    ranks, v, lows = p.num_ranks, p.virtual_stages, p.lows()
    kmin = lows.sum(axis=0)
    extra = p.num_layers - int(kmin.sum())
    e = np.asarray(p.chunk_time_s, dtype=float).reshape(v, ranks)
    rank_time, cost, mem_ok, orders = [], [], [], []
    for r in range(ranks):
        k = kmin[r] + np.arange(extra + 1)
        m_r, order = _water_fill(e[:, r].copy(), p.layer_time_s[r], lows[:, r], extra)
        rank_time.append(e[:, r].sum() + p.layer_time_s[r] * k)
        cost.append(p.bubble_weight[r] * m_r)
        mem_ok.append(p.rank_bytes[r] + p.layer_bytes[r] * k <= p.memory_limit_bytes[r])
        orders.append(order)
    return _Tables(kmin=kmin, rank_time=np.array(rank_time), cost=np.array(cost), mem_ok=np.array(mem_ok),
                   orders=orders)


def _dp(tab: _Tables, num_layers: int, t_max: float) -> tuple[float, list[np.ndarray]]:
    """Least ``sum_r beta_r M_r`` with every ``P_r <= t_max``: (g_p(N), per-rank argmin tables)."""
    ranks, width = tab.cost.shape
    n = num_layers + 1
    g = np.full(n, _INF)
    g[0] = 0.0
    choices = []
    for r in range(ranks):
        src = np.arange(n)[:, None] - (tab.kmin[r] + np.arange(width))[None, :]  # (n, K): layers before this rank
        valid = src >= 0
        ok = tab.mem_ok[r] & (tab.rank_time[r] <= t_max)
        c = np.where(ok, tab.cost[r], _INF)
        cand = np.where(valid, g[np.clip(src, 0, None)] + c[None, :], _INF)
        best = np.argmin(cand, axis=1)
        g = cand[np.arange(n), best]
        choices.append(best)
    return float(g[-1]), choices


def _counts_from(tab: _Tables, p: CountProblem, choices: list[np.ndarray]) -> tuple[int, ...]:
    ranks = p.num_ranks
    per_rank, n = [0] * ranks, p.num_layers
    for r in range(ranks - 1, -1, -1):
        k = int(tab.kmin[r]) + int(choices[r][n])
        per_rank[r] = k
        n -= k
    chunks = [int(x) for x in p.lows().reshape(-1)]
    for r in range(ranks):
        for local in tab.orders[r][: per_rank[r] - int(tab.kmin[r])]:
            chunks[local * ranks + r] += 1
    return tuple(chunks)


def solve_counts(p: CountProblem) -> CountSolution:
    """Optimal layer counts per chunk; ``InfeasiblePlanError`` (with the numbers) if none fits memory."""
    ranks, v = p.num_ranks, p.virtual_stages
    least = int(p.lows().sum())
    if p.num_layers < least:
        raise InfeasiblePlanError(
            f"{p.num_layers} layers cannot fill {ranks * v} chunks (pp={ranks} x virtual_stages={v}) with the "
            f"{least} they need at least: use fewer chunks"
        )
    tab = _tables(p)
    cands = np.unique(tab.rank_time[tab.mem_ok])
    if cands.size == 0 or not math.isfinite(_dp(tab, p.num_layers, float(cands[-1]))[0]):
        need = float(np.min(np.asarray(p.rank_bytes) + np.asarray(p.layer_bytes) * tab.kmin
                            - np.asarray(p.memory_limit_bytes)))
        raise InfeasiblePlanError(
            f"no split of {p.num_layers} layers over {ranks} ranks x {v} chunks fits memory: even the "
            f"lightest rank is {max(need, 0.0) / 1e9:.2f} GB over its limit at its least layers; use more "
            "pipeline stages, recomputation, ZeRO or a smaller micro-batch"
        )
    runs, lo, hi = 0, 0, cands.size - 1
    while lo < hi:  # the least feasible bound on the busiest rank
        mid = (lo + hi) // 2
        runs += 1
        if math.isfinite(_dp(tab, p.num_layers, float(cands[mid]))[0]):
            hi = mid
        else:
            lo = mid + 1
    least_sum = _dp(tab, p.num_layers, _INF)[0]
    best_obj, best_choices = _INF, None
    for t_max in cands[lo:]:
        if p.pace * float(t_max) + least_sum >= best_obj:
            break
        total, choices = _dp(tab, p.num_layers, float(t_max))
        runs += 1
        obj = p.pace * float(t_max) + total
        if obj < best_obj - 1e-15 * max(1.0, abs(obj)):
            best_obj, best_choices = obj, choices
    counts = _counts_from(tab, p, best_choices)
    obj, per_rank, _ = evaluate_counts(p, counts)
    return CountSolution(chunk_layers=counts, objective_s=obj, rank_time_s=tuple(per_rank.tolist()), dp_runs=runs)


def brute_force_counts(p: CountProblem) -> CountSolution | None:
    """Every count vector (tests on small inputs); None if nothing fits."""
    chunks, lows = p.num_ranks * p.virtual_stages, [int(x) for x in p.lows().reshape(-1)]
    free = p.num_layers - sum(lows)
    best: CountSolution | None = None
    if free < 0:
        return None
    for bars in itertools.combinations(range(free + chunks - 1), chunks - 1):  # stars and bars
        edges = (-1, *bars, free + chunks - 1)
        counts = tuple(lows[i] + edges[i + 1] - edges[i] - 1 for i in range(chunks))
        obj, per_rank, fits = evaluate_counts(p, counts)
        if fits and (best is None or obj < best.objective_s):
            best = CountSolution(chunk_layers=counts, objective_s=obj, rank_time_s=tuple(per_rank.tolist()))
    return best
