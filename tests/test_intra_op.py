"""The intra-op sharding ILP against brute force, and the block strategies it picks on transformer blocks."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from costmodel.errors import ConfigError, InfeasiblePlanError
from planner.search.intra_op import (
    ShardingEdge,
    ShardingProblem,
    SolverOptions,
    evaluate,
    greedy_choice,
    memory_of,
    min_memory_bytes,
    solve,
)

# --- random instances vs brute force ------------------------------------------------------------------------


def _edge_cost(rng: random.Random, k: int, l: int, forbid: bool) -> float:
    if forbid and (k, l) != (0, 0) and rng.random() < 0.25:
        return math.inf  # a forbidden layout pair; strategy 0 everywhere (replicate) stays feasible
    return rng.choice([0.0, rng.random() * 2e-3])


def random_problem(rng: random.Random, *, n: int, dag: bool, budget_frac: float | None,
                   forbid: bool = False) -> ShardingProblem:
    ks = [rng.randint(2, 4) for _ in range(n)]
    pairs = [(i, i + 1) for i in range(n - 1)]
    if dag:  # extra forward edges (skip connections, fan-out) on top of the chain
        for _ in range(n):
            a, b = sorted(rng.sample(range(n), 2))
            if (a, b) not in pairs:
                pairs.append((a, b))
    mem = tuple(tuple(float(rng.randint(1, 100)) for _ in range(k)) for k in ks)
    lo, hi = sum(min(m) for m in mem), sum(max(m) for m in mem)
    return ShardingProblem(
        op_names=tuple(f"op{i}" for i in range(n)),
        strategy_names=tuple(tuple(f"k{k}" for k in range(kk)) for kk in ks),
        compute_s=tuple(tuple(rng.random() * 1e-3 for _ in range(k)) for k in ks),
        comm_s=tuple(tuple(rng.choice([0.0, rng.random() * 5e-4]) for _ in range(k)) for k in ks),
        memory_bytes=mem,
        edges=tuple(
            ShardingEdge(src=a, dst=b, cost_s=tuple(
                tuple(_edge_cost(rng, k, l, forbid) for l in range(ks[b])) for k in range(ks[a])))
            for a, b in pairs
        ),
        memory_budget_bytes=math.inf if budget_frac is None else lo + (hi - lo) * budget_frac,
    )


def brute_force(p: ShardingProblem) -> tuple[float, tuple[int, ...]]:
    best, arg = math.inf, ()
    for c in itertools.product(*[range(len(s)) for s in p.strategy_names]):
        if memory_of(p, c) <= p.memory_budget_bytes:
            v = evaluate(p, c)
            if v < best:
                best, arg = v, c
    return best, arg


@pytest.mark.parametrize("dag", [False, True], ids=["chain", "dag"])
@pytest.mark.parametrize("backend", ["SCIP", "CBC"])
def test_ilp_matches_brute_force(dag: bool, backend: str) -> None:
    rng = random.Random(17 + dag)
    for trial in range(12):
        budget = None if trial % 3 == 0 else rng.uniform(0.05, 0.7)
        p = random_problem(rng, n=rng.randint(6, 9), dag=dag, budget_frac=budget, forbid=trial % 2 == 1)
        best, _ = brute_force(p)
        if math.isinf(best):  # the budget and the forbidden pairs leave nothing: the solver must say so
            with pytest.raises(InfeasiblePlanError):
                solve(p, SolverOptions(backend=backend))
            continue
        sol = solve(p, SolverOptions(backend=backend, time_limit_s=30))
        assert sol.status == "optimal"
        assert abs(sol.objective - best) <= 1e-9, (trial, sol.objective, best)
        assert sol.objective == pytest.approx(evaluate(p, sol.choice), abs=0)
        assert sol.memory_bytes <= p.memory_budget_bytes
        assert sol.gap == 0.0 and sol.bound <= sol.objective + 1e-12


def test_memory_budget_changes_the_choice() -> None:
    # Two ops: the fast strategy needs more memory; a tight budget forces the slow one on the cheaper op.
    p = ShardingProblem(
        op_names=("a", "b"), strategy_names=(("fast", "small"), ("fast", "small")),
        compute_s=((1.0, 3.0), (1.0, 2.0)), comm_s=((0.0, 0.0), (0.0, 0.0)),
        memory_bytes=((10.0, 1.0), (10.0, 1.0)), memory_budget_bytes=11.0,
    )
    sol = solve(p, SolverOptions())
    assert sol.choice == (0, 1) and sol.objective == 3.0 and sol.memory_bytes == 11.0
    free = solve(ShardingProblem(**{**_fields(p), "memory_budget_bytes": math.inf}), SolverOptions())
    assert free.choice == (0, 0) and free.objective == 2.0


def _fields(p: ShardingProblem) -> dict:
    return {f: getattr(p, f) for f in p.__slots__}


def test_infeasible_budget_names_minimum_memory() -> None:
    p = random_problem(random.Random(3), n=7, dag=True, budget_frac=0.5)
    need = min_memory_bytes(p)
    tight = ShardingProblem(**{**_fields(p), "memory_budget_bytes": need * 0.99})
    with pytest.raises(InfeasiblePlanError) as e:
        solve(tight, SolverOptions())
    assert f"{need / 2**30:.3f} GiB" in str(e.value)
    exact = solve(ShardingProblem(**{**_fields(p), "memory_budget_bytes": need}), SolverOptions())
    assert exact.memory_bytes == need


def test_greedy_is_feasible_and_no_better_than_optimum() -> None:
    rng = random.Random(5)
    for _ in range(10):
        p = random_problem(rng, n=8, dag=True, budget_frac=rng.uniform(0.0, 0.5))
        g = greedy_choice(p)
        assert memory_of(p, g) <= p.memory_budget_bytes
        assert evaluate(p, g) >= solve(p, SolverOptions()).objective - 1e-12


def test_malformed_problem_and_options_are_config_errors() -> None:
    p = random_problem(random.Random(1), n=6, dag=False, budget_frac=None)
    bad = ShardingProblem(**{**_fields(p), "compute_s": p.compute_s[:-1]})
    with pytest.raises(ConfigError, match="compute_s has 5 rows for 6 ops"):
        solve(bad, SolverOptions())
    neg = ShardingProblem(**{**_fields(p), "comm_s": ((-1.0,) * len(p.comm_s[0]),) + p.comm_s[1:]})
    with pytest.raises(ConfigError, match="finite and >= 0"):
        solve(neg, SolverOptions())
    with pytest.raises(ConfigError, match="backend 'GUROBI'"):
        solve(p, SolverOptions(backend="GUROBI"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="time_limit_s=0"):
        solve(p, SolverOptions(time_limit_s=0))


def test_seed_threads_and_determinism() -> None:
    p = random_problem(random.Random(9), n=9, dag=True, budget_frac=0.3)
    a = solve(p, SolverOptions(seed=1, threads=1))
    b = solve(p, SolverOptions(seed=1, threads=1))
    c = solve(p, SolverOptions(seed=7, threads=2, backend="SCIP"))
    assert a.choice == b.choice and a.objective == c.objective
