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
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from costmodel.errors import ConfigError, InfeasiblePlanError
from planner.plan import ModuleSharding
from planner.search import intra_op
# CostOptions and cluster_cost_context are re-exported: callers build blocks with them from here
from planner.search.op_cost import QUANTIZED, CostContext, CostOptions, cluster_cost_context  # noqa: F401
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


PHASES = ("forward", "backward", "recompute")


@dataclass(frozen=True, kw_only=True, slots=True)
class _Costed:
    strategy: OpStrategy
    fwd_s: float
    bwd_s: float
    """Backward compute, without recomputation."""
    wgrad_s: float
    """Part of ``bwd_s`` computing weight gradients."""
    rec_s: float
    """Forward compute replayed by recomputation."""
    comm: tuple[tuple[str, Collective, int], ...]
    """(phase, collective, count) the op issues itself."""
    comm_s: float
    state_bytes: float
    act_bytes: float
    """Kept for the backward under this block's recomputation."""
    full_act_bytes: float
    """Kept for the backward without recomputation (what a recomputed block rebuilds)."""
    memory_bytes: float


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockProblem:
    """A ``ShardingProblem`` plus what is needed to read its solution back."""

    problem: intra_op.ShardingProblem
    ops: tuple[LayerOp, ...]
    costed: tuple[tuple[_Costed, ...], ...]
    edges: tuple[tuple[int, int, int], ...]
    """(producer, consumer, consumer input index) per ``problem.edges`` entry."""


def _time_s(ctx: CostContext, comm: Sequence[tuple[str, Collective, int]]) -> float:
    return sum(ctx.collective_time_s(c) * n for _, c, n in comm)


def _cost_strategy(op: LayerOp, s: OpStrategy, *, ctx: CostContext, mesh: MeshShape, recompute: str,
                   state_bytes_per_param: float, activation_multiplier: float) -> _Costed:
    frac = s.work_fraction / mesh.cp
    flops_bwd = op.flops_bwd if ctx.flash or op.kind != "attention" else 2.0 * op.flops_fwd
    # the activations split with the work, the weights with the parameters (an expert-parallel rank reads only
    # its own experts' weights, a context-parallel rank all of its weights)
    weights = min(op.bytes_fwd, op.param_bytes or op.params * ctx.weight_bytes_per_param)
    moved = (op.bytes_fwd - weights) * frac + weights * s.param_fraction
    fwd = ctx.op_time_s(op, s, op.flops_fwd * frac, moved) if (op.flops_fwd or op.bytes_fwd) else 0.0
    # Backward reads the forward's inputs and output gradient and writes the input and weight gradients: about
    # twice the forward traffic.
    bwd = ctx.op_time_s(op, s, flops_bwd * frac, 2.0 * moved) if (flops_bwd or op.bytes_fwd) else 0.0
    # the weight gradient of a linear is one forward-sized matmul (dW = dY^T X)
    wgrad = bwd * min(1.0, op.flops_fwd / flops_bwd) if op.params and flops_bwd > 0 else 0.0
    recomputed = _recomputed(op, recompute)
    comm = tuple(("forward", c, 1) for c in s.comm_fwd) + tuple(("backward", c, 1) for c in s.comm_bwd)
    if recomputed:
        comm += tuple(("recompute", c, 1) for c in s.comm_fwd)
    saved, full = _kept_bytes(op, s, ctx=ctx, mesh=mesh, recompute=recompute)
    rec = fwd if recomputed else 0.0
    if recompute == "selective" and ctx.selective == "op" and op.kind not in ("input", "output"):
        rec = _op_checkpointed(op, s, fwd, frac)[1]
    states = op.params * s.param_fraction * state_bytes_per_param
    return _Costed(strategy=s, fwd_s=fwd, bwd_s=bwd, wgrad_s=wgrad, rec_s=rec, comm=comm,
                   comm_s=_time_s(ctx, comm), state_bytes=states, act_bytes=saved, full_act_bytes=full,
                   memory_bytes=states + activation_multiplier * saved)


def _recomputed(op: LayerOp, recompute: str) -> bool:
    return recompute == "full" or (recompute == "selective" and op.kind == "attention")


def _kept_bytes(op: LayerOp, s: OpStrategy, *, ctx: CostContext, mesh: MeshShape,
                recompute: str) -> tuple[float, float]:
    """(bytes kept for the backward under ``recompute``, bytes kept without recomputation) of ``op`` under ``s``
    on one device: its saved bytes as sharded, the scores of an unfused attention, a checkpointed block's input."""
    full = op.saved_bytes * s.act_fraction / mesh.cp
    if op.kind == "experts" and s.style == "expert":  # the target's expert-parallel forward (ep > 1) keeps more
        full += ctx.expert_dispatch_saved * op.dispatch_bytes / mesh.cp
    if op.kind == "attention" and not ctx.flash:
        full += ctx.scores_bytes * s.work_fraction / (mesh.cp * mesh.cp)  # s/cp query rows against all s keys
    if recompute == "full" and op.kind == "input":  # torch.utils.checkpoint keeps the block's input
        full = max(full, op.out_bytes * s.act_fraction / mesh.cp)
    saved = 0.0 if _recomputed(op, recompute) and op.kind != "input" else full
    if recompute == "selective" and ctx.selective == "op" and op.kind not in ("input", "output"):
        saved = _op_checkpointed(op, s, 0.0, s.work_fraction / mesh.cp)[0]
    return saved, full


def _op_checkpointed(op: LayerOp, s: OpStrategy, fwd_s: float, frac: float) -> tuple[float, float]:
    """(saved bytes, recompute seconds) under op-level selective checkpointing (torchtitan's ``selective`` /
    ``op`` policy): the outputs of every other matmul and of the attention core are saved, everything else is
    recomputed before the backward: on average half of each linear's output kept and half its forward re-run."""
    if op.kind == "attention":
        return op.out_bytes * frac, 0.0
    if op.kind in QUANTIZED or op.kind == "matmul":
        return 0.5 * op.out_bytes * frac, 0.5 * fwd_s
    return 0.0, fwd_s


def _input_copies(op: LayerOp, s: OpStrategy, ctx: CostContext) -> int:
    """How many modules reduce the input gradient of ``op`` under ``s`` separately (see ``CostContext``)."""
    if ctx.fused_input_projections or "P" not in s.grad_layouts:
        return 1
    return max(1, len(op.modules))


def edge_collectives(src: OpStrategy, dst: OpStrategy, index: int, nbytes: float, *, into_output: bool = False,
                     copies: int = 1) -> tuple[tuple[Collective, ...] | None, tuple[Collective, ...]]:
    """Forward conversion of the producer's output into the consumer's input ``index`` (None: not
    executable), and the backward conversion of the consumer's input gradient into the producer's layout.
    ``into_output``: the consumer is the block's output (the next block's input preparation). ``copies`` > 1:
    the consumer is that many modules, each all-reducing its Partial input gradient to Replicate, after which
    reaching the producer's layout is a local slice."""
    fwd = forward_conversion(src.out_layout, dst.in_layouts[index], nbytes, at_block_boundary=into_output,
                             consumer_gathers=dst.gathers_sequence)
    if fwd and src.style == "vocab_embedding" and dst.in_layouts[index] == "S_seq":
        # runtime.tensor_parallel: the vocab-parallel embedding reduces to Replicate (the model computes positions
        # from the whole sequence) and the first sequence-parallel layer slices it: an all-reduce, not a scatter
        fwd = conversion("P", "R", nbytes)
    grad = dst.grad_layouts[index]
    if copies > 1 and grad == "P":
        bwd = conversion("P", "R", nbytes) * copies + conversion("R", dual(src.out_layout), nbytes)
    else:
        bwd = conversion(grad, dual(src.out_layout), nbytes)
    return fwd, bwd


def _edge_comm(fwd: Sequence[Collective] | None, bwd: Sequence[Collective], recompute: str
               ) -> tuple[tuple[str, Collective, int], ...] | None:
    """A forward conversion runs again when full recomputation replays the block's forward; None forbids."""
    if fwd is None:
        return None
    out = tuple(("forward", c, 1) for c in fwd) + tuple(("backward", c, 1) for c in bwd)
    if recompute == "full":
        out += tuple(("recompute", c, 1) for c in fwd)
    return out


def _boundary_collectives(src: OpStrategy, dst: OpStrategy, nbytes: float):
    return (forward_conversion(src.out_layout, dst.out_layout, nbytes),
            conversion(dst.out_layout, src.out_layout, nbytes))


def _edge_pairs(bp_ops, costed, i: int, j: int, slot: int, *, ctx: CostContext, mesh: MeshShape, recompute: str):
    """Per (producer strategy, consumer strategy) the edge's collectives (None: forbidden); slot -1 is the
    periodic edge from this block's output into the next identical block's input."""
    nbytes = bp_ops[i].out_bytes / mesh.cp
    rows = []
    for a in costed[i]:
        row = []
        for b in costed[j]:
            if slot < 0:
                f, bw = _boundary_collectives(a.strategy, b.strategy, nbytes)
            else:
                f, bw = edge_collectives(a.strategy, b.strategy, slot, nbytes,
                                         into_output=bp_ops[j].kind == "output",
                                         copies=_input_copies(bp_ops[j], b.strategy, ctx))
            row.append(_edge_comm(f, bw, recompute))
        rows.append(tuple(row))
    return tuple(rows)


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
    triples = []
    for j, op in enumerate(ops):
        for slot, src_name in enumerate(op.inputs):
            if src_name not in index:
                raise ConfigError(f"op {op.name!r} reads {src_name!r}, which is not an op of the block")
            triples.append((index[src_name], j, slot))
    if periodic:
        ins = [i for i, op in enumerate(ops) if op.kind == "input"]
        outs = [i for i, op in enumerate(ops) if op.kind == "output"]
        if len(ins) == 1 and len(outs) == 1:
            triples.append((outs[0], ins[0], -1))
    edges = []
    for i, j, slot in triples:
        pairs = _edge_pairs(ops, costed, i, j, slot, ctx=ctx, mesh=mesh, recompute=recompute)
        matrix = tuple(tuple(math.inf if c is None else _time_s(ctx, c) for c in row) for row in pairs)
        edges.append(intra_op.ShardingEdge(src=i, dst=j, cost_s=matrix))
    problem = intra_op.ShardingProblem(
        op_names=tuple(op.name for op in ops),
        strategy_names=tuple(tuple(c.strategy.name for c in row) for row in costed),
        compute_s=tuple(tuple(c.fwd_s + c.bwd_s + c.rec_s for c in row) for row in costed),
        comm_s=tuple(tuple(c.comm_s for c in row) for row in costed),
        memory_bytes=tuple(tuple(c.memory_bytes for c in row) for row in costed),
        edges=tuple(edges),
        memory_budget_bytes=mem_budget_bytes,
    )
    return BlockProblem(problem=problem, ops=tuple(ops), costed=costed, edges=tuple(triples))


# --- reading a solution back ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockStrategy:
    """The chosen sharding of one block and its predicted cost for one micro-batch on one device."""

    shardings: tuple[ModuleSharding, ...]
    """Style per parameter-owning module, keyed by module FQN relative to the block."""
    op_strategies: tuple[tuple[str, str], ...]
    """(op name, strategy name) for every coarsened op (also the parameter-free ones)."""
    compute_fwd_s: float = 0.0
    compute_bwd_s: float = 0.0
    """Backward compute without recomputation."""
    wgrad_s: float = 0.0
    recompute_s: float = 0.0
    comm_s: dict[str, dict[str, float]] = field(default_factory=dict)
    """Seconds of collectives by phase (forward, backward, recompute) and link kind."""
    collectives: tuple[tuple[str, str, str, float, int], ...] = ()
    """(phase, axis, op, full bytes, count) of every collective one micro-batch issues."""
    memory_bytes: float = 0.0
    """Per device: ``state_bytes + activation_multiplier * activation_bytes`` (what the budget bounded)."""
    state_bytes: float = 0.0
    """Model states (weights, gradients, optimizer) of the block's parameter shards on one device."""
    activation_bytes: float = 0.0
    """Activations one micro-batch keeps for the backward pass on one device."""
    full_activation_bytes: float = 0.0
    """The same without recomputation: what a recomputed block rebuilds before its backward."""
    logits_bytes: float = 0.0
    """Output bytes of the block's LM head op(s) on one device (the logits the loss reads)."""
    params_local: float = 0.0
    """Dense parameters one device holds."""
    expert_params_local: float = 0.0
    solver: dict[str, Any] = field(default_factory=dict)
    """status, objective_s, bound_s, gap, solve_time_s, num_variables, num_constraints."""

    @property
    def time_fwd_s(self) -> float:
        return self.compute_fwd_s + self.comm_fwd_s

    @property
    def time_bwd_s(self) -> float:
        """Backward time including recomputation and its collectives."""
        return self.compute_bwd_s + self.recompute_s + self.comm_bwd_s

    @property
    def comm_fwd_s(self) -> float:
        return sum(self.comm_s.get("forward", {}).values())

    @property
    def comm_bwd_s(self) -> float:
        return sum(self.comm_s.get("backward", {}).values()) + sum(self.comm_s.get("recompute", {}).values())

    @property
    def comm_bytes_by_kind(self) -> dict[str, float]:
        """Full buffer bytes per collective, forward + backward, keyed ``<axis>_<kind>`` (``tp_all_reduce``)."""
        out: dict[str, float] = {}
        for _, axis, op, nbytes, count in self.collectives:
            out[f"{axis}_{op}"] = out.get(f"{axis}_{op}", 0.0) + nbytes * count
        return out

    def style_of(self, fqn: str) -> str:
        for m in self.shardings:
            if m.fqn == fqn:
                return m.style
        raise KeyError(fqn)


def read_solution(bp: BlockProblem, sol: intra_op.ShardingSolution, *, ctx: CostContext, mesh: MeshShape,
                  recompute: str) -> BlockStrategy:
    chosen = [bp.costed[i][k] for i, k in enumerate(sol.choice)]
    comm = [item for c in chosen for item in c.comm]
    for i, j, slot in bp.edges:
        pairs = _edge_pairs(bp.ops, bp.costed, i, j, slot, ctx=ctx, mesh=mesh, recompute=recompute)
        comm.extend(pairs[sol.choice[i]][sol.choice[j]] or ())
    by_phase: dict[str, dict[str, float]] = {}
    counted: dict[tuple[str, str, str, float], int] = {}
    for phase, c, n in comm:
        kind, t = ctx.collective(c)
        if t > 0 or c.nbytes > 0:
            row = by_phase.setdefault(phase, {})
            row[kind or c.axis] = row.get(kind or c.axis, 0.0) + t * n
            key = (phase, c.axis, c.kind, float(c.nbytes))
            counted[key] = counted.get(key, 0) + n
    shardings = sorted(
        {ModuleSharding(fqn=m, style=c.strategy.style) for op, c in zip(bp.ops, chosen) for m in op.modules},
        key=lambda m: m.fqn,
    )
    experts = [c for op, c in zip(bp.ops, chosen) if op.kind == "experts"]
    expert_params = sum(op.params * c.strategy.param_fraction for op, c in zip(bp.ops, chosen) if op.kind == "experts")
    dense_params = sum(op.params * c.strategy.param_fraction for op, c in zip(bp.ops, chosen) if op.kind != "experts")
    return BlockStrategy(
        shardings=tuple(shardings),
        op_strategies=tuple((op.name, c.strategy.name) for op, c in zip(bp.ops, chosen)),
        compute_fwd_s=sum(c.fwd_s for c in chosen), compute_bwd_s=sum(c.bwd_s for c in chosen),
        wgrad_s=sum(c.wgrad_s for c in chosen), recompute_s=sum(c.rec_s for c in chosen),
        comm_s=by_phase,
        collectives=tuple((ph, axis, kind, nbytes, n) for (ph, axis, kind, nbytes), n in counted.items()),
        memory_bytes=sol.memory_bytes,
        state_bytes=sum(c.state_bytes for c in chosen),
        activation_bytes=sum(c.act_bytes for c in chosen),
        full_activation_bytes=sum(c.full_act_bytes for c in chosen),
        logits_bytes=sum(op.out_bytes * c.strategy.act_fraction / mesh.cp
                         for op, c in zip(bp.ops, chosen) if op.kind == "head"),
        params_local=dense_params, expert_params_local=expert_params if experts else 0.0,
        solver={"status": sol.status, "objective_s": sol.objective, "bound_s": sol.bound, "gap": sol.gap,
                "solve_time_s": sol.solve_time_s, "num_variables": sol.num_variables,
                "num_constraints": sol.num_constraints},
    )


# --- memoized entry -----------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class StrategyCache:
    """Memo of solved blocks, keyed by everything a solution depends on; pass one per planning run."""

    entries: dict[tuple, BlockStrategy] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    solutions: dict[tuple, intra_op.ShardingSolution] = field(default_factory=dict)
    """The ILP's answer per (problem, solver options): contexts that differ in what the block's problem does not
    read (an embedding's or head's recomputation, say) build equal problems, solved once."""

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
                periodic: bool = True, cache: StrategyCache | None = None) -> BlockStrategy:
    """Build, solve and read back the sharding problem of ``ops`` (the block is not memoized: see
    ``block_strategy``; the ILP's solution is, per equal problem, in ``cache``)."""
    bp = block_problem(ops, mesh=mesh, ctx=ctx, recompute=recompute, state_bytes_per_param=state_bytes_per_param,
                       activation_multiplier=activation_multiplier, mem_budget_bytes=mem_budget_bytes,
                       periodic=periodic)
    options = options or intra_op.SolverOptions()
    key = (bp.problem, options)
    sol = None if cache is None else cache.solutions.get(key)
    if sol is None:
        sol = intra_op.solve(bp.problem, options)
        if cache is not None:
            cache.solutions[key] = sol
    log.debug("block of %d ops on %s: %s objective %.3g s in %.3f s", len(ops), mesh, sol.status, sol.objective,
              sol.solve_time_s)
    return read_solution(bp, sol, ctx=ctx, mesh=mesh, recompute=recompute)


def block_strategy(block, *, graph, tp: int, cp: int = 1, ep: int = 1, microbatch: int, seq: int,
                   sequence_parallel: bool = False, recompute: str = "none", cluster, device=None,
                   dtype: str = "bf16", mem_budget_bytes: float = math.inf, state_bytes_per_param: float = 16.0,
                   activation_multiplier: float = 1.0, first_rank: int = 0,
                   options: intra_op.SolverOptions | None = None, cost: CostOptions = CostOptions(),
                   cache: StrategyCache | None = None, ops: Sequence[LayerOp] | None = None) -> BlockStrategy:
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
    gpu = device if device is not None else cluster.node_type_of_rank(first_rank).gpu
    mesh = _mesh(tp=tp, cp=cp, ep=ep, sequence_parallel=sequence_parallel, gpu=gpu)
    key = (getattr(block, "signature", None) or block.name, mesh, microbatch, seq, recompute, gpu.name, dtype,
           cluster_key(cluster), first_rank, mem_budget_bytes, state_bytes_per_param, activation_multiplier,
           options, cost)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    if ops is None:
        ops = layer_ops_from_block(block, graph, microbatch=microbatch, seq=seq, dtype=dtype)
    ctx = _cost_context(block, ops, mesh=mesh, gpu=gpu, cluster=cluster, microbatch=microbatch, seq=seq,
                        dtype=dtype, first_rank=first_rank, cost=cost)
    try:
        result = solve_block(ops, mesh=mesh, ctx=ctx, recompute=recompute,
                             state_bytes_per_param=state_bytes_per_param, activation_multiplier=activation_multiplier,
                             mem_budget_bytes=mem_budget_bytes, options=options,
                             periodic=getattr(block, "kind", "transformer") == "transformer", cache=cache)
    except InfeasiblePlanError as e:
        raise _explain_infeasible(e, block=block, ops=ops, mesh=mesh) from None
    if cache is not None:
        cache.put(key, result)
    return result


def reprice_strategy(block, strategy: BlockStrategy, *, ops: Sequence[LayerOp], tp: int, cp: int = 1, ep: int = 1,
                     microbatch: int, seq: int, sequence_parallel: bool = False, recompute: str = "none", cluster,
                     device=None, dtype: str = "bf16", first_rank: int = 0,
                     cost: CostOptions = CostOptions()) -> BlockStrategy:
    """``strategy`` (a solution of ``block_strategy`` for the same block and arguments) priced over ``ops``
    instead: the block's coarse ops, of the same names, as traced under another dtype regime
    (``planner.search.block_cost.GraphCoster``: fp32 parameters under bf16 autocast, ``dtype="traced"`` ops).
    The shardings are the solution's, op for op; its compute, collectives (their bytes at the dtypes the regime
    moves) and kept activations are those of ``ops``; the solver record is the solution's."""
    gpu = device if device is not None else cluster.node_type_of_rank(first_rank).gpu
    mesh = _mesh(tp=tp, cp=cp, ep=ep, sequence_parallel=sequence_parallel, gpu=gpu)
    ctx = _cost_context(block, ops, mesh=mesh, gpu=gpu, cluster=cluster, microbatch=microbatch, seq=seq,
                        dtype=dtype, first_rank=first_rank, cost=cost)
    chosen = dict(strategy.op_strategies)
    if [op.name for op in ops] != [name for name, _ in strategy.op_strategies]:
        raise ConfigError(f"block {block.name!r}: the ops given are not those the strategy was solved for")
    bp = block_problem(ops, mesh=mesh, ctx=ctx, recompute=recompute,
                       periodic=getattr(block, "kind", "transformer") == "transformer")
    choice = tuple(bp.problem.strategy_names[i].index(chosen[op.name]) for i, op in enumerate(ops))
    p = bp.problem
    sol = intra_op.ShardingSolution(choice=choice, objective=intra_op.evaluate(p, choice), bound=0.0, gap=0.0,
                                    status=strategy.solver.get("status", "FEASIBLE"), solve_time_s=0.0,
                                    memory_bytes=intra_op.memory_of(p, choice))
    return replace(read_solution(bp, sol, ctx=ctx, mesh=mesh, recompute=recompute), solver=dict(strategy.solver))


def _mesh(*, tp: int, cp: int, ep: int, sequence_parallel: bool, gpu) -> MeshShape:
    return MeshShape(tp=tp, cp=cp, ep=ep, sequence_parallel=bool(sequence_parallel and tp > 1),
                     backend="gloo" if gpu.kind == "cpu" else "nccl")  # runtime.mesh.init_distributed's choice


def _cost_context(block, ops: Sequence[LayerOp], *, mesh: MeshShape, gpu, cluster, microbatch: int, seq: int,
                  dtype: str, first_rank: int, cost: CostOptions) -> CostContext:
    attn = getattr(block, "attn_flops_fwd", 0.0)
    causal = getattr(block, "attn_flops_fwd_causal", attn) / attn if attn else 1.0
    return cluster_cost_context(cluster, mesh=mesh, device=gpu, dtype=dtype, first_rank=first_rank,
                                sustained_compute=cost.sustained_compute,
                                fused_input_projections=cost.fused_input_projections, flash=cost.flash,
                                causal_fraction=causal, attention_shape=_attention_shape(ops, seq, microbatch),
                                softmax_bytes=cost.softmax_bytes, cost=cost)


def _attention_shape(ops: Sequence[LayerOp], seq: int, microbatch: int) -> tuple[int, int, int] | None:
    """(heads, seq, head_dim) of the block's attention core, from its FLOPs ``4 b heads s^2 head_dim``."""
    for op in ops:
        if op.kind == "attention" and op.shard_dims and op.flops_fwd > 0:
            heads = op.shard_dims[0]
            return heads, seq, max(1, round(op.flops_fwd / (4.0 * microbatch * heads * seq * seq)))
    return None


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


def cluster_key(cluster) -> tuple:
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
