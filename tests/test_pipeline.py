"""costmodel.pipeline: torch's action orders, the closed forms against the event simulation, in-flight counts."""

import itertools

import numpy as np
import pytest

from costmodel import pipeline as P
from costmodel.errors import ConfigError


def _torch_orders(schedule: str, pp: int, m: int, v: int):
    from torch.distributed.pipelining import schedules as S

    kind = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B",
            S._ComputationType.BACKWARD_INPUT: "B", S._ComputationType.BACKWARD_WEIGHT: "W"}
    if schedule in ("gpipe", "1f1b"):
        s = object.__new__(S.ScheduleGPipe if schedule == "gpipe" else S.Schedule1F1B)
        s._num_stages, s._n_microbatches = pp, m
        order = s._get_pipeline_order()
    else:
        cls = S.ScheduleInterleaved1F1B if schedule == "interleaved-1f1b" else S.ScheduleInterleavedZeroBubble
        s = object.__new__(cls)
        s.pp_group_size, s.n_local_stages, s._n_microbatches = pp, v, m
        s.number_of_rounds = max(1, m // pp)
        s.microbatches_per_round = m // s.number_of_rounds
        order = {r: s._calculate_single_rank_operations(r) for r in range(pp)}
    return [tuple(P.Action(chunk=a.stage_index, kind=kind[a.computation_type], microbatch=a.microbatch_index)
                  for a in order[r] if a is not None and a.computation_type in kind) for r in range(pp)]


@pytest.mark.parametrize("schedule", P.SCHEDULES)
def test_orders_match_torch(schedule):
    checked = 0
    for pp, m, v in itertools.product((1, 2, 3, 4), (4, 8, 12), (1, 2, 3)):
        if (schedule in ("gpipe", "1f1b") and v > 1) or m % pp:
            continue
        mine = list(P.rank_orders(schedule, pp=pp, num_microbatches=m, virtual_stages=v))
        want = _torch_orders(schedule, pp, m, v)
        if schedule == "1f1b":
            # torch's Schedule1F1B._get_pipeline_order (a visualisation) numbers the last rank's forwards from 1;
            # what runs is _step_microbatches, whose order (ported) the other ranks of the same layout show
            mine, want = mine[:-1], want[:-1]
        assert mine == want, (schedule, pp, m, v)
        checked += 1
    assert checked >= 8


def _sim_time(schedule, **kw):
    return P.simulated_time_s(P.simulate(schedule, **kw))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(1, 4), (2, 4), (4, 8), (4, 16), (8, 8)])
def test_equal_stages_closed_form(schedule, pp, m):
    tf, tb = 1.0, 2.0
    want = (m + pp - 1) * (tf + tb)
    assert _sim_time(schedule, pp=pp, num_microbatches=m, t_fwd_s=tf, t_bwd_s=tb) == pytest.approx(want)
    assert P.pipeline_time_s(schedule, pp=pp, num_microbatches=m, t_fwd_s=tf, t_bwd_s=tb) == pytest.approx(want)
    assert P.bubble_fraction(schedule, pp=pp, num_microbatches=m) == pytest.approx((pp - 1) / m)


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 3), (8, 16, 2), (4, 4, 4)])
def test_interleaved_bubble(pp, m, v):
    tf, tb = 1.0 / v, 2.0 / v  # chunk times: a rank's work per micro-batch stays 3
    sim = _sim_time("interleaved-1f1b", pp=pp, num_microbatches=m, virtual_stages=v, t_fwd_s=tf, t_bwd_s=tb)
    ideal = m * 3.0
    assert (sim - ideal) / ideal == pytest.approx((pp - 1) / (v * m))
    assert P.bubble_fraction("interleaved-1f1b", pp=pp, num_microbatches=m, virtual_stages=v, t_fwd_s=tf,
                             t_bwd_s=tb) == pytest.approx((pp - 1) / (v * m))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("tf,tb,tw", [(1.0, 1.0, 1.0), (1.0, 1.2, 0.6), (1.0, 1.0, 0.3)])
def test_zero_bubble_h1(pp, m, tf, tb, tw):
    sim = _sim_time("zero-bubble", pp=pp, num_microbatches=m, t_fwd_s=tf, t_bwd_s=tb, t_wgrad_s=tw)
    want = m * (tf + tb + tw) + (pp - 1) * (tf + tb - tw)  # Qi et al. 2024, ZB-H1
    assert sim == pytest.approx(want)
    assert P.pipeline_time_s("zero-bubble", pp=pp, num_microbatches=m, t_fwd_s=tf, t_bwd_s=tb,
                             t_wgrad_s=tw) == pytest.approx(want)
    one_f1b = _sim_time("1f1b", pp=pp, num_microbatches=m, t_fwd_s=tf, t_bwd_s=tb, t_wgrad_s=tw)
    assert sim < one_f1b  # same work, smaller bubble


def test_unequal_stages_and_p2p_close_to_simulation():
    rng = np.random.default_rng(0)
    for schedule, pp, m, v in [("gpipe", 4, 8, 1), ("1f1b", 4, 16, 1), ("1f1b", 8, 32, 1),
                               ("interleaved-1f1b", 4, 16, 2), ("zero-bubble", 4, 16, 1)]:
        scale = rng.uniform(0.8, 1.25, pp * v)
        kw = dict(pp=pp, num_microbatches=m, virtual_stages=v, t_fwd_s=scale, t_bwd_s=2 * scale,
                  t_wgrad_s=0.5 * scale if schedule == "zero-bubble" else 0.0, p2p_s=0.02)
        sim, closed = _sim_time(schedule, **kw), P.pipeline_time_s(schedule, **kw)
        assert closed == pytest.approx(sim, rel=0.08), schedule
    # the slowest stage paces 1F1B: sum of stages + (m-1) max bounds the simulation from above, closely
    t = np.array([1.0, 2.0, 1.5])
    got = _sim_time("1f1b", pp=3, num_microbatches=6, t_fwd_s=t / 3, t_bwd_s=2 * t / 3)
    assert got <= t.sum() + 5 * t.max() <= 1.05 * got
    assert got >= 6 * t.max()  # the slowest stage does 6 micro-batches


def test_inflight_counts():
    pp, m = 4, 16
    assert [P.inflight_microbatches("gpipe", pp=pp, stage=r, num_microbatches=m) for r in range(pp)] == [16.0] * 4
    assert [P.inflight_microbatches("1f1b", pp=pp, stage=r, num_microbatches=m) for r in range(pp)] == [4, 3, 2, 1]
    for v in (2, 4):
        got = P.inflight_microbatches("interleaved-1f1b", pp=pp, stage=0, num_microbatches=m, virtual_stages=v)
        assert got == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))  # SC21 / Korthikanti
    assert all(P.inflight_microbatches("zero-bubble", pp=pp, stage=r, num_microbatches=m) == pp for r in range(pp))
    for schedule, v in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zero-bubble", 2)]:
        orders = P.rank_orders(schedule, pp=pp, num_microbatches=m, virtual_stages=v)
        for r in range(pp):
            walked = P.walk_inflight(orders, rank=r, virtual_stages=v, split=schedule == "zero-bubble")
            assert walked == P.inflight_microbatches(schedule, pp=pp, stage=r, num_microbatches=m,
                                                     virtual_stages=v)
    for schedule, pp, m, v in itertools.product(P.SCHEDULES, (1, 2, 4, 8), (8, 16, 32), (1, 2, 4)):
        if schedule in ("gpipe", "1f1b") and v > 1:
            continue
        arr = P.inflight_array(schedule, pp=pp, num_microbatches=m, virtual_stages=v)
        one = [P.inflight_microbatches(schedule, pp=pp, stage=r, num_microbatches=m, virtual_stages=v)
               for r in range(pp)]
        assert arr.tolist() == pytest.approx(one), (schedule, pp, m, v)


def test_events_are_consistent():
    ev = P.simulate("interleaved-1f1b", pp=2, num_microbatches=4, virtual_stages=2, t_fwd_s=1.0,
                           t_bwd_s=2.0, p2p_s=0.1)
    assert len(ev) == 2 * 2 * 4 * 2
    for stage in range(2):
        mine = sorted((e for e in ev if e.stage == stage), key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))  # one op at a time per rank
    assert {e.chunk for e in ev} == {0, 1}


@pytest.mark.parametrize("kw,match", [
    (dict(schedule="1f1b", pp=4, num_microbatches=2, virtual_stages=1), "num_microbatches >= pp"),
    (dict(schedule="interleaved-1f1b", pp=4, num_microbatches=6, virtual_stages=2), "use 4 or 8"),
    (dict(schedule="gpipe", pp=2, num_microbatches=4, virtual_stages=2), "virtual_stages=1"),
    (dict(schedule="pipedream", pp=2, num_microbatches=4, virtual_stages=1), "choose one of"),
])
def test_invalid_schedules(kw, match):
    with pytest.raises(ConfigError, match=match):
        P.check_schedule(kw.pop("schedule"), **kw)
