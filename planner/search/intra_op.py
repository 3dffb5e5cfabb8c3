"""The intra-op sharding ILP: one strategy per op, resharding costs on edges, a memory budget.

This module is pure: a ``ShardingProblem`` holds ints, floats and tuples only; no FX node, torch or OR-Tools
object crosses its boundary (``planner.search.strategies`` builds problems from traced blocks). The
formulation is the one of Alpa (Zheng et al., OSDI 2022, Sec. 4.2) with an explicit memory budget.

Data
    ops ``i = 0..n-1``; op ``i`` has strategies ``k in K_i`` with time ``c_{i,k} = compute_s[i][k] +
    comm_s[i][k]`` (seconds: its own compute and the collectives it issues, forward + backward) and memory
    ``m_{i,k}`` (bytes per device: its parameter shard, gradients, optimizer state and stored activations);
    directed edges ``(i, j) in E`` with a resharding time ``r_{ij,k,l} >= 0`` (seconds) for converting the
    layout produced by ``i`` under ``k`` into the layout op ``j`` needs under ``l`` (forward conversion plus
    its backward dual), ``r = +inf`` where no conversion exists (a forbidden pair ``F``); a memory budget
    ``M`` (bytes).

Variables
    ``s_{i,k} in {0, 1}``          op ``i`` uses strategy ``k``;
    ``e_{ij,k,l} in [0, 1]``       edge ``(i, j)`` is in state ``(k, l)``.
    The ``e`` need not be declared integer: with ``s`` integral the two edge-consistency families force
    ``e_{ij,k,l} = s_{i,k} s_{j,l}`` (row ``k*`` is the only non-zero row, column ``l*`` the only non-zero
    column).

Constraints
    (one strategy)       ``sum_k s_{i,k} = 1``                                   for every op ``i``
                         -- ``_add_one_strategy_constraints``
    (edge consistency)   ``sum_l e_{ij,k,l} = s_{i,k}`` for all ``k``, ``sum_k e_{ij,k,l} = s_{j,l}`` for all
                         ``l``                                                    for every edge ``(i, j)``
                         -- ``_add_edge_consistency_constraints``
    (memory budget)      ``sum_i sum_k m_{i,k} s_{i,k} <= M``
                         -- ``_add_memory_constraint``
    (forbidden pairs)    ``e_{ij,k,l} = 0``                                  for ``(i, j, k, l) in F``
                         -- ``_add_edge_variables`` (upper bound 0)

Objective
    ``min  sum_i sum_k c_{i,k} s_{i,k} + sum_{(i,j) in E} sum_{k,l} r_{ij,k,l} e_{ij,k,l}``
    -- ``_set_objective``

Reductions before the model is built (exact): an edge whose matrix is all zero is dropped; an edge with a
single-strategy endpoint is folded into the other endpoint's cost vector.

The memory constraint is separable, so ``M < sum_i min_k m_{i,k}`` is detected before solving and raised
as ``InfeasiblePlanError`` naming that minimum; an instance whose forbidden pairs leave no assignment is
reported the same way by the solver's status. The model is warm-started (``SetHint``) from a greedy plan
(``greedy_choice``); if the time limit expires before the solver finds any solution the greedy plan is
returned with status ``"greedy"``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Literal, Sequence

from costmodel.errors import ConfigError, InfeasiblePlanError

log = logging.getLogger(__name__)

Backend = Literal["CBC", "SCIP", "HIGHS"]
BACKENDS = ("CBC", "SCIP", "HIGHS")
SolveStatus = Literal["optimal", "feasible", "greedy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingEdge:
    """A data dependence ``src -> dst`` between two ops and its resharding times."""

    src: int
    dst: int
    cost_s: tuple[tuple[float, ...], ...]
    """``cost_s[k][l]``: seconds to convert ``src``'s layout under its strategy ``k`` to what ``dst`` needs under
    its strategy ``l`` (forward conversion + backward dual); ``math.inf`` forbids the pair."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingProblem:
    """A pure description of one block's sharding choice (see the module docstring for the math)."""

    op_names: tuple[str, ...]
    strategy_names: tuple[tuple[str, ...], ...]
    """``strategy_names[i][k]``: a label of op ``i``'s strategy ``k`` (unique within the op)."""
    compute_s: tuple[tuple[float, ...], ...]
    """Compute time of op ``i`` under strategy ``k`` (forward + backward), seconds."""
    comm_s: tuple[tuple[float, ...], ...]
    """Communication op ``i`` issues itself under strategy ``k`` (forward + backward), seconds."""
    memory_bytes: tuple[tuple[float, ...], ...]
    """Bytes per device op ``i`` holds under strategy ``k``."""
    edges: tuple[ShardingEdge, ...] = ()
    memory_budget_bytes: float = math.inf

    @property
    def num_ops(self) -> int:
        return len(self.op_names)


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverOptions:
    time_limit_s: float = 10.0
    """Wall-clock limit of one solve; the best solution found so far is returned when it expires."""
    threads: int = 1
    seed: int = 0
    """Random seed (SCIP's randomseedshift; CBC and HiGHS are deterministic for a fixed thread count)."""
    backend: Backend = "CBC"
    """CBC: fastest here on transformer blocks (~20 ms for a GPT-3 block at tp=8, SCIP ~35 ms). SCIP honours
    ``seed``. HiGHS ignores the warm start (its SetHint crashes in OR-Tools 9.15) and prints a banner."""
    relative_gap: float = 0.0
    """Relative MIP gap at which the solver may stop (0: prove optimality)."""
    warm_start: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingSolution:
    choice: tuple[int, ...]
    """``choice[i]``: the strategy index op ``i`` uses."""
    objective: float
    """Objective of ``choice``, evaluated exactly from the problem data (seconds)."""
    bound: float
    """The solver's best lower bound on the optimum (seconds)."""
    gap: float
    """``(objective - bound) / objective`` (0 when proven optimal)."""
    status: SolveStatus
    solve_time_s: float
    memory_bytes: float
    """Memory of ``choice`` (bytes per device)."""
    num_variables: int = 0
    num_constraints: int = 0

    def strategy_of(self, problem: ShardingProblem, op: int) -> str:
        return problem.strategy_names[op][self.choice[op]]


# --- evaluation (shared by the solver, the greedy plan and the tests) ---------------------------------------


def evaluate(problem: ShardingProblem, choice: Sequence[int]) -> float:
    """The objective of a full assignment: op times plus resharding times on every edge."""
    total = 0.0
    for i, k in enumerate(choice):
        total += problem.compute_s[i][k] + problem.comm_s[i][k]
    for e in problem.edges:
        total += e.cost_s[choice[e.src]][choice[e.dst]]
    return total


def memory_of(problem: ShardingProblem, choice: Sequence[int]) -> float:
    return float(sum(problem.memory_bytes[i][k] for i, k in enumerate(choice)))


def min_memory_bytes(problem: ShardingProblem) -> float:
    """The least memory any assignment needs (the memory constraint is separable over ops)."""
    return float(sum(min(m) for m in problem.memory_bytes))


def validate_problem(problem: ShardingProblem) -> None:
    """Raise ``ConfigError`` naming the first malformed entry of ``problem``."""
    n = problem.num_ops
    for field in ("strategy_names", "compute_s", "comm_s", "memory_bytes"):
        if len(getattr(problem, field)) != n:
            raise ConfigError(
                f"ShardingProblem.{field} has {len(getattr(problem, field))} rows for {n} ops; give one per op"
            )
    for i in range(n):
        ks = len(problem.strategy_names[i])
        if ks == 0:
            raise ConfigError(f"op {problem.op_names[i]!r} has no candidate strategy; give at least one")
        for field in ("compute_s", "comm_s", "memory_bytes"):
            row = getattr(problem, field)[i]
            if len(row) != ks:
                raise ConfigError(
                    f"op {problem.op_names[i]!r}: {field} has {len(row)} entries for {ks} strategies"
                )
            if any(not math.isfinite(v) or v < 0 for v in row):
                raise ConfigError(f"op {problem.op_names[i]!r}: {field}={row} must be finite and >= 0")
    for e in problem.edges:
        if not (0 <= e.src < n and 0 <= e.dst < n) or e.src == e.dst:
            raise ConfigError(f"edge {e.src}->{e.dst} is not between two distinct ops of 0..{n - 1}")
        ks, kd = len(problem.strategy_names[e.src]), len(problem.strategy_names[e.dst])
        if len(e.cost_s) != ks or any(len(row) != kd for row in e.cost_s):
            raise ConfigError(f"edge {e.src}->{e.dst}: cost matrix must be {ks} x {kd}")
        if any(math.isnan(v) or v < 0 for row in e.cost_s for v in row):
            raise ConfigError(f"edge {e.src}->{e.dst}: resharding costs must be >= 0 (math.inf forbids a pair)")
    if math.isnan(problem.memory_budget_bytes) or problem.memory_budget_bytes < 0:
        raise ConfigError(f"memory_budget_bytes={problem.memory_budget_bytes} must be >= 0")


# --- greedy warm start --------------------------------------------------------------------------------------


def greedy_choice(problem: ShardingProblem) -> tuple[int, ...]:
    """An assignment: ops in the given order pick their cheapest strategy given the already chosen neighbours;
    then, while over the memory budget, the switch saving memory at the least time per byte. It is feasible
    unless forbidden pairs trap it (``evaluate`` is then ``inf``)."""
    n = problem.num_ops
    nbrs: list[list[ShardingEdge]] = [[] for _ in range(n)]
    for e in problem.edges:
        nbrs[e.src].append(e)
        nbrs[e.dst].append(e)
    choice = [-1] * n
    for i in range(n):
        costs = [_local_cost(problem, nbrs[i], choice, i, k) for k in range(len(problem.strategy_names[i]))]
        choice[i] = min(range(len(costs)), key=costs.__getitem__)
    return tuple(_repair_memory(problem, nbrs, choice))


def _local_cost(problem: ShardingProblem, edges: Sequence[ShardingEdge], choice: Sequence[int], i: int,
                k: int) -> float:
    """Cost of op ``i`` under ``k`` plus its edges to the neighbours already chosen (``choice >= 0``)."""
    c = problem.compute_s[i][k] + problem.comm_s[i][k]
    for e in edges:
        if e.src == i and choice[e.dst] >= 0:
            c += e.cost_s[k][choice[e.dst]]
        elif e.dst == i and choice[e.src] >= 0:
            c += e.cost_s[choice[e.src]][k]
    return c


def _repair_memory(problem: ShardingProblem, nbrs: list[list[ShardingEdge]], choice: list[int]) -> list[int]:
    memory = memory_of(problem, choice)
    while memory > problem.memory_budget_bytes:
        best: tuple[float, int, int] | None = None
        for i, k0 in enumerate(choice):
            here = _local_cost(problem, nbrs[i], choice, i, k0)
            for k, m in enumerate(problem.memory_bytes[i]):
                saved = problem.memory_bytes[i][k0] - m
                if saved <= 0:
                    continue
                extra = _local_cost(problem, nbrs[i], choice, i, k) - here
                if math.isinf(extra) or math.isnan(extra):
                    continue
                if best is None or extra / saved < best[0]:
                    best = (extra / saved, i, k)
        if best is None:  # every op at its minimum memory, or only forbidden switches left
            break
        _, i, k = best
        memory -= problem.memory_bytes[i][choice[i]] - problem.memory_bytes[i][k]
        choice[i] = k
    return choice


# --- the ILP ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class _Reduced:
    """Per-op cost vectors with single-strategy edges folded in, and the edges that remain."""

    op_cost_s: tuple[tuple[float, ...], ...]
    edges: tuple[ShardingEdge, ...]


def _reduce(problem: ShardingProblem) -> _Reduced:
    cost = [
        [c + m for c, m in zip(problem.compute_s[i], problem.comm_s[i])] for i in range(problem.num_ops)
    ]
    kept = []
    for e in problem.edges:
        if all(v == 0.0 for row in e.cost_s for v in row):
            continue
        if len(e.cost_s) == 1:
            for l, v in enumerate(e.cost_s[0]):
                cost[e.dst][l] += v
        elif len(e.cost_s[0]) == 1:
            for k, row in enumerate(e.cost_s):
                cost[e.src][k] += row[0]
        else:
            kept.append(e)
    return _Reduced(op_cost_s=tuple(tuple(r) for r in cost), edges=tuple(kept))


def _create_solver(options: SolverOptions):
    from ortools.linear_solver import pywraplp

    if options.backend not in BACKENDS:
        raise ConfigError(f"solver backend {options.backend!r} is not supported; choose one of {BACKENDS}")
    solver = pywraplp.Solver.CreateSolver(options.backend)
    if solver is None:
        raise ConfigError(
            f"OR-Tools was built without the {options.backend} solver; choose another of {BACKENDS}"
        )
    if options.time_limit_s <= 0:
        raise ConfigError(f"time_limit_s={options.time_limit_s} must be > 0")
    if options.threads < 1:
        raise ConfigError(f"threads={options.threads} must be >= 1")
    solver.SetTimeLimit(max(1, int(options.time_limit_s * 1000)))
    solver.SetNumThreads(options.threads)
    if options.backend == "SCIP":
        solver.SetSolverSpecificParametersAsString(f"randomization/randomseedshift = {options.seed}\n")
    return solver


def _add_strategy_variables(solver, problem: ShardingProblem) -> list[list]:
    """s_{i,k} in {0,1}."""
    return [
        [solver.BoolVar(f"s_{i}_{k}") for k in range(len(problem.strategy_names[i]))]
        for i in range(problem.num_ops)
    ]


def _add_edge_variables(solver, edges: Sequence[ShardingEdge]) -> list[list[list]]:
    """e_{ij,k,l} in [0,1] (integral through the consistency constraints); forbidden pairs get bound 0."""
    return [
        [[solver.NumVar(0.0, 0.0 if math.isinf(v) else 1.0, f"e_{n}_{k}_{l}") for l, v in enumerate(row)]
         for k, row in enumerate(e.cost_s)]
        for n, e in enumerate(edges)
    ]


def _forbid_strategies(s, reduced: "_Reduced") -> None:
    """A strategy whose folded cost is inf (a forbidden pair with a single-strategy neighbour) is fixed to 0."""
    for i, row in enumerate(s):
        for k, var in enumerate(row):
            if math.isinf(reduced.op_cost_s[i][k]):
                var.SetUb(0.0)


# Rows are built with Constraint / SetCoefficient, not the operator API: ~10x faster on large instances.


def _add_one_strategy_constraints(solver, s: list[list]) -> None:
    """Every op picks exactly one strategy: sum_k s_{i,k} = 1."""
    for i, row in enumerate(s):
        ct = solver.Constraint(1.0, 1.0, f"one_strategy_{i}")
        for var in row:
            ct.SetCoefficient(var, 1.0)


def _add_edge_consistency_constraints(solver, s, e, edges: Sequence[ShardingEdge]) -> None:
    """The edge state agrees with both endpoints: rows of e sum to s_src, columns to s_dst."""
    for n, edge in enumerate(edges):
        for k, row in enumerate(e[n]):  # sum_l e_{kl} - s_{src,k} = 0
            ct = solver.Constraint(0.0, 0.0, f"edge_src_{n}_{k}")
            for var in row:
                ct.SetCoefficient(var, 1.0)
            ct.SetCoefficient(s[edge.src][k], -1.0)
        for l in range(len(e[n][0])):  # sum_k e_{kl} - s_{dst,l} = 0
            ct = solver.Constraint(0.0, 0.0, f"edge_dst_{n}_{l}")
            for k in range(len(e[n])):
                ct.SetCoefficient(e[n][k][l], 1.0)
            ct.SetCoefficient(s[edge.dst][l], -1.0)


def _add_memory_constraint(solver, s, problem: ShardingProblem) -> None:
    """Memory of the chosen strategies fits the budget: sum_{i,k} m_{i,k} s_{i,k} <= M."""
    if math.isinf(problem.memory_budget_bytes):
        return
    # Subtract the per-op minimum so the row has small coefficients (better conditioned, same feasible set),
    # in units of the slack so that they are near 1.
    slack = problem.memory_budget_bytes - min_memory_bytes(problem)
    unit = max(slack, 1.0)
    ct = solver.Constraint(-solver.infinity(), slack / unit, "memory_budget")
    for i, row in enumerate(problem.memory_bytes):
        floor = min(row)
        for k, m in enumerate(row):
            if m > floor:
                ct.SetCoefficient(s[i][k], (m - floor) / unit)


def _set_objective(solver, s, e, reduced: _Reduced, scale: float) -> None:
    """min sum c_{i,k} s_{i,k} + sum r_{ij,k,l} e_{ij,k,l}  (times ``scale``, see ``_objective_scale``)."""
    obj = solver.Objective()
    for i, row in enumerate(s):
        for k, var in enumerate(row):
            if not math.isinf(reduced.op_cost_s[i][k]):
                obj.SetCoefficient(var, reduced.op_cost_s[i][k] * scale)
    for n, edge in enumerate(reduced.edges):
        for k, row in enumerate(edge.cost_s):
            for l, v in enumerate(row):
                if v and not math.isinf(v):
                    obj.SetCoefficient(e[n][k][l], v * scale)
    obj.SetMinimization()


def _objective_scale(reduced: _Reduced) -> float:
    """Costs are seconds (1e-6..1e-1); MIP tolerances are absolute, so the largest coefficient becomes 1e6."""
    largest = max(
        [v for row in reduced.op_cost_s for v in row if not math.isinf(v)]
        + [v for e in reduced.edges for r in e.cost_s for v in r if not math.isinf(v)],
        default=0.0,
    )
    return 1e6 / largest if largest > 0 else 1.0


def solve(problem: ShardingProblem, options: SolverOptions | None = None) -> ShardingSolution:
    """Solve the sharding ILP of the module docstring.

    Raises ``InfeasiblePlanError`` when no assignment fits ``memory_budget_bytes`` (the message names the
    minimum memory), ``ConfigError`` for a malformed problem or options. A time limit that expires returns the
    best solution so far with ``status="feasible"`` (or the greedy plan with ``status="greedy"``).
    """
    options = options or SolverOptions()
    start = time.perf_counter()
    validate_problem(problem)
    _check_memory_feasible(problem)
    greedy = greedy_choice(problem)
    if all(len(names) == 1 for names in problem.strategy_names):  # nothing to choose (tp = 1)
        return _trivial(problem, greedy, start)
    reduced = _reduce(problem)
    solver = _create_solver(options)
    s = _add_strategy_variables(solver, problem)
    e = _add_edge_variables(solver, reduced.edges)
    _forbid_strategies(s, reduced)
    _add_one_strategy_constraints(solver, s)
    _add_edge_consistency_constraints(solver, s, e, reduced.edges)
    _add_memory_constraint(solver, s, problem)
    scale = _objective_scale(reduced)
    _set_objective(solver, s, e, reduced, scale)
    # Warm start from the greedy plan (not on HiGHS: its SetHint crashes in OR-Tools 9.15).
    if options.warm_start and options.backend != "HIGHS" and not math.isinf(evaluate(problem, greedy)):
        flat = [var for row in s for var in row]
        solver.SetHint(flat, [1.0 if greedy[i] == k else 0.0 for i, row in enumerate(s) for k in range(len(row))])
    status = _run(solver, options)
    return _solution(problem, solver, s, status=status, greedy=greedy, scale=scale, start=start)


def _trivial(problem: ShardingProblem, choice: tuple[int, ...], start: float) -> ShardingSolution:
    objective = evaluate(problem, choice)
    if math.isinf(objective):
        raise InfeasiblePlanError(f"the only assignment of the {problem.num_ops} ops has a forbidden layout pair")
    return ShardingSolution(choice=choice, objective=objective, bound=objective, gap=0.0, status="optimal",
                            solve_time_s=time.perf_counter() - start, memory_bytes=memory_of(problem, choice))


def _check_memory_feasible(problem: ShardingProblem) -> None:
    need = min_memory_bytes(problem)
    if need > problem.memory_budget_bytes:
        worst = max(range(problem.num_ops), key=lambda i: min(problem.memory_bytes[i]))
        raise InfeasiblePlanError(
            f"the block needs at least {need / 2**30:.3f} GiB per device with its most memory-saving "
            f"strategies, but the budget is {problem.memory_budget_bytes / 2**30:.3f} GiB (largest op: "
            f"{problem.op_names[worst]!r}, {min(problem.memory_bytes[worst]) / 2**30:.3f} GiB): raise tp, "
            "recompute activations, use ZeRO-3 or a smaller micro-batch"
        )


def _run(solver, options: SolverOptions) -> int:
    from ortools.linear_solver import pywraplp

    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, options.relative_gap)
    return solver.Solve(params)


def _solution(problem, solver, s, *, status: int, greedy, scale: float, start: float) -> ShardingSolution:
    from ortools.linear_solver import pywraplp

    if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        choice = tuple(max(range(len(row)), key=lambda k: row[k].solution_value()) for row in s)
        label: SolveStatus = "optimal" if status == pywraplp.Solver.OPTIMAL else "feasible"
        bound = solver.Objective().BestBound() / scale
    elif status == pywraplp.Solver.NOT_SOLVED and not math.isinf(evaluate(problem, greedy)):
        choice, label, bound = greedy, "greedy", 0.0  # time limit before any solution: the greedy plan
    elif status == pywraplp.Solver.INFEASIBLE:
        raise InfeasiblePlanError(
            f"no assignment of the {problem.num_ops} ops is layout-consistent within "
            f"{problem.memory_budget_bytes / 2**30:.3f} GiB (the memory floor is "
            f"{min_memory_bytes(problem) / 2**30:.3f} GiB): raise the budget or allow more strategies"
        )
    else:
        raise InfeasiblePlanError(
            f"the sharding ILP solver ({solver.SolverVersion()}) stopped with status {status} and no solution "
            f"for {problem.num_ops} ops: raise SolverOptions.time_limit_s or choose another backend"
        )
    if memory_of(problem, choice) > problem.memory_budget_bytes * (1 + 1e-9) and not math.isinf(
            evaluate(problem, greedy)):
        log.warning("solver solution exceeds the memory budget beyond tolerance; using the greedy plan")
        choice, label = greedy, "greedy"
    objective = evaluate(problem, choice)
    if label == "optimal":
        bound = min(bound, objective)
    if evaluate(problem, greedy) < objective - 1e-15 and memory_of(problem, greedy) <= problem.memory_budget_bytes:
        choice, objective = greedy, evaluate(problem, greedy)
    bound = min(bound, objective)
    gap = 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)
    if label == "optimal" and gap < 1e-9:
        gap = 0.0
    return ShardingSolution(
        choice=choice,
        objective=objective,
        bound=bound,
        gap=gap,
        status=label,
        solve_time_s=time.perf_counter() - start,
        memory_bytes=memory_of(problem, choice),
        num_variables=solver.NumVariables(),
        num_constraints=solver.NumConstraints(),
    )
