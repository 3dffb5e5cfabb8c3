"""Stage construction: cut a layer sequence into pipeline stages (Alpa's inter-op DP as an array function).

Inputs are plain arrays; nothing here knows about models, configs or the cost model.

Formulation (Zheng et al., Alpa, OSDI 2022, Eq. 2; the unequal-stage pipeline time of Huang et al. 2019). Layers ``0..L-1`` are cut
into ``S`` contiguous, non-empty stages; stage ``s`` covers layers ``[c_s, c_{s+1})`` with ``c_0 = 0``,
``c_S = L``. With ``t[s, i]`` the forward + backward time of layer ``i`` for one micro-batch when placed on stage
``s`` (stages may sit on different devices: a heterogeneous cluster's faster groups get more layers), ``o_s``
a per-stage overhead (pipeline send/recv; what always sits on the stage, such as the embedding of the first)
and ``m`` micro-batches:

    T_s       = o_s + sum_{i in stage s} t[s, i]
    objective = sum_s T_s + (m - 1) * max_s T_s                      (minimise)
    memory    : w_s + sum_{i in s} static[s, i] + inflight_s * sum_{i in s} act[s, i] <= limit_s   for all s

``inflight_s`` is the number of micro-batches whose activations stage ``s`` holds at its peak under the
schedule (1F1B: ``min(S - s, m)``; GPipe: ``m``); ``static`` is weights + gradients + optimizer state.

Algorithm: for a fixed bound ``T_max`` on every stage time, ``g_s(i)`` = least ``sum_{s' >= s} T_{s'}`` to
cover layers ``i..L-1`` with stages ``s..S-1`` (``g_S(L) = 0``):

    g_s(i) = min_{j > i, T_s(i, j) <= T_max, mem_s(i, j) <= limit_s}  T_s(i, j) + g_{s+1}(j)

and the answer is ``min over T_max of g_0(0) + (m - 1) * T_max`` over the distinct segment times. Each DP is
``O(S L^2)`` numpy work. The candidates are scanned in ascending order from the smallest feasible one (found
by bisection: feasibility is monotone in ``T_max``) and the scan stops once ``(m - 1) * T_max`` plus the
least possible sum reaches the best objective: when all stages share the same layer times the sum is a
constant and a single DP decides.
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
class StageProblem:
    """Costs per layer (per stage when the stages differ) for one parallel configuration."""

    layer_time_s: tuple[tuple[float, ...], ...]
    """``[s][i]``: forward + backward time of layer ``i`` for one micro-batch on stage ``s``."""
    layer_static_bytes: tuple[tuple[float, ...], ...]
    """``[s][i]``: weights + gradients + optimizer state of layer ``i`` on a device of stage ``s``."""
    layer_act_bytes: tuple[tuple[float, ...], ...]
    """``[s][i]``: activation bytes layer ``i`` keeps for one in-flight micro-batch on stage ``s``."""
    num_microbatches: int
    inflight: tuple[float, ...]
    """Per stage: micro-batches in flight at the stage's memory peak."""
    memory_limit_bytes: tuple[float, ...]
    """Per stage: device memory available."""
    stage_overhead_s: tuple[float, ...] = ()
    """Per stage: seconds added to the stage's time whatever its layers (``o_s``)."""
    stage_overhead_bytes: tuple[float, ...] = ()
    """Per stage: bytes added to the stage's memory whatever its layers (``w_s``)."""

    @property
    def num_stages(self) -> int:
        return len(self.inflight)

    @property
    def num_layers(self) -> int:
        return len(self.layer_time_s[0])


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSolution:
    stage_layers: tuple[int, ...]
    """Number of layers per stage, in order (sums to ``L``)."""
    objective_s: float
    stage_time_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    dp_runs: int = 0


def make_problem(
    *,
    layer_time_s: Sequence[float] | np.ndarray,
    layer_static_bytes: Sequence[float] | np.ndarray,
    layer_act_bytes: Sequence[float] | np.ndarray,
    num_stages: int,
    num_microbatches: int,
    inflight: Sequence[float],
    memory_limit_bytes: float | Sequence[float],
    stage_overhead_s: float | Sequence[float] = 0.0,
    stage_overhead_bytes: float | Sequence[float] = 0.0,
) -> StageProblem:
    """Build a ``StageProblem``; 1-D per-layer arrays are shared by all stages, scalar overheads and limits too."""

    def per_stage(a) -> tuple[tuple[float, ...], ...]:
        arr = np.asarray(a, dtype=float)
        if arr.ndim == 1:
            arr = np.broadcast_to(arr, (num_stages, arr.shape[0]))
        return tuple(tuple(float(x) for x in row) for row in arr)

    def per_stage_scalar(a) -> tuple[float, ...]:
        return tuple(float(x) for x in np.broadcast_to(np.asarray(a, dtype=float), (num_stages,)))

    lim = per_stage_scalar(memory_limit_bytes)
    if len(inflight) != num_stages:
        raise ValueError(f"inflight has {len(inflight)} entries, expected num_stages={num_stages}")
    return StageProblem(
        layer_time_s=per_stage(layer_time_s),
        layer_static_bytes=per_stage(layer_static_bytes),
        layer_act_bytes=per_stage(layer_act_bytes),
        num_microbatches=int(num_microbatches),
        inflight=tuple(float(x) for x in inflight),
        memory_limit_bytes=lim,
        stage_overhead_s=per_stage_scalar(stage_overhead_s),
        stage_overhead_bytes=per_stage_scalar(stage_overhead_bytes),
    )


def _segment_matrix(per_layer: np.ndarray) -> np.ndarray:
    """``M[i, j] = sum(per_layer[i:j])`` for ``j > i``; ``inf`` elsewhere. Shape (L+1, L+1)."""
    prefix = np.concatenate(([0.0], np.cumsum(per_layer)))
    mat = prefix[None, :] - prefix[:, None]
    n = prefix.shape[0]
    mat[np.tril_indices(n)] = _INF
    return mat


@dataclass(frozen=True, slots=True)
class _Arrays:
    time: np.ndarray  # (S, L+1, L+1) segment time incl. overhead, inf where j <= i
    feasible_mem: np.ndarray  # (S, L+1, L+1) bool
    mem: np.ndarray  # (S, L+1, L+1)


def _overhead(values: tuple[float, ...], s: int) -> float:
    return values[s] if values else 0.0


def _arrays(p: StageProblem) -> _Arrays:
    t = np.asarray(p.layer_time_s, dtype=float)
    st = np.asarray(p.layer_static_bytes, dtype=float)
    act = np.asarray(p.layer_act_bytes, dtype=float)
    times, mems = [], []
    for s in range(p.num_stages):
        times.append(_segment_matrix(t[s]) + _overhead(p.stage_overhead_s, s))
        mems.append(_segment_matrix(st[s]) + p.inflight[s] * _segment_matrix(act[s])
                    + _overhead(p.stage_overhead_bytes, s))
    time = np.stack(times)
    mem = np.stack(mems)
    lim = np.asarray(p.memory_limit_bytes)[:, None, None]
    return _Arrays(time=time, feasible_mem=(mem <= lim) & np.isfinite(time), mem=mem)


def _dp(arr: _Arrays, t_max: float) -> tuple[float, list[np.ndarray]]:
    """Least sum of stage times with every stage time <= t_max; returns (g_0(0), argmin tables)."""
    num_stages, n, _ = arr.time.shape
    g = np.full(n, _INF)
    g[n - 1] = 0.0  # g_S(L) = 0
    choices: list[np.ndarray] = [np.zeros(0, dtype=int)] * num_stages
    for s in range(num_stages - 1, -1, -1):
        ok = arr.feasible_mem[s] & (arr.time[s] <= t_max)
        cand = np.where(ok, arr.time[s] + g[None, :], _INF)
        best_j = np.argmin(cand, axis=1)  # first minimum: deterministic tie-break
        g = cand[np.arange(n), best_j]
        choices[s] = best_j
    return float(g[0]), choices


def _cuts_from(choices: list[np.ndarray]) -> tuple[int, ...]:
    i, counts = 0, []
    for s in range(len(choices)):
        j = int(choices[s][i])
        counts.append(j - i)
        i = j
    return tuple(counts)


def evaluate_cuts(p: StageProblem, stage_layers: Sequence[int]) -> StageSolution:
    """Objective, per-stage times and memory of given cuts (no feasibility check)."""
    t = np.asarray(p.layer_time_s, dtype=float)
    st = np.asarray(p.layer_static_bytes, dtype=float)
    act = np.asarray(p.layer_act_bytes, dtype=float)
    i, times, mems = 0, [], []
    for s, n in enumerate(stage_layers):
        times.append(_overhead(p.stage_overhead_s, s) + float(t[s, i : i + n].sum()))
        mems.append(_overhead(p.stage_overhead_bytes, s) + float(st[s, i : i + n].sum())
                    + p.inflight[s] * float(act[s, i : i + n].sum()))
        i += n
    obj = sum(times) + (p.num_microbatches - 1) * max(times)
    return StageSolution(
        stage_layers=tuple(stage_layers), objective_s=obj, stage_time_s=tuple(times), stage_memory_bytes=tuple(mems)
    )


def solve_stages(p: StageProblem) -> StageSolution:
    """Optimal cuts for ``p``; ``InfeasiblePlanError`` if no cut fits memory (with the least memory needed)."""
    if p.num_stages < 1 or p.num_stages > p.num_layers:
        raise InfeasiblePlanError(
            f"cannot cut {p.num_layers} layers into {p.num_stages} non-empty stages: "
            f"choose between 1 and {p.num_layers} stages"
        )
    arr = _arrays(p)
    cands = np.unique(arr.time[np.isfinite(arr.time) & arr.feasible_mem])
    runs = 0
    if cands.size == 0 or not math.isfinite(_dp(arr, float(cands[-1]))[0]):
        raise InfeasiblePlanError(_infeasible_message(p, arr))
    lo, hi = 0, cands.size - 1  # bisection for the smallest feasible T_max
    while lo < hi:
        mid = (lo + hi) // 2
        runs += 1
        if math.isfinite(_dp(arr, float(cands[mid]))[0]):
            hi = mid
        else:
            lo = mid + 1
    least_sum = _least_sum(arr)
    best_obj, best_choices = _INF, None
    for k in range(lo, cands.size):
        t_max = float(cands[k])
        if least_sum + (p.num_microbatches - 1) * t_max >= best_obj:
            break
        total, choices = _dp(arr, t_max)
        runs += 1
        obj = total + (p.num_microbatches - 1) * t_max
        if obj < best_obj - 1e-15 * max(1.0, abs(obj)):
            best_obj, best_choices = obj, choices
    cuts = _cuts_from(best_choices)
    sol = evaluate_cuts(p, cuts)
    return StageSolution(
        stage_layers=sol.stage_layers,
        objective_s=sol.objective_s,
        stage_time_s=sol.stage_time_s,
        stage_memory_bytes=sol.stage_memory_bytes,
        dp_runs=runs,
    )


def _least_sum(arr: _Arrays) -> float:
    """A lower bound on sum_s T_s: the DP without the T_max and memory constraints."""
    num_stages, n, _ = arr.time.shape
    g = np.full(n, _INF)
    g[n - 1] = 0.0
    for s in range(num_stages - 1, -1, -1):
        g = np.min(arr.time[s] + g[None, :], axis=1)
    return float(g[0])


def _infeasible_message(p: StageProblem, arr: _Arrays) -> str:
    # Least achievable max-over-stages memory, ignoring time: a bisection over memory would be exact; the
    # per-stage minimum over single layers is a lower bound that already names the scale of the problem.
    per_stage_min = [float(np.min(arr.mem[s][np.isfinite(arr.time[s])])) for s in range(p.num_stages)]
    need = max(per_stage_min)
    lim = min(p.memory_limit_bytes)
    return (
        f"no cut of {p.num_layers} layers into {p.num_stages} stages fits: a stage needs at least "
        f"{need / 1e9:.2f} GB per device but {lim / 1e9:.2f} GB is available; use more pipeline stages, "
        "recomputation, ZeRO or a smaller micro-batch"
    )


def brute_force_stages(p: StageProblem) -> StageSolution | None:
    """Enumerate every cut (for tests on small inputs); None if nothing fits."""
    L, S = p.num_layers, p.num_stages
    best: StageSolution | None = None
    for inner in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *inner, L)
        counts = tuple(bounds[k + 1] - bounds[k] for k in range(S))
        sol = evaluate_cuts(p, counts)
        if any(m > lim for m, lim in zip(sol.stage_memory_bytes, p.memory_limit_bytes)):
            continue
        if best is None or sol.objective_s < best.objective_s:
            best = sol
    return best
