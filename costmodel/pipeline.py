"""Pipeline schedules as cost functions: the action order torch.distributed.pipelining runs, simulated.

Each schedule name maps onto the torch 2.x class the runtime builds, and the per-rank action order below is
a port of that class's order (``torch/distributed/pipelining/schedules.py``), with the no-op padding slots
dropped (the runtime waits on p2p dependencies, not on slots):

=====================  =================================  ==============================================
schedule               torch class                        order of rank ``r`` (``p`` ranks, ``m`` micro-batches)
=====================  =================================  ==============================================
``gpipe``              ``ScheduleGPipe``                  F0..F(m-1), B0..B(m-1)
``1f1b``               ``Schedule1F1B``                   min(m, p-r) forwards, then B,F pairs, then the Bs
``interleaved-1f1b``   ``ScheduleInterleaved1F1B``        ``_get_1f1b_rank_ops`` with warm-up
                                                          ``(v-1)*m_round + 2*(p-1-r)`` over v local chunks
``zero-bubble``        ``ScheduleInterleavedZeroBubble``  same with warm-up ``(v-1)*m_round + (p-1-r)``,
                                                          B split into input-grad B and weight-grad W; the
                                                          Ws start after ``r`` steady steps (ZB-H1 for v=1)
=====================  =================================  ==============================================

Chunk ``c`` of ``p * v`` (torch's stage index) runs on rank ``c % p``; local chunk ``c // p``.
Dependencies: F(c, i) after F(c-1, i) (+ p2p when the ranks differ), B(c, i) after B(c+1, i) (+ p2p), the
last chunk's B after its own F, W(c, i) after B(c, i). Times: ``t_fwd_s`` / ``t_bwd_s`` / ``t_wgrad_s`` are
per micro-batch and chunk, a scalar or one value per chunk (``p * v``) or per rank (``p``). ``t_bwd_s`` is the
input-gradient part; schedules that do not split the backward run B and W together (``t_bwd_s + t_wgrad_s``).

``pipeline_time_s`` is the closed form the step model uses (fast); ``simulate`` is the event simulation that
the tests hold the closed forms against:

- GPipe / 1F1B, equal stages: ``(m + p - 1)(t_f + t_b)``; unequal: ``sum_s (t_f + t_b)_s + (m - 1) max_s``.
- Interleaved: chunk times ``t_c``: ``m v t_c + (p - 1) t_c``, bubble ``(p - 1) / (v m)`` (SC21).
- ZB-H1 (Qi et al. 2024): ``m (t_f + t_b + t_w) + (p - 1) max(t_f + t_b - t_w, t_f, t_b)``.
- p2p: GPipe and interleaved pay the ``2 (p v - 1)`` hops of fill and drain; 1F1B has no slack (exactly
  ``p`` in flight) and pays ``2 (p - 1)`` hops per round of ``p`` micro-batches; ZB about both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from costmodel.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
Kind = Literal["F", "B", "W"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Action:
    """One computation in a rank's order: ``chunk`` is the global chunk (torch stage index)."""

    chunk: int
    kind: Kind
    microbatch: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """A simulated computation: ``stage`` is the pipeline rank, ``chunk`` the local chunk (0..v-1)."""

    stage: int
    microbatch: int
    chunk: int
    kind: Kind
    start_s: float
    end_s: float


def check_schedule(schedule: str, *, pp: int, num_microbatches: int, virtual_stages: int) -> None:
    """Raise ConfigError when torch.distributed.pipelining would refuse this schedule."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r} is unknown; choose one of {SCHEDULES}")
    if pp < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ConfigError(
            f"pp={pp}, num_microbatches={num_microbatches}, virtual_stages={virtual_stages} must all be >= 1"
        )
    if schedule in ("gpipe", "1f1b") and virtual_stages != 1:
        raise ConfigError(
            f"schedule={schedule!r} runs one chunk per rank but virtual_stages={virtual_stages}; "
            "use virtual_stages=1 or schedule 'interleaved-1f1b'"
        )
    if schedule == "1f1b" and num_microbatches < pp:
        raise ConfigError(
            f"1f1b needs num_microbatches >= pp (torch Schedule1F1B); got {num_microbatches} < pp={pp}: "
            f"use at least {pp} micro-batches (a smaller micro-batch size) or schedule 'gpipe'"
        )
    if schedule in ("interleaved-1f1b", "zero-bubble") and pp > 1 and num_microbatches % pp:
        lo = max(pp, num_microbatches - num_microbatches % pp)
        raise ConfigError(
            f"{schedule} needs num_microbatches % pp == 0; got num_microbatches={num_microbatches}, pp={pp}: "
            f"use {lo} or {lo + pp} micro-batches"
        )


def _ops_1f1b(rank: int, pp: int, m: int) -> list[Action]:
    # Schedule1F1B._step_microbatches: warm-up forwards, then "1B1F" pairs, then the remaining backwards.
    warmup = min(m, pp - rank)
    ops = [Action(chunk=rank, kind="F", microbatch=i) for i in range(warmup)]
    f, b = warmup, 0
    while True:
        ops.append(Action(chunk=rank, kind="B", microbatch=b))
        b += 1
        if f == m:
            break
        ops.append(Action(chunk=rank, kind="F", microbatch=f))
        f += 1
    ops.extend(Action(chunk=rank, kind="B", microbatch=i) for i in range(b, m))
    return ops


def _warmup_ops(rank: int, *, pp: int, v: int, m: int, factor: int) -> int:
    # torch _get_warmup_ops
    per_round = m // max(1, m // pp)
    return min((v - 1) * per_round + factor * (pp - 1 - rank), m * v)


def _ops_interleaved(rank: int, pp: int, m: int, v: int, *, zero_bubble: bool) -> list[Action]:
    # torch ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble._calculate_single_rank_operations
    # + _get_1f1b_rank_ops, padding dropped.
    per_round = m // max(1, m // pp)
    warmup = _warmup_ops(rank, pp=pp, v=v, m=m, factor=1 if zero_bubble else 2)
    total_chunk_mbs = v * m

    def fwd_chunk(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def bwd_chunk(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    next_f: dict[int, int] = {}
    next_b: dict[int, int] = {}
    next_w: dict[int, int] = {}
    ops: list[Action] = []
    bwd_steps: list[int] = []
    w_done = 0

    def take(counter: dict[int, int], chunk: int) -> int:
        i = counter.get(chunk, 0)
        counter[chunk] = i + 1
        return i

    def maybe_w(step: int) -> None:
        nonlocal w_done
        if zero_bubble and step - warmup >= rank:
            c = bwd_chunk(bwd_steps[w_done])
            ops.append(Action(chunk=c, kind="W", microbatch=take(next_w, c)))
            w_done += 1

    for step in range(warmup + total_chunk_mbs):
        if step < total_chunk_mbs:  # warm-up and steady phases run a forward
            c = fwd_chunk(step)
            ops.append(Action(chunk=c, kind="F", microbatch=take(next_f, c)))
        if step >= warmup:  # steady and cool-down phases run a backward
            c = bwd_chunk(step)
            ops.append(Action(chunk=c, kind="B", microbatch=take(next_b, c)))
            bwd_steps.append(step)
            maybe_w(step)
    while zero_bubble and w_done < len(bwd_steps):
        c = bwd_chunk(bwd_steps[w_done])
        ops.append(Action(chunk=c, kind="W", microbatch=take(next_w, c)))
        w_done += 1
    return ops


def rank_orders(
    schedule: str, *, pp: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, the order of computations torch.distributed.pipelining executes."""
    check_schedule(schedule, pp=pp, num_microbatches=num_microbatches, virtual_stages=virtual_stages)
    m, v = num_microbatches, virtual_stages
    orders = []
    for r in range(pp):
        if schedule == "gpipe":
            ops = [Action(chunk=r, kind="F", microbatch=i) for i in range(m)]
            ops += [Action(chunk=r, kind="B", microbatch=i) for i in range(m)]
        elif schedule == "1f1b":
            ops = _ops_1f1b(r, pp, m)
        else:
            ops = _ops_interleaved(r, pp, m, v, zero_bubble=schedule == "zero-bubble")
        orders.append(tuple(ops))
    return tuple(orders)


def _per_chunk(t: float | Sequence[float], pp: int, v: int, name: str) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(t, dtype=float))
    if arr.size == 1:
        return np.full(pp * v, float(arr[0]))
    if arr.size == pp * v:
        return arr
    if arr.size == pp:
        return np.tile(arr, v)
    raise ConfigError(f"{name} has {arr.size} values; give 1, pp={pp} or pp*virtual_stages={pp * v}")


def simulate(
    schedule: str,
    *,
    pp: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    t_fwd_s: float | Sequence[float],
    t_bwd_s: float | Sequence[float],
    t_wgrad_s: float | Sequence[float] = 0.0,
    p2p_s: float = 0.0,
) -> list[Event]:
    """Event simulation of the schedule: each rank runs its order, each action waits for its inputs."""
    v = virtual_stages
    orders = rank_orders(schedule, pp=pp, num_microbatches=num_microbatches, virtual_stages=v)
    tf = _per_chunk(t_fwd_s, pp, v, "t_fwd_s")
    tb = _per_chunk(t_bwd_s, pp, v, "t_bwd_s")
    tw = _per_chunk(t_wgrad_s, pp, v, "t_wgrad_s")
    split = schedule == "zero-bubble"
    n_chunks = pp * v
    done: dict[tuple[str, int, int], float] = {}
    free_s = [0.0] * pp
    pos = [0] * pp
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                c, i = a.chunk, a.microbatch
                if a.kind == "F":
                    dep = None if c == 0 else ("F", c - 1, i)
                    dur = tf[c]
                elif a.kind == "B":
                    dep = ("F", c, i) if c == n_chunks - 1 else ("B", c + 1, i)
                    dur = tb[c] if split else tb[c] + tw[c]
                else:
                    dep, dur = ("B", c, i), tw[c]
                ready = 0.0
                if dep is not None:
                    if dep not in done:
                        break
                    ready = done[dep] + (p2p_s if dep[1] % pp != r else 0.0)
                start = max(free_s[r], ready)
                end = start + dur
                free_s[r] = end
                done[(a.kind, c, i)] = end
                events.append(Event(stage=r, microbatch=i, chunk=c // pp, kind=a.kind, start_s=start, end_s=end))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the orders above; guards against a bad port
            raise ConfigError(f"schedule {schedule!r} deadlocks for pp={pp}, m={num_microbatches}, v={v}")
    return events


def simulated_time_s(events: Sequence[Event]) -> float:
    return max(e.end_s for e in events) - min(e.start_s for e in events)


def pipeline_time_s(
    schedule: str,
    *,
    pp: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    t_fwd_s: float | Sequence[float],
    t_bwd_s: float | Sequence[float],
    t_wgrad_s: float | Sequence[float] = 0.0,
    p2p_s: float = 0.0,
) -> float:
    """Closed-form time of one step's pipeline (see the module docstring); exact for equal stages."""
    v, m = virtual_stages, num_microbatches
    check_schedule(schedule, pp=pp, num_microbatches=m, virtual_stages=v)
    tf = _per_chunk(t_fwd_s, pp, v, "t_fwd_s")
    tb = _per_chunk(t_bwd_s, pp, v, "t_bwd_s")
    tw = _per_chunk(t_wgrad_s, pp, v, "t_wgrad_s")
    return _closed_form_s(schedule, pp=pp, m=m, v=v, tf=tf, tb=tb, tw=tw, p2p_s=p2p_s)


def _closed_form_s(
    schedule: str, *, pp: int, m: int, v: int, tf: np.ndarray, tb: np.ndarray, tw: np.ndarray, p2p_s: float
) -> float:
    base_s, hops = _closed_form_terms(schedule, pp=pp, m=m, v=v, tf=tf, tb=tb, tw=tw)
    return base_s + hops * p2p_s


def _closed_form_terms(
    schedule: str, *, pp: int, m: int, v: int, tf: np.ndarray, tb: np.ndarray, tw: np.ndarray
) -> tuple[float, float]:
    """The closed form as ``(time without p2p, p2p hops)``: the time is ``base + hops * p2p_s``."""
    if schedule == "zero-bubble":
        per_rank = (tf + tb + tw).reshape(v, pp).sum(axis=0)  # (pp,) one micro-batch through a rank's chunks
        f, b, w = (x.reshape(v, pp).max(axis=0)[:-1] for x in (tf, tb, tw))
        # per hop the W fills the bubble down to F + B - W, but never below one F or one B
        bubble = float(np.maximum(f + b - w, np.maximum(f, b)).sum())
        hops = 2 * (pp * v - 1) + 2 * (pp - 1) / v
        return m * float(per_rank.max()) + bubble, hops
    t = (tf + tb + tw).reshape(v, pp)  # (v, pp): full fwd+bwd of a micro-batch per chunk
    per_rank = t.sum(axis=0)  # (pp,)
    if v == 1:
        # fill + drain through every stage once, the slowest stage sets the pace (Alpa's form)
        work = float(per_rank.sum() + (m - 1) * per_rank.max())
        if schedule == "1f1b":
            # 1F1B keeps exactly p micro-batches in flight: each round trip of p micro-batches waits 2(p-1) hops
            return work, 2 * (pp - 1) * (m + pp - 1) / pp
        return work, 2 * (pp * v - 1)
    # interleaved: the steady state is paced by the busiest rank, fill/drain by one chunk per hop;
    # the warm-up leaves slack, so only the fill and drain through all p*v chunks pay the p2p
    chunk_max = t.max(axis=0)  # (pp,)
    return float(m * per_rank.max() + chunk_max[:-1].sum()), 2 * (pp * v - 1)


def bubble_fraction(
    schedule: str,
    *,
    pp: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    t_fwd_s: float | Sequence[float] = 1.0,
    t_bwd_s: float | Sequence[float] = 2.0,
    t_wgrad_s: float | Sequence[float] = 0.0,
    p2p_s: float = 0.0,
) -> float:
    """Idle time over the ideal time ``m * (busiest rank's work per micro-batch)``."""
    v, m = virtual_stages, num_microbatches
    total = pipeline_time_s(
        schedule, pp=pp, num_microbatches=m, virtual_stages=v,
        t_fwd_s=t_fwd_s, t_bwd_s=t_bwd_s, t_wgrad_s=t_wgrad_s, p2p_s=p2p_s,
    )
    work = (_per_chunk(t_fwd_s, pp, v, "t_fwd_s") + _per_chunk(t_bwd_s, pp, v, "t_bwd_s")
            + _per_chunk(t_wgrad_s, pp, v, "t_wgrad_s"))
    ideal = m * float(work.reshape(v, pp).sum(axis=0).max())
    return (total - ideal) / ideal


def inflight_microbatches(
    schedule: str, *, pp: int, stage: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """Peak micro-batches whose activations rank ``stage`` holds, in whole-stage units (chunks / v).

    Closed forms of the orders above (``tests/test_pipeline.py`` walks the orders to check them):
    GPipe ``m``; 1F1B ``min(m, p - r)``; interleaved ``(warm-up + 1) / v``, which is ``p (1 + (p-1)/(p v))``
    on the first rank (SC21); zero-bubble holds a micro-batch until its W: ``warm-up + 1 + r`` chunks.
    """
    m, v, r = num_microbatches, virtual_stages, stage
    check_schedule(schedule, pp=pp, num_microbatches=m, virtual_stages=v)
    if not 0 <= r < pp:
        raise ConfigError(f"stage={r} is not a pipeline rank of pp={pp}; use 0..{pp - 1}")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - r))
    zb = schedule == "zero-bubble"
    warm = _warmup_ops(r, pp=pp, v=v, m=m, factor=1 if zb else 2)
    steady = m * v - warm
    if steady <= 0:
        return float(m)
    peak = warm + 1 + (min(r, steady - 1) if zb else 0)
    return min(peak, m * v) / v


def walk_inflight(orders: Sequence[Sequence[Action]], *, rank: int, virtual_stages: int, split: bool) -> float:
    """Peak in-flight micro-batches of one rank by walking its order (the reference for the closed form)."""
    held = peak = 0
    for a in orders[rank]:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif (a.kind == "W") == split:
            held -= 1
    return peak / virtual_stages


def inflight_array(schedule: str, *, pp: int, num_microbatches: int, virtual_stages: int = 1) -> np.ndarray:
    """``inflight_microbatches`` of every rank at once, shape (pp,) (the step model's vectorized form)."""
    m, v = num_microbatches, virtual_stages
    check_schedule(schedule, pp=pp, num_microbatches=m, virtual_stages=v)
    r = np.arange(pp)
    if schedule == "gpipe":
        return np.full(pp, float(m))
    if schedule == "1f1b":
        return np.minimum(m, pp - r).astype(float)
    zb = schedule == "zero-bubble"
    per_round = m // max(1, m // pp)
    warm = np.minimum((v - 1) * per_round + (1 if zb else 2) * (pp - 1 - r), m * v)
    steady = m * v - warm
    peak = warm + 1 + (np.minimum(r, np.maximum(steady - 1, 0)) if zb else 0)
    return np.where(steady <= 0, float(m), np.minimum(peak, m * v) / v)
