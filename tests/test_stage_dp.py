"""Stage DP: equals brute force over every cut on small random inputs; memory limits; infeasibility."""

import numpy as np
import pytest

from costmodel.errors import InfeasiblePlanError
from planner.search.stage_dp import brute_force_stages, evaluate_cuts, make_problem, solve_stages


def _random_problem(rng, *, per_stage_times: bool):
    L = int(rng.integers(2, 9))
    S = int(rng.integers(1, min(L, 4) + 1))
    m = int(rng.integers(1, 9))
    shape = (S, L) if per_stage_times else (L,)
    t = rng.uniform(0.1, 2.0, size=shape)
    static = rng.uniform(0.0, 3.0, size=shape)
    act = rng.uniform(0.0, 1.0, size=shape)
    inflight = [float(min(S - s, m)) for s in range(S)]
    # limits between "almost nothing fits" and "everything fits"
    limit = float(rng.uniform(1.0, 3.0 * (static.sum() / S + act.sum())))
    return make_problem(
        layer_time_s=t, layer_static_bytes=static, layer_act_bytes=act, num_stages=S, num_microbatches=m,
        inflight=inflight, memory_limit_bytes=limit, stage_overhead_s=float(rng.uniform(0, 0.3)),
    )


@pytest.mark.parametrize("per_stage_times", [False, True])
def test_dp_equals_brute_force_on_random_inputs(per_stage_times):
    rng = np.random.default_rng(1234 + per_stage_times)
    solved = infeasible = 0
    for _ in range(300):
        p = _random_problem(rng, per_stage_times=per_stage_times)
        ref = brute_force_stages(p)
        if ref is None:
            with pytest.raises(InfeasiblePlanError, match="GB per device"):
                solve_stages(p)
            infeasible += 1
            continue
        sol = solve_stages(p)
        assert sum(sol.stage_layers) == p.num_layers and min(sol.stage_layers) >= 1
        assert sol.objective_s == pytest.approx(ref.objective_s, rel=1e-12)
        assert all(m <= lim * (1 + 1e-12) for m, lim in zip(sol.stage_memory_bytes, p.memory_limit_bytes))
        solved += 1
    # the generator must exercise both branches
    assert solved > 100 and infeasible > 10


def test_embedding_and_head_pull_layers_out_of_their_stages():
    # heavy head (3x a layer): the last stage should get fewer transformer layers than the others
    t = [0.5] + [1.0] * 12 + [3.0]
    p = make_problem(layer_time_s=t, layer_static_bytes=[0] * 14, layer_act_bytes=[0] * 14, num_stages=4,
                     num_microbatches=16, inflight=[4, 3, 2, 1], memory_limit_bytes=1.0)
    sol = solve_stages(p)
    assert sol.stage_layers[-1] < sol.stage_layers[1]
    even = evaluate_cuts(p, (4, 3, 3, 4))
    assert sol.objective_s < even.objective_s
    assert max(sol.stage_time_s) == pytest.approx(4.0)


def test_memory_limit_moves_layers_to_later_stages():
    # 1F1B: stage 0 holds 4 micro-batches of activations, stage 3 one; equal times would give (2,2,2,2)
    p = make_problem(layer_time_s=[1.0] * 8, layer_static_bytes=[1.0] * 8, layer_act_bytes=[1.0] * 8,
                     num_stages=4, num_microbatches=8, inflight=[4, 3, 2, 1], memory_limit_bytes=8.0)
    sol = solve_stages(p)
    assert sol.stage_layers[0] == 1 and sum(sol.stage_layers) == 8
    assert max(sol.stage_memory_bytes) <= 8.0


def test_too_many_stages_is_a_typed_error():
    p = make_problem(layer_time_s=[1.0] * 3, layer_static_bytes=[0] * 3, layer_act_bytes=[0] * 3, num_stages=4,
                     num_microbatches=4, inflight=[1] * 4, memory_limit_bytes=1.0)
    with pytest.raises(InfeasiblePlanError, match="choose between 1 and 3"):
        solve_stages(p)


def test_large_instance_cuts_every_layer():
    """130 layers on 64 stages (its speed: ``python -m benchmarks.stage_dp_speed``)."""
    L, S = 130, 64
    p = make_problem(layer_time_s=[0.2] + [1.0] * (L - 2) + [0.4], layer_static_bytes=[1.0] * L,
                     layer_act_bytes=[0.1] * L, num_stages=S, num_microbatches=96,
                     inflight=[float(S - s) for s in range(S)], memory_limit_bytes=10.0)
    sol = solve_stages(p)
    assert sum(sol.stage_layers) == L and len(sol.stage_layers) == S and min(sol.stage_layers) >= 1


# --- layer counts per chunk for interleaved / zero-bubble pipelines (planner.search.interleaved_dp) -----------


def _random_count_problem(rng):
    from planner.search.interleaved_dp import CountProblem

    p, v = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    n = p * v + int(rng.integers(0, 6))
    sparse = rng.random(p * v) < 0.5  # fixed chunk times (embedding, head) on some chunks only
    lows = [1] * (p * v)
    if rng.random() < 0.5:  # the embedding's and the head's chunks may hold nothing else
        lows[0] = lows[-1] = 0
    return CountProblem(min_per_chunk=tuple(lows),
        num_layers=n, virtual_stages=v, layer_time_s=tuple(rng.uniform(0.3, 2.0, p)),
        chunk_time_s=tuple(rng.uniform(0.0, 2.0, p * v) * sparse), pace=float(rng.integers(1, 9)),
        bubble_weight=tuple(rng.uniform(0.0, 1.5, p)), rank_bytes=tuple(rng.uniform(0.0, 2.0, p)),
        layer_bytes=tuple(rng.uniform(0.5, 1.5, p)), memory_limit_bytes=tuple(rng.uniform(1.0, 1.0 + 1.5 * n, p)),
    )


def test_count_dp_equals_brute_force_on_random_inputs():
    from planner.search.interleaved_dp import brute_force_counts, evaluate_counts, solve_counts

    rng = np.random.default_rng(99)
    solved = infeasible = 0
    for _ in range(300):
        p = _random_count_problem(rng)
        ref = brute_force_counts(p)
        if ref is None:
            with pytest.raises(InfeasiblePlanError, match="GB over its limit"):
                solve_counts(p)
            infeasible += 1
            continue
        sol = solve_counts(p)
        lows = p.lows().reshape(-1)
        assert sum(sol.chunk_layers) == p.num_layers and all(k >= lo for k, lo in zip(sol.chunk_layers, lows))
        assert sol.objective_s == pytest.approx(ref.objective_s, rel=1e-12)
        assert evaluate_counts(p, sol.chunk_layers)[2]
        solved += 1
    assert solved > 100 and infeasible > 10


def test_count_dp_balances_interleaved_ranks_of_different_speed():
    """Rank 1 twice as fast, 2 chunks per rank: it takes about twice the layers, split over its chunks."""
    from planner.search.interleaved_dp import CountProblem, solve_counts

    p = CountProblem(num_layers=12, virtual_stages=2, layer_time_s=(2.0, 1.0), chunk_time_s=(0.0,) * 4, pace=8.0,
                     bubble_weight=(1.0, 0.0), rank_bytes=(0.0, 0.0), layer_bytes=(1.0, 1.0),
                     memory_limit_bytes=(100.0, 100.0))
    sol = solve_counts(p)
    assert sol.chunk_layers == (2, 4, 2, 4) and sol.rank_time_s == (8.0, 8.0)


def test_count_dp_gives_a_heavy_head_a_chunk_of_its_own():
    """Interleaved, 2 ranks x 2 chunks, the head as heavy as three layers: the last chunk holds only the head."""
    from planner.search.interleaved_dp import CountProblem, solve_counts

    p = CountProblem(num_layers=7, virtual_stages=2, layer_time_s=(1.0, 1.0), chunk_time_s=(0.0, 0.0, 0.0, 3.0),
                     pace=8.0, bubble_weight=(1.0, 0.0), rank_bytes=(0.0, 0.0), layer_bytes=(1.0, 1.0),
                     memory_limit_bytes=(100.0, 100.0), min_per_chunk=(0, 1, 1, 0))
    sol = solve_counts(p)
    assert sol.chunk_layers[-1] == 0 and sol.rank_time_s == (5.0, 5.0)
