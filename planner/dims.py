"""``ModelDims``: a model's dimensions, from a config or, for user code, from its traced graph.

``complete_dims(dims, graph)`` fills what a ``module:function`` model's dims leave unknown (0) from the
``OpGraph`` and its parameter shapes (see its docstring for each field); 0 stays where the graph does not show
a number (the heads of an attention written with matmul + softmax, unless the spec gives ``heads=``). What "seq" means, per model kind (``sequence_length``):

- token models (an embedding op indexed by a 2-D integer tensor, ``(batch, seq)``): ``seq`` = S;
- other models with attention (ViT: patches + class token): the query length of the attention ops;
- models without a sequence (MLPs on feature vectors, CNNs): 1, one sample is one token.

Nothing here imports torch.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Literal

from costmodel.errors import ConfigError
from planner.graph import OpGraph, OpNode

log = logging.getLogger(__name__)

Arch = Literal["gpt", "llama", "mixtral", "hf", "custom"]
_CONV = ("aten.conv", "aten.convolution", "aten._convolution")
_SOFTMAX = ("aten.softmax", "aten._softmax", "aten._safe_softmax")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelDims:
    """Transformer dimensions. 0 means unknown (user code whose graph does not show it); the cost model must
    price such a model from its traced ops, never divide by these numbers."""

    arch: Arch
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq: int
    """Tokens per sample (see the module docstring)."""
    experts: int = 0
    topk: int = 0
    glu: bool = False
    """Gated MLP (SwiGLU: gate, up and down matrices) rather than GeLU (up and down)."""
    tied_embeddings: bool = False


def sequence_length(graph: OpGraph) -> int:
    """Tokens per sample of the traced inputs (see the module docstring)."""
    for n in graph.nodes:
        if (n.op_class == "embedding" and len(n.input_shapes) >= 2 and len(n.input_shapes[1]) == 2
                and len(n.input_dtypes) >= 2 and n.input_dtypes[1].startswith(("int", "uint"))):
            return int(n.input_shapes[1][1])  # embedding(weight, ids): ids (B, S)
    lengths = Counter(int(n.input_shapes[0][-2]) for n in graph.nodes
                      if n.op_class == "attention" and n.input_shapes and len(n.input_shapes[0]) >= 3)
    if lengths:
        return lengths.most_common(1)[0][0]
    return 1


def complete_dims(dims: ModelDims, graph: OpGraph) -> ModelDims:
    """``dims`` with its unknown (0) fields filled from ``graph``; configs' dims are returned as they are.

    From the graph: ``layers`` (the layer list), ``hidden`` (the width of the stream entering the first layer:
    its last dim, or its channels for a CNN's (N, C, H, W) stream), ``heads`` / ``kv_heads`` (the sdpa ops'
    (B, H, S, D) query shape; key/value heads from the q/k/v projections' width, as K/V may be repeated to the
    query heads before sdpa), ``ffn_hidden`` and ``glu`` (the widest linears of the first layer that
    read the stream and do not feed attention; two of them: gated), ``vocab`` and ``tied_embeddings`` (the
    embedding indexed by token ids, and whether a matmul reuses its weight), ``seq`` (``sequence_length``).
    ``dims.heads`` / ``kv_heads`` given by the user (spec ``heads=``) fill what the graph does not show and must
    agree with what it does (``ConfigError`` otherwise). What neither gives stays 0: unknown.
    """
    if dims.arch != "custom":
        return dims
    seq = sequence_length(graph)
    if dims.seq and dims.seq != seq:
        log.warning("seq=%d from the example inputs, %d from the traced graph: using the graph's", dims.seq, seq)
    layer = _first_layer(graph)
    hidden = _stream_width(graph, layer)
    heads, kv_heads = _heads(graph, dims, hidden, layer)
    ffn, glu = _ffn(graph, layer, hidden)
    vocab, tied = _vocab(graph)
    return replace(dims, layers=dims.layers or len(graph.layer_fqns), hidden=hidden, heads=heads,
                   kv_heads=kv_heads, ffn_hidden=ffn, glu=glu, vocab=vocab, tied_embeddings=tied, seq=seq)


def _first_layer(graph: OpGraph) -> list[OpNode]:
    first = graph.layer_fqns[0] if graph.layer_fqns else None
    return [n for n in graph.nodes if first is not None and n.block == first]


def _stream_width(graph: OpGraph, layer: list[OpNode]) -> int:
    """Feature width of the largest tensor entering the first layer (0 without a layer list)."""
    inside = {n.name for n in layer}
    by_name = {n.name: n for n in graph.nodes}
    feeds = [(e.nbytes, e.src) for e in graph.edges if e.dst in inside and e.src not in inside]
    if not feeds:
        return 0
    shape = next((s for s in by_name[max(feeds)[1]].output_shapes), ())
    if not shape:
        return 0
    channels_first = len(shape) == 4 and any(n.target.startswith(_CONV) for n in graph.nodes)
    return int(shape[1] if channels_first else shape[-1])


def _heads(graph: OpGraph, dims: ModelDims, hidden: int, layer: list[OpNode]) -> tuple[int, int]:
    shapes = Counter((int(n.input_shapes[0][1]), int(n.input_shapes[1][1])) for n in graph.nodes
                     if n.op_class == "attention" and len(n.input_shapes) >= 2
                     and len(n.input_shapes[0]) == 4 and len(n.input_shapes[1]) == 4)
    given = (dims.heads, dims.kv_heads or dims.heads)
    if shapes:
        found = _kv_from_projections(graph, layer, shapes.most_common(1)[0][0])
        if dims.heads and given != found:
            raise ConfigError(f"the spec says heads={given[0]}, kv_heads={given[1]} but the traced attention "
                              f"(scaled_dot_product_attention, (B, H, S, D) inputs) has heads={found[0]}, "
                              f"kv_heads={found[1]}; drop heads= from the spec or make it match")
        return found
    if dims.heads:
        if hidden and hidden % given[0]:
            raise ConfigError(f"heads={given[0]} does not divide the hidden width {hidden} seen in the graph; "
                              "give the model's number of attention heads")
        if given[0] % given[1]:
            raise ConfigError(f"heads={given[0]} is not divisible by kv_heads={given[1]}")
        return given
    if any(n.target.startswith(_SOFTMAX) for n in layer):
        log.warning("heads unknown: the layers compute a softmax but call no scaled_dot_product_attention, so "
                    "the graph shows no head count; attention is not split over heads. Give it in the spec: "
                    "module:function:heads=N")
    return 0, 0


def _kv_from_projections(graph: OpGraph, layer: list[OpNode], found: tuple[int, int]) -> tuple[int, int]:
    """Key/value heads from the q/k/v projections' total width ``(heads + 2 kv_heads) * head_dim``: attention
    code may repeat K/V to the query heads before sdpa (transformers' ``repeat_kv``), so the sdpa shapes can
    show ``kv_heads == heads`` for a grouped-query model. ``found`` when the layer is not one such attention."""
    attn = [n for n in layer if n.op_class == "attention"]
    if len(attn) != 1:
        return found
    heads, head_dim = found[0], int(attn[0].input_shapes[0][-1])
    width = sum(int(n.output_shapes[0][-1]) for n in layer
                if n.op_class == "matmul" and n.params and n.output_shapes and _reaches_attention(graph, n.name))
    kv2 = width // head_dim - heads if head_dim and width % head_dim == 0 else 0
    kv = kv2 // 2
    if kv2 <= 0 or kv2 % 2 or heads % kv:
        return found
    return heads, kv


def _reaches_attention(graph: OpGraph, start: str) -> bool:
    """Whether an attention op reads ``start``'s output through views and pointwise ops only (q/k/v, with
    rotary embeddings on the way)."""
    by_name = {n.name: n for n in graph.nodes}
    succ: dict[str, list[str]] = {}
    for e in graph.edges:
        succ.setdefault(e.src, []).append(e.dst)
    todo, seen = list(succ.get(start, ())), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        n = by_name[name]
        if n.op_class == "attention":
            return True
        if n.op_class in ("view", "elementwise"):
            todo.extend(succ.get(name, ()))
    return False


def _ffn(graph: OpGraph, layer: list[OpNode], hidden: int) -> tuple[int, bool]:
    """(width, gated) of the first layer's MLP: the widest linears that read ``hidden`` features and do not
    feed attention; 0 when the layer has none (a CNN block)."""
    outs = [int(n.output_shapes[0][-1]) for n in layer
            if n.op_class == "matmul" and not n.target.startswith(_CONV) and n.output_shapes
            and any(len(p[1]) == 2 and p[1][-1] == hidden for p in n.params)
            and not _reaches_attention(graph, n.name)]
    if not hidden or not outs:
        return 0, False
    ffn = max(outs)
    return ffn, outs.count(ffn) >= 2


def _vocab(graph: OpGraph) -> tuple[int, bool]:
    """(rows, tied) of the embedding indexed by (batch, seq) token ids; (0, False) for models without one."""
    for n in graph.nodes:
        if n.op_class == "embedding" and n.params and len(n.input_shapes) >= 2 and len(n.input_shapes[1]) == 2:
            fqn, shape, _ = n.params[0]
            tied = any(fqn in {p[0] for p in m.params} for m in graph.nodes if m.op_class == "matmul")
            return int(shape[0]), tied
    return 0, False
