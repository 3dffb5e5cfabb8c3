"""``block_strategy``: the intra-op sharding of one distinct block on one submesh shape, memoized.

``block_ops.layer_ops_from_block`` reads a traced block's coarse ops (``strategies.LayerOp``);
``block_problem`` turns them into a pure ``ShardingProblem``: per-op candidate times (compute from
``costmodel.compute``, the collectives a strategy issues from ``costmodel.comm`` on the tp / cp / ep group,
tp innermost), memory per device (model states at ``state_bytes_per_param`` plus stored activations), and the
resharding matrix of every edge (``strategies.forward_conversion`` plus its backward dual; ``inf`` where the
runtime cannot convert). Every block boundary has one layout (R, or S_seq with sequence parallelism), and a
transformer layer's output feeds the next identical layer's input through a periodic edge. ``block_strategy``
solves it with ``intra_op.solve`` once per key in an explicit ``StrategyCache``: a 126-layer model solves its
one distinct block once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from costmodel.errors import ConfigError, InfeasiblePlanError
from planner.plan import ModuleSharding
from planner.search import intra_op
from planner.search.strategies import (
    Collective,
    LayerOp,
    MeshShape,
    OpStrategy,
    candidates,
    conversion,
    dual,
    forward_conversion,
)

log = logging.getLogger(__name__)

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True, slots=True)
class CostContext:
    """How to time work and collectives: two callables, so the builder stays pure and testable."""

    op_time_s: Callable[[LayerOp, OpStrategy, float, float], float]
    """(op, strategy, local flops, local bytes moved) -> seconds on one device."""
    collective_time_s: Callable[[Collective], float]
    """A collective on its mesh axis -> seconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Costed:
    strategy: OpStrategy
    fwd_s: float
    bwd_s: float
    comm_fwd_s: float
    comm_bwd_s: float
    state_bytes: float
    act_bytes: float
    memory_bytes: float


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockProblem:
    """A ``ShardingProblem`` plus what is needed to read its solution back."""

    problem: intra_op.ShardingProblem
    ops: tuple[LayerOp, ...]
    costed: tuple[tuple[_Costed, ...], ...]
    edges: tuple[tuple[int, int, int], ...]
    """(producer, consumer, consumer input index) per ``problem.edges`` entry."""


def _collectives_time_s(ctx: CostContext, cs: Sequence[Collective]) -> float:
    return sum(ctx.collective_time_s(c) for c in cs)


def _cost_strategy(op: LayerOp, s: OpStrategy, *, ctx: CostContext, mesh: MeshShape, recompute: str,
                   state_bytes_per_param: float, activation_multiplier: float) -> _Costed:
    frac = s.work_fraction / mesh.cp
    fwd = ctx.op_time_s(op, s, op.flops_fwd * frac, op.bytes_fwd * frac) if (op.flops_fwd or op.bytes_fwd) else 0.0
    # Backward reads the forward's inputs and output gradient and writes the input and weight gradients: about
    # twice the forward traffic.
    bwd = (ctx.op_time_s(op, s, op.flops_bwd * frac, 2.0 * op.bytes_fwd * frac)
           if (op.flops_bwd or op.bytes_fwd) else 0.0)
    recomputed = recompute == "full" or (recompute == "selective" and op.kind == "attention")
    comm_fwd = _collectives_time_s(ctx, s.comm_fwd)
    if recomputed:
        bwd += fwd
        comm_fwd_again = comm_fwd
    else:
        comm_fwd_again = 0.0
    saved = 0.0 if recomputed and op.kind != "input" else op.saved_bytes * s.act_fraction / mesh.cp
    states = op.params * s.param_fraction * state_bytes_per_param
    return _Costed(strategy=s, fwd_s=fwd, bwd_s=bwd, comm_fwd_s=comm_fwd,
                   comm_bwd_s=_collectives_time_s(ctx, s.comm_bwd) + comm_fwd_again, state_bytes=states,
                   act_bytes=saved, memory_bytes=states + activation_multiplier * saved)


def edge_collectives(src: OpStrategy, dst: OpStrategy, index: int, nbytes: float, *, into_output: bool = False
                     ) -> tuple[tuple[Collective, ...] | None, tuple[Collective, ...]]:
    """Forward conversion of the producer's output into the consumer's input ``index`` (None: not
    executable), and the backward conversion of the consumer's input gradient into the producer's layout.
    ``into_output``: the consumer is the block's output (the next block's input preparation)."""
    fwd = forward_conversion(src.out_layout, dst.in_layouts[index], nbytes, at_block_boundary=into_output,
                             consumer_gathers=dst.gathers_sequence)
    bwd = conversion(dst.grad_layouts[index], dual(src.out_layout), nbytes)
    return fwd, bwd


def _edge_time_s(ctx: CostContext, fwd: Sequence[Collective] | None, bwd: Sequence[Collective],
                 recompute: str) -> float:
    """A forward conversion runs again when full recomputation replays the block's forward; inf forbids."""
    if fwd is None:
        return math.inf
    again = 2.0 if recompute == "full" else 1.0
    return again * _collectives_time_s(ctx, fwd) + _collectives_time_s(ctx, bwd)


def _boundary_collectives(src: OpStrategy, dst: OpStrategy, nbytes: float):
    return (forward_conversion(src.out_layout, dst.out_layout, nbytes),
            conversion(dst.out_layout, src.out_layout, nbytes))


def block_problem(ops: Sequence[LayerOp], *, mesh: MeshShape, ctx: CostContext, recompute: str = "none",
                  state_bytes_per_param: float = 16.0, activation_multiplier: float = 1.0,
                  mem_budget_bytes: float = math.inf, periodic: bool = True) -> BlockProblem:
    """Build the pure sharding problem of a block's ops (see the module docstring). ``periodic``: the block
    repeats (a transformer layer), so its output feeds its own input."""
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute={recompute!r}; choose one of {RECOMPUTE_MODES}")
    index = {op.name: i for i, op in enumerate(ops)}
    costed = tuple(
        tuple(_cost_strategy(op, s, ctx=ctx, mesh=mesh, recompute=recompute,
                             state_bytes_per_param=state_bytes_per_param,
                             activation_multiplier=activation_multiplier) for s in candidates(op, mesh))
        for op in ops
    )
    edges, triples = [], []
    for j, op in enumerate(ops):
        for slot, src_name in enumerate(op.inputs):
            if src_name not in index:
                raise ConfigError(f"op {op.name!r} reads {src_name!r}, which is not an op of the block")
            i = index[src_name]
            nbytes = ops[i].out_bytes / mesh.cp
            matrix = tuple(
                tuple(_edge_time_s(ctx, *edge_collectives(a.strategy, b.strategy, slot, nbytes,
                                                          into_output=op.kind == "output"), recompute)
                      for b in costed[j])
                for a in costed[i]
            )
            edges.append(intra_op.ShardingEdge(src=i, dst=j, cost_s=matrix))
            triples.append((i, j, slot))
    if periodic:
        _add_periodic_edge(ops, costed, edges, triples, ctx=ctx, mesh=mesh, recompute=recompute)
    problem = intra_op.ShardingProblem(
        op_names=tuple(op.name for op in ops),
        strategy_names=tuple(tuple(c.strategy.name for c in row) for row in costed),
        compute_s=tuple(tuple(c.fwd_s + c.bwd_s for c in row) for row in costed),
        comm_s=tuple(tuple(c.comm_fwd_s + c.comm_bwd_s for c in row) for row in costed),
        memory_bytes=tuple(tuple(c.memory_bytes for c in row) for row in costed),
        edges=tuple(edges),
        memory_budget_bytes=mem_budget_bytes,
    )
    return BlockProblem(problem=problem, ops=tuple(ops), costed=costed, edges=tuple(triples))


def _add_periodic_edge(ops, costed, edges, triples, *, ctx: CostContext, mesh: MeshShape, recompute: str) -> None:
    """The next identical block reads this block's output as its input: output layout -> input layout."""
    ins = [i for i, op in enumerate(ops) if op.kind == "input"]
    outs = [i for i, op in enumerate(ops) if op.kind == "output"]
    if len(ins) != 1 or len(outs) != 1:
        return
    i, j = outs[0], ins[0]
    nbytes = ops[i].out_bytes / mesh.cp
    matrix = tuple(
        tuple(_edge_time_s(ctx, *_boundary_collectives(a.strategy, b.strategy, nbytes), recompute) for b in costed[j])
        for a in costed[i]
    )
    edges.append(intra_op.ShardingEdge(src=i, dst=j, cost_s=matrix))
    triples.append((i, j, -1))


# --- reading a solution back ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockStrategy:
    """The chosen sharding of one block and its predicted cost for one micro-batch on one tp group."""

    shardings: tuple[ModuleSharding, ...]
    """Style per parameter-owning module, keyed by module FQN relative to the block."""
    op_strategies: tuple[tuple[str, str], ...]
    """(op name, strategy name) for every coarsened op (also the parameter-free ones)."""
    time_fwd_s: float
    time_bwd_s: float
    """Backward time, including recomputation."""
    comm_fwd_s: float
    comm_bwd_s: float
    """Parts of ``time_fwd_s`` / ``time_bwd_s`` spent in collectives (not overlapped)."""
    comm_bytes_by_kind: dict[str, float] = field(default_factory=dict)
    """Full buffer bytes per collective, forward + backward, keyed ``<axis>_<kind>`` (``tp_all_reduce``)."""
    memory_bytes: float = 0.0
    """Per device: ``state_bytes + activation_multiplier * activation_bytes`` (what the budget bounded)."""
    state_bytes: float = 0.0
    """Model states (weights, gradients, optimizer) of the block's parameter shards on one device."""
    activation_bytes: float = 0.0
    """Activations one micro-batch keeps for the backward pass on one device."""
    solver: dict[str, Any] = field(default_factory=dict)
    """status, objective_s, bound_s, gap, solve_time_s, num_variables, num_constraints, cached."""

    def style_of(self, fqn: str) -> str:
        for m in self.shardings:
            if m.fqn == fqn:
                return m.style
        raise KeyError(fqn)


def read_solution(bp: BlockProblem, sol: intra_op.ShardingSolution, *, ctx: CostContext, mesh: MeshShape,
                  recompute: str) -> BlockStrategy:
    chosen = [bp.costed[i][k] for i, k in enumerate(sol.choice)]
    fwd = sum(c.fwd_s + c.comm_fwd_s for c in chosen)
    bwd = sum(c.bwd_s + c.comm_bwd_s for c in chosen)
    comm_f = sum(c.comm_fwd_s for c in chosen)
    comm_b = sum(c.comm_bwd_s for c in chosen)
    by_kind: dict[str, float] = {}

    def count(cs: Sequence[Collective], times: int = 1) -> float:
        for c in cs:
            key = f"{c.axis}_{c.kind}"
            by_kind[key] = by_kind.get(key, 0.0) + c.nbytes * times
        return _collectives_time_s(ctx, cs) * times

    for c in chosen:
        count(c.strategy.comm_fwd)
        count(c.strategy.comm_bwd)
    for i, j, slot in bp.edges:
        a, b = chosen[i].strategy, chosen[j].strategy
        nbytes = bp.ops[i].out_bytes / mesh.cp
        # slot -1: the periodic edge, this block's output converted into the next block's input layout
        f, bw = (_boundary_collectives(a, b, nbytes) if slot < 0 else
                 edge_collectives(a, b, slot, nbytes, into_output=bp.ops[j].kind == "output"))
        again = 2 if recompute == "full" else 1
        t_f, t_b = count(f, again), count(bw)
        fwd, bwd = fwd + t_f / again, bwd + t_b + t_f * (again - 1) / again
        comm_f, comm_b = comm_f + t_f / again, comm_b + t_b + t_f * (again - 1) / again
    shardings = sorted(
        {ModuleSharding(fqn=m, style=c.strategy.style) for op, c in zip(bp.ops, chosen) for m in op.modules},
        key=lambda m: m.fqn,
    )
    return BlockStrategy(
        shardings=tuple(shardings),
        op_strategies=tuple((op.name, c.strategy.name) for op, c in zip(bp.ops, chosen)),
        time_fwd_s=fwd, time_bwd_s=bwd, comm_fwd_s=comm_f, comm_bwd_s=comm_b,
        comm_bytes_by_kind=by_kind,
        memory_bytes=sol.memory_bytes,
        state_bytes=sum(c.state_bytes for c in chosen),
        activation_bytes=sum(c.act_bytes for c in chosen),
        solver={"status": sol.status, "objective_s": sol.objective, "bound_s": sol.bound, "gap": sol.gap,
                "solve_time_s": sol.solve_time_s, "num_variables": sol.num_variables,
                "num_constraints": sol.num_constraints},
    )


# --- costs on a cluster -------------------------------------------------------------------------------------


def mesh_groups(mesh: MeshShape) -> dict[str, tuple[int, int]]:
    """(size, stride) of each axis inside one stage: tp innermost, then cp, then ep (``planner.plan`` order)."""
    return {"tp": (mesh.tp, 1), "cp": (mesh.cp, mesh.tp), "ep": (mesh.ep, mesh.tp * mesh.cp)}


def cluster_cost_context(cluster, *, mesh: MeshShape, device=None, dtype: str = "bf16",
                         first_rank: int = 0) -> CostContext:
    """Time ops with ``costmodel.compute.op_time_s`` and collectives with ``costmodel.comm`` on ``cluster``."""
    from costmodel import comm, compute

    gpu = device if device is not None else cluster.node_type_of_rank(first_rank).gpu
    calibration = getattr(cluster, "calibration", None)
    groups = {axis: comm.Group(size=size, stride=stride) for axis, (size, stride) in mesh_groups(mesh).items()}

    def op_time(op: LayerOp, s: OpStrategy, flops: float, nbytes: float) -> float:
        shape = s.local_mnk(op.mnk, tp=mesh.tp, cp=mesh.cp)
        return compute.op_time_s(flops=flops, bytes_moved=nbytes, op_class=op.op_class, device=gpu, dtype=dtype,
                                 shape=shape, calibration=calibration)

    def coll_time(c: Collective) -> float:
        group = groups[c.axis]
        if group.size == 1 or c.nbytes <= 0:
            return 0.0
        return comm.collective_time_s(c.kind, c.nbytes, group, cluster, first_rank=first_rank).time_s

    return CostContext(op_time_s=op_time, collective_time_s=coll_time)


# --- memoized entry -----------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class StrategyCache:
    """Memo of solved blocks, keyed by everything a solution depends on; pass one per planning run."""

    entries: dict[tuple, BlockStrategy] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def get(self, key: tuple) -> BlockStrategy | None:
        found = self.entries.get(key)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def put(self, key: tuple, value: BlockStrategy) -> None:
        self.entries[key] = value


def solve_block(ops: Sequence[LayerOp], *, mesh: MeshShape, ctx: CostContext, recompute: str = "none",
                state_bytes_per_param: float = 16.0, activation_multiplier: float = 1.0,
                mem_budget_bytes: float = math.inf, options: intra_op.SolverOptions | None = None,
                periodic: bool = True) -> BlockStrategy:
    """Build, solve and read back the sharding problem of ``ops`` (no memo: see ``block_strategy``)."""
    bp = block_problem(ops, mesh=mesh, ctx=ctx, recompute=recompute, state_bytes_per_param=state_bytes_per_param,
                       activation_multiplier=activation_multiplier, mem_budget_bytes=mem_budget_bytes,
                       periodic=periodic)
    sol = intra_op.solve(bp.problem, options or intra_op.SolverOptions())
    log.debug("block of %d ops on %s: %s objective %.3g s in %.3f s", len(ops), mesh, sol.status, sol.objective,
              sol.solve_time_s)
    return read_solution(bp, sol, ctx=ctx, mesh=mesh, recompute=recompute)


def block_strategy(block, *, graph, tp: int, cp: int = 1, ep: int = 1, microbatch: int, seq: int,
                   sequence_parallel: bool = False, recompute: str = "none", cluster, device=None,
                   dtype: str = "bf16", mem_budget_bytes: float = math.inf, state_bytes_per_param: float = 16.0,
                   activation_multiplier: float = 1.0, first_rank: int = 0,
                   options: intra_op.SolverOptions | None = None,
                   cache: StrategyCache | None = None) -> BlockStrategy:
    """The sharding of a traced ``planner.graph.Block`` on a (tp, cp, ep) submesh for one micro-batch.

    ``graph`` is the ``OpGraph`` the block was found in (``planner.trace.trace``, not coarsened); its op
    numbers are rescaled to ``microbatch`` x ``seq`` and ``dtype``.

    Memoized in ``cache`` on the block's signature and every argument the answer depends on, so repeated
    blocks (the layers of a transformer) are solved once. ``mem_budget_bytes`` bounds ``state_bytes +
    activation_multiplier * activation_bytes`` per device; ``state_bytes_per_param`` is 16 for mixed-precision
    Adam without ZeRO (pass the ZeRO-sharded figure otherwise). Raises ``InfeasiblePlanError`` (with the
    minimum memory) when no sharding fits, ``ConfigError`` for invalid degrees.
    """
    from planner.search.block_ops import layer_ops_from_block

    for name, value in (("tp", tp), ("cp", cp), ("ep", ep), ("microbatch", microbatch), ("seq", seq)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if seq % cp:
        raise ConfigError(f"cp={cp} does not divide seq={seq}; choose cp in "
                          f"{[d for d in range(1, seq + 1) if seq % d == 0 and d <= 64]}")
    options = options or intra_op.SolverOptions()
    mesh = MeshShape(tp=tp, cp=cp, ep=ep, sequence_parallel=bool(sequence_parallel and tp > 1))
    gpu = device if device is not None else cluster.node_type_of_rank(first_rank).gpu
    key = (getattr(block, "signature", None) or block.name, mesh, microbatch, seq, recompute, gpu.name, dtype,
           _cluster_key(cluster), first_rank, mem_budget_bytes, state_bytes_per_param, activation_multiplier,
           options)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    ops = layer_ops_from_block(block, graph, microbatch=microbatch, seq=seq, dtype=dtype)
    ctx = cluster_cost_context(cluster, mesh=mesh, device=gpu, dtype=dtype, first_rank=first_rank)
    try:
        result = solve_block(ops, mesh=mesh, ctx=ctx, recompute=recompute,
                             state_bytes_per_param=state_bytes_per_param, activation_multiplier=activation_multiplier,
                             mem_budget_bytes=mem_budget_bytes, options=options,
                             periodic=getattr(block, "kind", "transformer") == "transformer")
    except InfeasiblePlanError as e:
        raise _explain_infeasible(e, block=block, ops=ops, mesh=mesh) from None
    if cache is not None:
        cache.put(key, result)
    return result


def _explain_infeasible(e: InfeasiblePlanError, *, block, ops: Sequence[LayerOp],
                        mesh: MeshShape) -> InfeasiblePlanError:
    """Name the ops that make a sequence-parallel block infeasible (the ILP only knows it is)."""
    if not mesh.sequence_parallel or "layout-consistent" not in str(e):
        return e
    stuck = [op.modules[0] if op.modules else op.name for op in ops
             if not any(s.gathers_sequence or "S_seq" in s.in_layouts for s in candidates(op, mesh))
             and op.kind not in ("input", "output", "attention")]
    return InfeasiblePlanError(
        f"block {block.name!r}: no sequence-parallel sharding is executable at tp={mesh.tp}: "
        f"{', '.join(stuck) or 'some ops'} would need the full sequence replicated, and the runtime gathers the "
        "sequence only into colwise linears (e.g. tp does not divide kv_heads, or an MoE router / experts); "
        "plan with sequence_parallel=False, or a tp dividing the head counts"
    )


def _cluster_key(cluster) -> tuple:
    """What of a Cluster the costs depend on (Cluster objects hold dicts and are not hashable)."""
    groups = tuple((g.node.name, g.count, g.node.gpus_per_node, g.node.intra.gbps_per_direction,
                    g.node.nic.gbps_per_direction, g.node.nics_per_node) for g in cluster.groups)
    calibration = getattr(cluster, "calibration", None)
    try:
        hash(calibration)  # frozen dataclass of tuples: keyed by content
    except TypeError:
        calibration = id(calibration)
    return (cluster.name, groups, calibration)


def sequence_parallel_ok(block, *, graph, tp: int, cluster, seq: int, cache: StrategyCache | None = None,
                         **kwargs) -> bool:
    """Whether ``block`` has an executable sequence-parallel sharding at this tp (False e.g. for MoE layers,
    whose router / experts the runtime cannot feed sequence-sharded tokens, or when tp does not divide the kv
    heads). For the search to prune ``sequence_parallel=True`` before asking ``block_strategy`` for it."""
    if tp == 1:
        return True
    try:
        block_strategy(block, graph=graph, tp=tp, microbatch=1, seq=seq, sequence_parallel=True, cluster=cluster,
                       cache=cache, **kwargs)
    except InfeasiblePlanError as e:
        return "no sequence-parallel sharding" not in str(e)
    return True
