"""Per-op sharding candidates on the tensor-parallel axis, and resharding costs between their layouts.

The ops here are the coarsened ops of one block (``LayerOp``: a group of linears that read the same input, the
attention core, a norm, a pointwise op, a residual add, ...), built from a traced ``planner.graph.Block`` by
``planner.search.block_ops``. Each candidate (``OpStrategy``) says which layout it needs on each input, which
layout its input gradients come back in, which layout it produces, and what it costs. Activation layouts on
the tp axis are DTensor placements:

    ``R``      Replicate()                  ``S_seq``  Shard(1): tokens split (sequence parallel)
    ``S_hid``  Shard(-1): features / heads   ``P``      Partial(): a sum still to be reduced

Candidates, and what torch.distributed executes for each (the ``style`` is a ``planner.plan.SHARDING_STYLES``
entry applied to the op's modules):

    linear     replicate  R -> R                       weights replicated
               colwise    R -> S_hid (grad back: P)    ColwiseParallel, weight Shard(0) (Megatron column)
               rowwise    S_hid -> P                   RowwiseParallel, weight Shard(1) (Megatron row)
    attention  replicate  R -> R
               heads      S_hid -> S_hid               heads split; needs tp | heads AND tp | kv_heads (GQA):
                                                       when tp does not divide kv_heads, attention is
                                                       replicated -- HF attention computes repeat_kv from the
                                                       config's head counts, so a q shard cannot be paired with
                                                       replicated K/V by the runtime.
    norm       replicate  R -> R
               sequence_parallel  S_seq -> S_seq        SequenceParallel (weight grads all-reduced over tp)
    pointwise / add: R, S_hid (pointwise only) or S_seq: work follows the layout, no module style
    embedding  replicate, vocab_embedding (output P)   RowwiseParallel on nn.Embedding (vocab parallel)
    head       replicate, vocab_head (R -> S_hid)      ColwiseParallel(use_local_output=False) on lm_head
    loss       full (R), vocab_parallel (S_hid)        loss_parallel(): all-reduces of max, sum-exp, target
    router     replicate                               the MoE gate (a tiny linear)
    conv       replicate                               convolutions: no tp style shards nn.Conv*d
    batchnorm  replicate                               BatchNorm: its statistics need the whole batch slice
                                                       and the whole image (no SequenceParallel)
    matmul     replicate                               a matmul of two activations (attention written with
                                                       matmul + softmax): no head count to split by
    experts    replicate (ep = 1), expert (ep > 1)     experts sharded over the ep axis, all-to-all dispatch
                                                       and combine, forward and backward, after the routing
                                                       all-to-alls (row counts, expert ids); tokens enter
                                                       replicated over tp (no style runs an experts module on
                                                       sequence-sharded tokens)
    input / output  R, or S_seq with sequence parallelism   every block boundary has the same layout

Resharding on an edge (``forward_conversion``): S_seq -> R all-gather, P -> R all-reduce, P -> S_seq
reduce-scatter; other changes (R -> S_* slices, S_hid -> R gathers, S_seq <-> S_hid all-to-all) are not
expressible by a module style and are forbidden pairs for the ILP, except R -> S_seq into the block's output
(PrepareModuleInput on the next block: a local slice). S_seq -> R feeds only colwise linears and the LM head
(ColwiseParallel(input_layouts=Shard(1)) gathers): with sequence parallelism a replicated linear, router or
experts module cannot get the full sequence, so such blocks have no sequence-parallel plan.

The backward pass converts the consumer's input gradient back to the producer's output layout
(``conversion``; the gradient of a P output is R), so Megatron's ``f``/``g`` operators appear as edge costs:
colwise after a replicated norm costs one backward all-reduce, with sequence parallelism an all-gather forward
and a reduce-scatter backward. Linears reading one tensor (q/k/v, gate/up) are one op, as Megatron fuses them,
so their input gradient is all-reduced once.

Batch sharding is not offered on the tp axis: splitting the batch is the data-parallel axis (dp x ep ranks),
chosen by the stage search, and no SHARDING_STYLES entry / torch TP style switches a module between batch
and feature sharding inside a block. Context parallelism (``cp > 1``) splits every op's tokens over the cp
axis; attention gathers K/V over the cp group in the forward, keeps them, and reduces dK/dV to each rank's slice
in the backward (``_cp_collectives``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Literal

from costmodel.collectives import ROUTING_INDEX_BYTES

Layout = Literal["R", "S_seq", "S_hid", "P"]
OpKind = Literal[
    "input", "output", "linear", "attention", "norm", "pointwise", "add", "embedding", "head", "loss",
    "experts", "router", "conv", "batchnorm", "matmul",
]
CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
Axis = Literal["tp", "cp", "ep"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerOp:
    """One coarsened op of a block, with its work for one micro-batch (all numbers unsharded)."""

    name: str
    kind: OpKind
    inputs: tuple[str, ...] = ()
    """Names of the ``LayerOp`` s producing this op's inputs, in input order."""
    modules: tuple[str, ...] = ()
    """Parameter-owning module FQNs (relative to the block) that take this op's ``style``."""
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    bytes_fwd: float = 0.0
    """Bytes read + written in the forward pass (memory-bound ops)."""
    out_bytes: float = 0.0
    """Size of the output activation (what a layout conversion of the output moves)."""
    saved_bytes: float = 0.0
    """Activation bytes kept for the backward pass."""
    params: int = 0
    shard_dims: tuple[int, ...] = ()
    """Sizes a tp split must divide: linears (out features per member, in features), attention (heads,
    kv_heads), embedding / head (vocab)."""
    op_class: str = "other"
    """``planner.graph`` op class (matmul, attention, norm, ...) for the compute cost model."""
    dispatch_bytes: float = 0.0
    """Experts: bytes one all-to-all moves (tokens * topk * hidden * dtype bytes)."""
    dispatch_rows: float = 0.0
    """Experts: (token, expert) rows one rank dispatches (tokens * topk)."""
    experts: int = 0
    """Experts: how many experts the module holds (before expert parallelism)."""
    mnk: tuple[int, ...] = ()
    """Matmul shape ``(m, n, k)`` (tokens, output features summed over the group, input features)."""
    param_bytes: float = 0.0
    """Bytes of the op's parameters (and of their gradients) in the priced dtype; 0: 2 per parameter."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    kind: CollectiveKind
    nbytes: float
    axis: Axis = "tp"


@dataclass(frozen=True, kw_only=True, slots=True)
class OpStrategy:
    name: str
    style: str
    """``planner.plan.SHARDING_STYLES`` entry for the op's modules."""
    in_layouts: tuple[Layout, ...]
    grad_layouts: tuple[Layout, ...]
    """Layout of the gradient this op returns for each input."""
    out_layout: Layout
    work_fraction: float
    """Share of the op's FLOPs and bytes one tp rank does."""
    param_fraction: float
    act_fraction: float
    comm_fwd: tuple[Collective, ...] = ()
    comm_bwd: tuple[Collective, ...] = ()
    matmul_split: str = ""
    """Which matmul dimension the strategy splits over tp: ``n`` (column), ``k`` (row) or none."""
    gathers_sequence: bool = False
    """The style can take a sequence-sharded input and all-gather it (ColwiseParallel input_layouts=Shard(1));
    other replicated consumers cannot be fed from S_seq (the runtime gathers only into colwise regions)."""

    def local_mnk(self, mnk: tuple[int, ...], *, tp: int, cp: int) -> tuple[int, ...] | None:
        """The matmul shape one rank runs (None when the op has no matmul shape)."""
        if len(mnk) != 3:
            return None
        m, n, k = mnk
        return (max(1, m // cp), max(1, n // tp) if self.matmul_split == "n" else n,
                max(1, k // tp) if self.matmul_split == "k" else k)


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshShape:
    tp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    backend: str = "nccl"
    """The collective backend the runtime runs on these devices (``runtime.mesh.init_distributed``: NCCL on GPUs,
    gloo on CPUs): it decides how context parallelism reduces the K / V gradient (``_cp_collectives``)."""


def dual(layout: Layout) -> Layout:
    """Layout of the gradient of a tensor with this layout (the gradient of a Partial sum is replicated)."""
    return "R" if layout == "P" else layout


EXECUTABLE_CONVERSIONS: frozenset[tuple[Layout, Layout]] = frozenset({
    ("S_seq", "R"),  # all-gather: ColwiseParallel / PrepareModuleInput with input_layouts=Shard(1)
    ("P", "R"),  # all-reduce: RowwiseParallel output_layouts=Replicate(); vocab-parallel embedding
    ("P", "S_seq"),  # reduce-scatter: RowwiseParallel output_layouts=Shard(1) (sequence parallel)
})
"""Forward layout changes the module styles perform. Others (a free slice R -> S_*, S_hid -> R) would need
per-module input/output layouts that a ``ModuleSharding`` (fqn, style) cannot express, so they are forbidden."""


def conversion(src: Layout, dst: Layout, nbytes: float) -> tuple[Collective, ...]:
    """Collectives converting a tensor of ``nbytes`` (full size) from ``src`` to ``dst`` over tp (any pair; the
    backward pass uses this for gradients, where autograd performs whatever the forward implied)."""
    if src == dst or src == "R":
        return ()  # same layout, or a local slice of a replicated tensor
    if dst == "P":
        raise ValueError(f"no conversion produces a Partial tensor from {src}")
    if src == "P":
        kind: CollectiveKind = "all_reduce" if dst == "R" else "reduce_scatter"
    elif dst == "R":
        kind = "all_gather"
    else:
        kind = "all_to_all"  # S_seq <-> S_hid
    return (Collective(kind=kind, nbytes=nbytes),)


def forward_conversion(src: Layout, dst: Layout, nbytes: float, *, at_block_boundary: bool = False,
                       consumer_gathers: bool = True) -> tuple[Collective, ...] | None:
    """Like ``conversion`` for the forward pass, or None when the runtime cannot perform the change. At a block
    boundary a replicated tensor may also be sliced along the sequence (PrepareModuleInput on the next block,
    input_layouts=Replicate(), desired_input_layouts=Shard(1)); S_seq -> R only into a consumer whose style
    gathers (``consumer_gathers``)."""
    if at_block_boundary and (src, dst) == ("R", "S_seq"):
        return ()
    if (src, dst) == ("S_seq", "R") and not consumer_gathers:
        return None
    if src != dst and (src, dst) not in EXECUTABLE_CONVERSIONS:
        return None
    return conversion(src, dst, nbytes)


def _divides(tp: int, sizes: tuple[int, ...]) -> bool:
    """``tp`` splits every size evenly (no sizes, or a zero: not shardable)."""
    return bool(sizes) and all(d > 0 and d % tp == 0 for d in sizes)


def _same(name: str, style: str, layout: Layout, n_in: int, frac: float, **kw) -> OpStrategy:
    return OpStrategy(
        name=name, style=style, in_layouts=(layout,) * n_in, grad_layouts=(layout,) * n_in, out_layout=layout,
        work_fraction=frac, param_fraction=kw.pop("param_fraction", 1.0), act_fraction=frac, **kw,
    )


def _linear(op: LayerOp, mesh: MeshShape) -> list[OpStrategy]:
    t = mesh.tp
    out = [_same("replicate", "replicate", "R", 1, 1.0)]
    if t == 1:
        return out
    if not op.shard_dims:  # not an nn.Linear (e.g. GPT-2's Conv1D): the TP styles cannot shard it
        return out
    *outs, fan_in = op.shard_dims
    if _divides(t, tuple(outs)):
        out.append(OpStrategy(name="colwise", style="colwise", in_layouts=("R",), grad_layouts=("P",),
                              out_layout="S_hid", work_fraction=1 / t, param_fraction=1 / t, act_fraction=1 / t,
                              matmul_split="n", gathers_sequence=True))
    if fan_in % t == 0 and fan_in > 0 and len(op.modules) == 1:
        out.append(OpStrategy(name="rowwise", style="rowwise", in_layouts=("S_hid",), grad_layouts=("S_hid",),
                              out_layout="P", work_fraction=1 / t, param_fraction=1 / t, act_fraction=1.0,
                              matmul_split="k"))
    return out


def _attention(op: LayerOp, mesh: MeshShape) -> list[OpStrategy]:
    t, n = mesh.tp, len(op.inputs)
    cp_fwd, cp_bwd = _cp_collectives(op, mesh)
    out = [_same("replicate", "replicate", "R", n, 1.0, comm_fwd=cp_fwd, comm_bwd=cp_bwd)]
    if t > 1 and _divides(t, op.shard_dims):  # shard_dims = (heads, kv_heads)
        heads = _same("heads", "colwise", "S_hid", n, 1 / t, comm_fwd=cp_fwd, comm_bwd=cp_bwd)
        out.append(_scale_comm(heads, 1 / t))  # each tp rank rings only its own heads' K/V
    return out


def _cp_collectives(op: LayerOp, mesh: MeshShape) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """All-gather context parallelism as ``runtime.context_parallel`` runs it (Llama 3, Dubey et al. 2024,
    Sec. 3.3.2): K and V (2 of the 3 inputs' bytes) gathered once in the forward and kept for the backward, their
    gradients reduced to this rank's slice: a reduce-scatter on NCCL, an all-reduce (and a local slice) on gloo,
    whose reduce-scatter is several times slower than its all-reduce."""
    if mesh.cp == 1:
        return (), ()
    kv_bytes = 2.0 * op.out_bytes * (op.shard_dims[1] / op.shard_dims[0] if op.shard_dims else 1.0)
    reduce: CollectiveKind = "all_reduce" if mesh.backend == "gloo" else "reduce_scatter"
    return ((Collective(kind="all_gather", nbytes=kv_bytes, axis="cp"),),
            (Collective(kind=reduce, nbytes=kv_bytes, axis="cp"),))


def _scale_comm(s: OpStrategy, frac: float) -> OpStrategy:
    scale = lambda cs: tuple(replace(c, nbytes=c.nbytes * frac) for c in cs)  # noqa: E731
    return replace(s, comm_fwd=scale(s.comm_fwd), comm_bwd=scale(s.comm_bwd))


def _norm(op: LayerOp, mesh: MeshShape) -> list[OpStrategy]:
    out = [_same("replicate", "replicate", "R", len(op.inputs), 1.0)]
    if mesh.tp > 1 and mesh.sequence_parallel:
        # the Replicate weight's Partial gradient, all-reduced by DTensor (in the optimizer step)
        wgrad = (Collective(kind="all_reduce", nbytes=op.param_bytes or 2.0 * op.params),) if op.params else ()
        out.append(_same("sequence_parallel", "sequence_parallel", "S_seq", len(op.inputs), 1 / mesh.tp,
                         comm_bwd=wgrad))
    return out


def _pointwise(op: LayerOp, mesh: MeshShape) -> list[OpStrategy]:
    n = len(op.inputs)
    out = [_same("R", "replicate", "R", n, 1.0)]
    if mesh.tp > 1:
        if op.kind != "add":
            out.append(_same("S_hid", "replicate", "S_hid", n, 1 / mesh.tp))
        if mesh.sequence_parallel:
            out.append(_same("S_seq", "sequence_parallel", "S_seq", n, 1 / mesh.tp))
    return out


def _boundary(op: LayerOp, mesh: MeshShape) -> list[OpStrategy]:
    """A block's input / output: replicated, or sequence-sharded when sequence parallelism is on (then every
    block boundary is, so that consecutive blocks agree)."""
    if mesh.tp > 1 and mesh.sequence_parallel:
        return [_same("S_seq", "sequence_parallel", "S_seq", len(op.inputs), 1 / mesh.tp)]
    return [_same("R", "replicate", "R", len(op.inputs), 1.0)]


def _embedding(op: LayerOp, mesh: MeshShape) -> list[OpStrategy]:
    out = [_same("replicate", "replicate", "R", len(op.inputs), 1.0)]
    if mesh.tp > 1 and _divides(mesh.tp, op.shard_dims):
        out.append(OpStrategy(name="vocab_embedding", style="vocab_embedding", in_layouts=("R",) * len(op.inputs),
                              grad_layouts=("R",) * len(op.inputs), out_layout="P", work_fraction=1 / mesh.tp,
                              param_fraction=1 / mesh.tp, act_fraction=1.0))
    return out


def _head(op: LayerOp, mesh: MeshShape) -> list[OpStrategy]:
    out = [_same("replicate", "replicate", "R", 1, 1.0)]
    if mesh.tp > 1 and _divides(mesh.tp, op.shard_dims[:1]):  # shard_dims = (vocab, hidden)
        out.append(OpStrategy(name="vocab_head", style="vocab_head", in_layouts=("R",), grad_layouts=("P",),
                              out_layout="S_hid", work_fraction=1 / mesh.tp, param_fraction=1 / mesh.tp,
                              act_fraction=1 / mesh.tp, matmul_split="n", gathers_sequence=True))
    return out


def _loss(op: LayerOp, mesh: MeshShape) -> list[OpStrategy]:
    out = [_same("full", "replicate", "R", len(op.inputs), 1.0)]
    if mesh.tp > 1:
        # Megatron parallel cross-entropy: all-reduce of the max, the sum of exponentials and the target logit,
        # one fp32 number per token each (op.out_bytes holds tokens * 4 bytes).
        stats = tuple(Collective(kind="all_reduce", nbytes=op.out_bytes) for _ in range(3))
        out.append(_same("vocab_parallel", "vocab_head", "S_hid", len(op.inputs), 1 / mesh.tp, comm_fwd=stats))
    return out


def _experts(op: LayerOp, mesh: MeshShape) -> list[OpStrategy]:
    if mesh.ep == 1:
        return [_same("replicate", "replicate", "R", len(op.inputs), 1.0)]
    # Dispatch and combine all-to-alls over ep, forward and backward; in the forward also the routing
    # (runtime/expert_parallel.py): the rows this rank sends to each ep rank (one int64 per rank), then the local
    # expert id of every row it sends (one int64 per row).
    a2a = tuple(Collective(kind="all_to_all", nbytes=op.dispatch_bytes, axis="ep") for _ in range(2))
    routing = (Collective(kind="all_to_all", nbytes=mesh.ep * ROUTING_INDEX_BYTES, axis="ep"),
               Collective(kind="all_to_all", nbytes=op.dispatch_rows * ROUTING_INDEX_BYTES, axis="ep"))
    # Tokens enter replicated over tp: SequenceParallel (norms, dropout) is the only style that runs a module on
    # sequence-sharded tokens with replicated weights, so a sequence-sharded experts module is not offered.
    return [_same("expert", "expert", "R", len(op.inputs), 1.0, param_fraction=1 / mesh.ep,
                  comm_fwd=routing + a2a, comm_bwd=a2a)]


_RULES: dict[str, Callable[[LayerOp, MeshShape], list[OpStrategy]]] = {
    "input": _boundary, "output": _boundary, "linear": _linear, "router": lambda op, m: _same_list(op),
    "attention": _attention, "norm": _norm, "pointwise": _pointwise, "add": _pointwise,
    "embedding": _embedding, "head": _head, "loss": _loss, "experts": _experts,
    "conv": lambda op, m: _same_list(op), "batchnorm": lambda op, m: _same_list(op),
    "matmul": lambda op, m: _same_list(op),
}


def _same_list(op: LayerOp) -> list[OpStrategy]:
    return [_same("replicate", "replicate", "R", len(op.inputs), 1.0)]


def candidates(op: LayerOp, mesh: MeshShape) -> tuple[OpStrategy, ...]:
    """The strategies op ``op`` may take on a mesh of this shape (never empty: replicate always fits)."""
    return tuple(_RULES[op.kind](op, mesh))
