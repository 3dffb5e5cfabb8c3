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


# --- block_strategy on traced transformer blocks -------------------------------------------------------------

GPT3_BLOCK = "gpt:layers=2,hidden=12288,heads=96,vocab=51200,seq=2048"  # GPT-3 175B's layer, two of them
LLAMA_BLOCK = "llama:layers=2,hidden=4096,ffn=14336,heads=32,kv_heads=8,vocab=128256,seq=4096"  # Llama-3-8B's
COLWISE = {"q_proj", "k_proj", "v_proj", "fc1", "gate_proj", "up_proj"}
ROWWISE = {"out_proj", "o_proj", "fc2", "down_proj"}


@pytest.fixture(scope="module")
def traced():
    """Trace each model once for the module (torch.export on the meta device)."""
    from planner.graph import find_blocks
    from planner.models import build_model
    from planner.trace import trace

    out = {}
    for spec in (GPT3_BLOCK, LLAMA_BLOCK):
        bundle = build_model(spec, batch=1)
        graph = trace(bundle.model, bundle.example_inputs)
        layers = [b for b in find_blocks(graph) if b.kind == "transformer"]
        out[spec] = (graph, layers, bundle.dims)
    return out


@pytest.fixture(scope="module")
def cluster():
    from costmodel.profiles import make_cluster

    return make_cluster("dgx-a100-80gb", 2)


def _styles(bs) -> dict[str, str]:
    return {m.fqn.rsplit(".", 1)[-1]: m.style for m in bs.shardings}


@pytest.mark.parametrize("spec", [GPT3_BLOCK, LLAMA_BLOCK], ids=["gpt", "llama"])
@pytest.mark.parametrize("sp", [False, True], ids=["allreduce", "seqpar"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_megatron_layout_and_comm_volume(traced, cluster, spec: str, sp: bool, fused: bool) -> None:
    """Megatron's layout at every tp. Collectives: with fused q/k/v (Megatron-LM) the backward mirrors the
    forward; with separate q / k / v (gate / up) modules, as autopar's runtime shards them, each column-parallel
    module all-reduces its own input gradient (3 + 1 for GeLU, 3 + 2 for SwiGLU), and under sequence parallelism
    the gathered input's gradient then needs no reduce-scatter."""
    from planner.search.block_plan import CostOptions, StrategyCache, block_strategy

    graph, layers, dims = traced[spec]
    b, s, h = 2, dims.seq, dims.hidden
    act_bytes = b * s * h * 2  # one bf16 activation of the residual stream
    cache = StrategyCache()
    inputs = 2 if fused else 3 + (2 if dims.glu else 1)  # input-gradient all-reduces per layer in backward
    for tp in (1, 2, 4, 8):
        bs = block_strategy(layers[0], graph=graph, tp=tp, microbatch=b, seq=s, sequence_parallel=sp,
                            cluster=cluster, cache=cache, cost=CostOptions(fused_input_projections=fused))
        styles = _styles(bs)
        assert bs.solver["status"] == "optimal"
        linears = {name: st for name, st in styles.items() if name in COLWISE | ROWWISE}
        assert len(linears) == (7 if dims.glu else 6)
        norms = {name: st for name, st in styles.items() if "norm" in name}
        assert len(norms) == 2
        if tp == 1:
            assert set(styles.values()) == {"replicate"} and bs.comm_bytes_by_kind == {}
            continue
        assert all(st == ("colwise" if n in COLWISE else "rowwise") for n, st in linears.items()), styles
        assert set(norms.values()) == {"sequence_parallel" if sp else "replicate"}
        comm = bs.comm_bytes_by_kind
        if not sp:  # Megatron: 2 all-reduces of b*s*h forward, 2 backward (separate modules: more backward)
            assert comm == {"tp_all_reduce": pytest.approx((2 + inputs) * act_bytes, rel=1e-12)}
        else:  # each all-reduce becomes an all-gather + reduce-scatter; norm weight grads all-reduced
            norm_params = sum(n for f, n in graph.param_sizes if f.startswith(layers[0].name + ".") and "norm" in f)
            assert comm["tp_all_gather"] == pytest.approx(4 * act_bytes, rel=1e-12)
            if fused:
                assert comm["tp_reduce_scatter"] == pytest.approx(4 * act_bytes, rel=1e-12)
                assert comm["tp_all_reduce"] == pytest.approx(2 * norm_params, rel=1e-12)
            else:  # backward: each module of a multi-module region all-reduces its input gradient (q/k/v,
                # gate/up); a lone colwise linear in the sequence-sharded stream (OPT's fc1) reduce-scatters it
                ar = 3 + (2 if dims.glu else 0)
                assert comm["tp_reduce_scatter"] == pytest.approx((4 - (2 if dims.glu else 1)) * act_bytes,
                                                                  rel=1e-12)
                assert comm["tp_all_reduce"] == pytest.approx(2 * norm_params + ar * act_bytes, rel=1e-12)
        assert 0 < bs.comm_fwd_s < bs.time_fwd_s and 0 < bs.comm_bwd_s < bs.time_bwd_s


def test_time_and_memory_shrink_with_tp(traced, cluster) -> None:
    from planner.search.block_plan import block_strategy

    graph, layers, dims = traced[GPT3_BLOCK]
    runs = [block_strategy(layers[0], graph=graph, tp=tp, microbatch=1, seq=dims.seq, cluster=cluster)
            for tp in (1, 2, 4, 8)]
    times = [r.time_fwd_s + r.time_bwd_s for r in runs]
    assert times == sorted(times, reverse=True)
    params = layers[0].params
    for tp, r in zip((1, 2, 4, 8), runs):
        # 16 bytes/param of model states; norms and biases of row-parallel layers stay replicated.
        assert 16 * params / tp <= r.state_bytes <= 16 * params / tp * 1.01
    assert runs[0].activation_bytes > runs[-1].activation_bytes > 0


def test_gqa_with_tp_over_kv_heads_replicates_attention(traced, cluster) -> None:
    from planner.search.block_plan import block_strategy

    graph, layers, dims = traced[LLAMA_BLOCK]
    assert dims.kv_heads == 8
    bs = block_strategy(layers[0], graph=graph, tp=16, microbatch=1, seq=dims.seq, cluster=cluster)
    styles = _styles(bs)
    assert {styles[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj")} == {"replicate"}
    assert (styles["gate_proj"], styles["up_proj"], styles["down_proj"]) == ("colwise", "colwise", "rowwise")


def test_repeated_blocks_solve_once(traced, cluster) -> None:
    """Identical blocks hit the cache (how fast one solve is: ``python -m benchmarks.intra_op_speed``)."""
    from planner.search.block_plan import StrategyCache, block_strategy

    graph, layers, dims = traced[GPT3_BLOCK]
    assert layers[0].signature == layers[1].signature
    cache = StrategyCache()
    kw = dict(graph=graph, tp=8, microbatch=1, seq=dims.seq, sequence_parallel=True, cluster=cluster, cache=cache)
    first = block_strategy(layers[0], **kw)
    again = block_strategy(layers[1], **kw)
    assert again is first and (cache.misses, cache.hits) == (1, 1)


def test_block_memory_budget_infeasible_names_minimum(traced, cluster) -> None:
    from planner.search.block_plan import block_strategy

    graph, layers, dims = traced[GPT3_BLOCK]
    with pytest.raises(InfeasiblePlanError, match="needs at least .* GiB per device"):
        block_strategy(layers[0], graph=graph, tp=8, microbatch=1, seq=dims.seq, cluster=cluster,
                       mem_budget_bytes=2**30)
    with pytest.raises(ConfigError, match="cp=3 does not divide seq=2048"):
        block_strategy(layers[0], graph=graph, tp=8, cp=3, microbatch=1, seq=dims.seq, cluster=cluster)


def test_context_parallel_and_recompute(traced, cluster) -> None:
    from planner.search.block_plan import block_strategy

    graph, layers, dims = traced[GPT3_BLOCK]
    b, s, h, tp, cp = 1, dims.seq, dims.hidden, 4, 2
    bs = block_strategy(layers[0], graph=graph, tp=tp, cp=cp, microbatch=b, seq=s, cluster=cluster)
    comm = bs.comm_bytes_by_kind
    local_act = b * (s // cp) * h * 2  # each cp rank holds s/cp tokens
    # 2 forward; backward one per column-parallel module (q, k, v, fc1) as the runtime shards them
    assert comm["tp_all_reduce"] == pytest.approx(6 * local_act, rel=1e-12)
    # All-gather context parallelism: this rank's heads of K and V (2 * b*s*h/tp, full sequence) gathered once in
    # the forward and kept, their gradients reduce-scattered (NCCL on these GPUs).
    kv_bytes = 2 * b * s * h * 2 / tp
    assert comm["cp_all_gather"] == pytest.approx(kv_bytes, rel=1e-12)
    assert comm["cp_reduce_scatter"] == pytest.approx(kv_bytes, rel=1e-12)
    assert "cp_all_reduce" not in comm

    none = block_strategy(layers[0], graph=graph, tp=tp, microbatch=b, seq=s, cluster=cluster)
    full = block_strategy(layers[0], graph=graph, tp=tp, microbatch=b, seq=s, cluster=cluster, recompute="full")
    sel = block_strategy(layers[0], graph=graph, tp=tp, microbatch=b, seq=s, cluster=cluster, recompute="selective")
    assert full.activation_bytes < sel.activation_bytes < none.activation_bytes
    assert none.time_bwd_s < sel.time_bwd_s < full.time_bwd_s
    assert full.time_fwd_s == pytest.approx(none.time_fwd_s, rel=1e-12)
    # Full recomputation replays the 2 forward all-reduces inside backward.
    assert full.comm_bytes_by_kind["tp_all_reduce"] == pytest.approx(8 * b * s * h * 2, rel=1e-12)


def test_experts_over_ep_use_all_to_all(cluster) -> None:
    from planner.search.block_plan import cluster_cost_context, solve_block
    from planner.search.strategies import LayerOp, MeshShape

    tokens, h, topk = 4096, 4096, 2
    act = tokens * h * 2.0
    ops = [
        LayerOp(name="input", kind="input", out_bytes=act),
        LayerOp(name="norm", kind="norm", inputs=("input",), modules=("norm",), bytes_fwd=2 * act, out_bytes=act,
                saved_bytes=act, params=h, op_class="norm"),
        LayerOp(name="router", kind="router", inputs=("norm",), modules=("gate",), flops_fwd=2.0 * tokens * h * 8,
                out_bytes=tokens * 8 * 2.0, params=8 * h, shard_dims=(8, h), op_class="matmul", mnk=(tokens, 8, h)),
        LayerOp(name="experts", kind="experts", inputs=("norm", "router"), modules=("experts",),
                flops_fwd=2.0 * tokens * topk * 3 * h * 14336, flops_bwd=4.0 * tokens * topk * 3 * h * 14336,
                bytes_fwd=8 * 3 * h * 14336 * 2.0, out_bytes=act, saved_bytes=4 * act, params=8 * 3 * h * 14336,
                dispatch_bytes=tokens * topk * h * 2.0, dispatch_rows=tokens * topk, op_class="matmul"),
        LayerOp(name="add", kind="add", inputs=("input", "experts"), bytes_fwd=3 * act, out_bytes=act),
        LayerOp(name="output", kind="output", inputs=("add",), out_bytes=act),
    ]
    for ep in (1, 4):
        mesh = MeshShape(tp=2, ep=ep)
        bs = solve_block(ops, mesh=mesh, ctx=cluster_cost_context(cluster, mesh=mesh))
        styles = {m.fqn: m.style for m in bs.shardings}
        assert styles["experts"] == ("expert" if ep > 1 else "replicate") and styles["gate"] == "replicate"
        a2a = bs.comm_bytes_by_kind.get("ep_all_to_all", 0.0)
        # dispatch + combine, forward + backward; the routing: int64 row counts per ep rank, an int64 id per row
        routing = 8.0 * (ep + tokens * topk)
        assert a2a == pytest.approx(4 * tokens * topk * h * 2.0 + routing if ep > 1 else 0.0)
        assert bs.state_bytes == pytest.approx(16 * (8 * 3 * h * 14336 / ep + 9 * h))


@pytest.mark.slow
def test_mixtral_block_experts(cluster) -> None:
    from planner.graph import find_blocks
    from planner.models import build_model
    from planner.search.block_plan import block_strategy
    from planner.trace import trace

    bundle = build_model("mixtral:layers=2,hidden=4096,ffn=14336,heads=32,kv_heads=8,vocab=32000,seq=4096,"
                         "experts=8,topk=2", batch=1)
    graph = trace(bundle.model, bundle.example_inputs)
    layer = next(b for b in find_blocks(graph) if b.kind == "transformer")
    bs = block_strategy(layer, graph=graph, tp=4, ep=4, microbatch=1, seq=4096, cluster=cluster)
    styles = _styles(bs)
    assert styles["experts"] == "expert" and styles["gate"] == "replicate"
    assert (styles["q_proj"], styles["o_proj"]) == ("colwise", "rowwise")
    routing = 8 * (4 + 4096 * 2)  # int64 row counts per ep rank, an int64 expert id per (token, expert) row
    assert bs.comm_bytes_by_kind["ep_all_to_all"] == pytest.approx(4 * 4096 * 2 * 4096 * 2 + routing, rel=1e-9)


def test_coarsened_graph_is_refused(traced, cluster) -> None:
    from costmodel.errors import UnsupportedModelError
    from planner.graph import coarsen, find_blocks
    from planner.search.block_plan import block_strategy

    graph, _, dims = traced[GPT3_BLOCK]
    coarse = coarsen(graph)
    layer = next(b for b in find_blocks(coarse) if b.kind == "transformer")
    with pytest.raises(UnsupportedModelError, match="before planner.graph.coarsen"):
        block_strategy(layer, graph=coarse, tp=2, microbatch=1, seq=dims.seq, cluster=cluster)


def test_sequence_parallel_needs_executable_gathers(traced, cluster) -> None:
    """With tp not dividing kv_heads, attention is replicated; under SP nothing can gather its input."""
    from planner.search.block_plan import block_strategy

    graph, layers, dims = traced[LLAMA_BLOCK]
    with pytest.raises(InfeasiblePlanError, match="no sequence-parallel sharding is executable at tp=16"):
        block_strategy(layers[0], graph=graph, tp=16, microbatch=1, seq=dims.seq, sequence_parallel=True,
                       cluster=cluster)


@pytest.mark.parametrize("sp", [False, True], ids=["allreduce", "seqpar"])
def test_real_block_problem_matches_brute_force(traced, cluster, sp: bool) -> None:
    from planner.search.block_ops import layer_ops_from_block
    from planner.search.block_plan import block_problem, cluster_cost_context
    from planner.search.strategies import MeshShape

    graph, layers, dims = traced[LLAMA_BLOCK]
    mesh = MeshShape(tp=4, sequence_parallel=sp)
    ops = layer_ops_from_block(layers[0], graph, microbatch=1, seq=dims.seq)
    bp = block_problem(ops, mesh=mesh, ctx=cluster_cost_context(cluster, mesh=mesh))
    assert math.prod(len(s) for s in bp.problem.strategy_names) <= 50_000
    best, arg = brute_force(bp.problem)
    sol = solve(bp.problem, SolverOptions())
    assert sol.status == "optimal" and abs(sol.objective - best) <= 1e-12 * max(1.0, best)
    assert evaluate(bp.problem, arg) == best


def test_time_limit_returns_best_so_far() -> None:
    """A tight limit on a large instance: whatever the status, the answer is feasible, no worse than the warm
    start, and its bound does not exceed it."""
    rng = random.Random(11)
    p = random_problem(rng, n=200, dag=True, budget_frac=0.3)
    greedy = greedy_choice(p)
    sol = solve(p, SolverOptions(time_limit_s=0.05, backend="SCIP"))
    assert sol.status in ("optimal", "feasible", "greedy")
    assert sol.memory_bytes <= p.memory_budget_bytes
    assert sol.objective <= evaluate(p, greedy) + 1e-12
    assert sol.bound <= sol.objective and 0.0 <= sol.gap <= 1.0
    assert sol.solve_time_s < 20.0  # greedy + model build + solver start-up dominate a 0.05 s limit


def test_sequence_parallel_ok_predicate(traced, cluster) -> None:
    from planner.search.block_plan import sequence_parallel_ok

    graph, layers, dims = traced[LLAMA_BLOCK]
    assert sequence_parallel_ok(layers[0], graph=graph, tp=8, seq=dims.seq, cluster=cluster)
    assert not sequence_parallel_ok(layers[0], graph=graph, tp=16, seq=dims.seq, cluster=cluster)
