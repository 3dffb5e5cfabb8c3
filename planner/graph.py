"""The operator graph: ops with shapes, FLOPs and bytes, edges with the bytes that flow, and blocks.

``OpGraph`` is what ``planner.trace.trace`` returns. ``coarsen`` folds view / reshape / elementwise / dropout
ops into the op that produces their input. ``find_blocks`` groups ops into blocks -- one per transformer
layer module, plus ``embedding`` (everything before the first layer) and ``head`` (everything after the last)
-- and ``find_block_groups`` finds the identical ones (same op sequence, shapes and parameter shapes: the same
signature) so later stages solve one block and reuse it.

All numbers are for the traced inputs (one micro-batch). Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterable, Literal

OpClass = Literal["matmul", "attention", "embedding", "norm", "elementwise", "reduction", "view", "other"]
BlockKind = Literal["embedding", "transformer", "head", "other"]
ParamRef = tuple[str, tuple[int, ...], str]
"""(parameter FQN, shape, dtype)."""

_FOLDABLE = frozenset({"view", "elementwise"})


@dataclass(frozen=True, kw_only=True, slots=True)
class OpNode:
    """One aten op of the forward pass (or, after ``coarsen``, an op with the ops folded into it)."""

    name: str
    target: str
    """The aten op, e.g. ``aten.linear.default``."""
    op_class: OpClass
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[str, ...]
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    """Backward FLOPs the kernels execute (see ``planner.flops`` for the rules)."""
    flops_bwd_recompute: float = 0.0
    """Part of ``flops_bwd`` that recomputes forward work (flash attention's QK^T); model FLOPs leave it out."""
    causal_fraction: float = 1.0
    """Attention: fraction of the score matrix a causal kernel computes (1.0 = dense / not causal)."""
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    saved_bytes: float | None = None
    """Bytes autograd keeps for backward because of this op (``planner.saved``; None: not measured)."""
    backward_bytes: float | None = None
    """Most bytes this op's backward holds beyond what was live when its block's backward began, parameter
    gradients aside (``planner.saved.backward_excess_by_node``; None: not measured)."""
    params: tuple[ParamRef, ...] = ()
    module_fqn: str = ""
    """Innermost module the op ran in (from ``nn_module_stack``); ``""`` for the root."""
    module_type: str = ""
    """Class name of that module (``LlamaRMSNorm``, ``Linear``): tells a norm built of pointwise ops."""
    block: str = ""
    """Block the op belongs to: ``embedding``, a layer FQN (``model.layers.3``) or ``head``."""
    covered: bool = True
    """False when no FLOP rule knows this op."""
    folded: tuple[str, ...] = ()
    """Targets of the ops ``coarsen`` folded into this one."""

    @property
    def flops_fwd_causal(self) -> float:
        return self.flops_fwd * self.causal_fraction

    @property
    def flops_bwd_model(self) -> float:
        """Backward model FLOPs (no recomputation), the Eq. 3 convention."""
        return self.flops_bwd - self.flops_bwd_recompute


@dataclass(frozen=True, kw_only=True, slots=True)
class Edge:
    src: str
    dst: str
    nbytes: float
    """Size of the tensor flowing from ``src`` to ``dst`` (after coarsening: the largest of those merged)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OpGraph:
    """A traced forward pass. Parameters are listed once each (tied weights once) in ``param_sizes``."""

    nodes: tuple[OpNode, ...]
    edges: tuple[Edge, ...]
    param_sizes: tuple[tuple[str, int], ...]
    """(FQN, number of elements) of every parameter some op uses, in first-use order."""
    layer_fqns: tuple[str, ...] = ()
    """FQNs of the transformer layer modules, in execution order."""
    traced_layers: int = 0
    """Layers torch.export actually traced (fewer than ``len(layer_fqns)`` when the shortcut expanded them)."""
    module_kinds: tuple[tuple[str, str], ...] = ()
    """(module FQN, ``linear`` / ``embedding``) for the model's ``nn.Linear`` / ``nn.Embedding`` modules (subclasses
    included): the modules DTensor's ColwiseParallel / RowwiseParallel accept. Empty when not recorded."""
    unsupported: tuple[tuple[str, int], ...] = ()
    """Coverage: ops with no FLOP rule, (op name, count) in the expanded graph."""
    trace_time_s: float = 0.0

    @property
    def params(self) -> int:
        return sum(n for _, n in self.param_sizes)

    @property
    def flops_fwd(self) -> float:
        return sum(n.flops_fwd for n in self.nodes)

    @property
    def flops_bwd(self) -> float:
        return sum(n.flops_bwd for n in self.nodes)

    @property
    def model_flops(self) -> float:
        """Forward + backward model FLOPs, dense attention, no recomputation (Megatron SC21 Eq. 3)."""
        return sum(n.flops_fwd + n.flops_bwd_model for n in self.nodes)

    @property
    def model_flops_causal(self) -> float:
        """As ``model_flops`` with causal attention counted as causal kernels compute it."""
        return sum((n.flops_fwd + n.flops_bwd_model) * n.causal_fraction for n in self.nodes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """A group of ops: a transformer layer, or the embedding / head part of the model."""

    name: str
    """The layer's module FQN (``model.layers.3``), or ``embedding`` / ``head``."""
    kind: BlockKind
    modules: tuple[str, ...]
    """Module FQNs whose ops the block holds (the layer FQN for a layer)."""
    ops: tuple[str, ...]
    params: int
    """Parameters first used by this block (tied weights counted once, on the first block that uses them)."""
    param_fqns: tuple[str, ...]
    expert_params: int
    flops_fwd: float
    flops_bwd: float
    flops_bwd_recompute: float
    attn_flops_fwd: float
    attn_flops_fwd_causal: float
    act_bytes: float
    """Bytes of the outputs of the block's non-view ops: what eager autograd may keep for backward (upper bound)."""
    bytes_fwd: float
    """Bytes read + written by the forward pass."""
    signature: str


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockGroup:
    """Identical blocks (same signature), in execution order."""

    signature: str
    members: tuple[str, ...]
    ops_per_block: int
    params_per_block: int

    @property
    def repeat(self) -> int:
        return len(self.members)


def relative(fqn: str, prefix: str) -> str:
    if prefix and (fqn == prefix or fqn.startswith(prefix + ".")):
        return fqn[len(prefix) + 1:]
    return fqn


def op_signature(nodes: Iterable[OpNode], prefix: str) -> str:
    """Hash of the op sequence: targets, shapes, dtypes, module paths and parameter shapes relative to ``prefix``."""
    h = hashlib.sha256()
    for n in nodes:
        params = tuple((relative(f, prefix), s, d) for f, s, d in n.params)
        h.update(repr((n.target, n.input_shapes, n.output_shapes, n.output_dtypes,
                       relative(n.module_fqn, prefix), params, n.folded)).encode())
    return h.hexdigest()[:16]


# --- coarsening ---------------------------------------------------------------------------------------------


def coarsen(graph: OpGraph) -> OpGraph:
    """Fold view / reshape / elementwise / dropout ops into the op producing their first input.

    An op is folded only into a producer of the same block (so block boundaries stay where they were); an op
    with no such producer stays. FLOPs, bytes and parameters of folded ops add to the surviving op; edges are
    re-pointed, self-loops dropped, and parallel edges merged (keeping the largest tensor).
    """
    preds: dict[str, list[str]] = {}
    for e in graph.edges:
        preds.setdefault(e.dst, []).append(e.src)
    by_name = {n.name: n for n in graph.nodes}
    into: dict[str, str] = {}  # folded op -> surviving op
    merged: dict[str, list[OpNode]] = {}
    order: list[str] = []
    for n in graph.nodes:
        src = next((p for p in preds.get(n.name, ()) if by_name[p].block == n.block), None)
        if n.op_class in _FOLDABLE and src is not None:
            root = into.get(src, src)
            into[n.name] = root
            merged[root].append(n)
        else:
            order.append(n.name)
            merged[n.name] = [n]
    nodes = tuple(_merge(merged[name]) for name in order)
    best: dict[tuple[str, str], float] = {}
    for e in graph.edges:
        key = (into.get(e.src, e.src), into.get(e.dst, e.dst))
        if key[0] != key[1]:
            best[key] = max(best.get(key, 0.0), e.nbytes)
    edges = tuple(Edge(src=s, dst=d, nbytes=b) for (s, d), b in best.items())
    return replace(graph, nodes=nodes, edges=edges)


def _merge(group: list[OpNode]) -> OpNode:
    head, rest = group[0], group[1:]
    if not rest:
        return head
    params = dict.fromkeys(head.params)
    for n in rest:
        params.update(dict.fromkeys(n.params))
    last = rest[-1]
    return replace(
        head,
        output_shapes=last.output_shapes,
        output_dtypes=last.output_dtypes,
        flops_fwd=head.flops_fwd + sum(n.flops_fwd for n in rest),
        flops_bwd=head.flops_bwd + sum(n.flops_bwd for n in rest),
        flops_bwd_recompute=head.flops_bwd_recompute + sum(n.flops_bwd_recompute for n in rest),
        bytes_read=head.bytes_read + sum(n.bytes_read for n in rest),
        bytes_written=head.bytes_written + sum(n.bytes_written for n in rest),
        params=tuple(params),
        covered=head.covered and all(n.covered for n in rest),
        folded=head.folded + tuple(n.target for n in rest),
    )


# --- blocks -------------------------------------------------------------------------------------------------


def find_blocks(graph: OpGraph) -> list[Block]:
    """One block per transformer layer, plus ``embedding`` and ``head``, in execution order."""
    groups: dict[str, list[OpNode]] = {}
    for n in graph.nodes:
        groups.setdefault(n.block or "other", []).append(n)
    layers = set(graph.layer_fqns)
    seen: set[str] = set()
    sizes = dict(graph.param_sizes)
    blocks = []
    for name, nodes in groups.items():
        kind: BlockKind = "transformer" if name in layers else name if name in ("embedding", "head") else "other"
        owned = []
        for n in nodes:
            for fqn, _, _ in n.params:
                if fqn not in seen:
                    seen.add(fqn)
                    owned.append(fqn)
        prefix = name if kind == "transformer" else ""
        blocks.append(Block(
            name=name, kind=kind, modules=(name,) if kind == "transformer" else _modules_of(nodes, layers),
            ops=tuple(n.name for n in nodes),
            params=sum(sizes.get(f, 0) for f in owned), param_fqns=tuple(owned),
            expert_params=sum(sizes.get(f, 0) for f in owned if ".experts." in f"{f}."),
            flops_fwd=sum(n.flops_fwd for n in nodes), flops_bwd=sum(n.flops_bwd for n in nodes),
            flops_bwd_recompute=sum(n.flops_bwd_recompute for n in nodes),
            attn_flops_fwd=sum(n.flops_fwd for n in nodes if n.op_class == "attention"),
            attn_flops_fwd_causal=sum(n.flops_fwd_causal for n in nodes if n.op_class == "attention"),
            act_bytes=sum(n.bytes_written for n in nodes if n.op_class != "view"),
            bytes_fwd=sum(n.bytes_read + n.bytes_written for n in nodes),
            signature=op_signature(nodes, prefix),
        ))
    return blocks


def _modules_of(nodes: list[OpNode], layers: set[str]) -> tuple[str, ...]:
    """Module FQNs of the ops, without the model root and without ancestors of the layers (containers)."""
    ancestors = {p for fqn in layers for p in _prefixes(fqn)}
    mods = [n.module_fqn for n in nodes if n.module_fqn and n.module_fqn not in ancestors]
    uniq = list(dict.fromkeys(mods))
    return tuple(m for m in uniq if not any(m.startswith(o + ".") for o in uniq if o != m))


def _prefixes(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def find_block_groups(blocks: list[Block]) -> list[BlockGroup]:
    """Blocks with equal signatures, in order of first appearance (singletons included)."""
    members: dict[str, list[Block]] = {}
    for b in blocks:
        members.setdefault(b.signature, []).append(b)
    return [BlockGroup(signature=sig, members=tuple(b.name for b in bs), ops_per_block=len(bs[0].ops),
                       params_per_block=bs[0].params) for sig, bs in members.items()]


def coverage(graph: OpGraph) -> dict[str, int]:
    """Ops with no FLOP rule, by op name, with counts."""
    return dict(Counter(n.target for n in graph.nodes if not n.covered))


def pipeline_blocker(graph: OpGraph, blocks: list[Block]) -> str:
    """Why the blocks are no chain a pipeline can cut (empty when they are): at some boundary between two
    consecutive blocks more than one tensor computed from parameters is read after it (a skip connection around
    layers, a layer's second output used later). A pipeline stage hands one tensor to the next, so such a model
    runs with pp = 1 only. Tensors computed from no parameter (masks, position ids, rotary tables) do not count:
    the runtime recomputes them per stage. Linear in ops and edges."""
    index = {name: i for i, b in enumerate(blocks) for name in b.ops}
    consumers: dict[str, list[str]] = {}
    for e in graph.edges:
        consumers.setdefault(e.src, []).append(e.dst)
    weighted: set[str] = set()  # ops whose output depends on a parameter (nodes are in execution order)
    producers: dict[str, list[str]] = {}
    for e in graph.edges:
        producers.setdefault(e.dst, []).append(e.src)
    for n in graph.nodes:
        if n.params or any(p in weighted for p in producers.get(n.name, ())):
            weighted.add(n.name)
    cover = [0] * (len(blocks) + 1)  # cover[b]: weighted tensors crossing boundary b (block b-1 | block b)
    examples: dict[int, list[str]] = {}
    for src in weighted:
        lo = index.get(src)
        hi = max((index.get(d, -1) for d in consumers.get(src, ())), default=-1)
        if lo is None or hi <= lo:
            continue
        cover[lo + 1] += 1
        cover[hi + 1] -= 1
        for b in range(lo + 1, min(hi, lo + 2) + 1):  # names for the first boundaries it crosses
            examples.setdefault(b, []).append(src)
    running = 0
    for b in range(1, len(blocks)):
        running += cover[b]
        if running > 1:
            names = ", ".join(sorted(examples.get(b, []))[:3]) + (", ..." if running > 3 else "")
            return (f"{running} tensors computed from parameters cross the boundary between blocks "
                    f"{blocks[b - 1].name!r} and {blocks[b].name!r} (ops {names}), "
                    "so the blocks are not a chain a pipeline can cut (a skip connection around layers, or a layer's "
                    "second output used later)")
    return ""
