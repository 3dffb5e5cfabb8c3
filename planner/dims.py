"""``ModelDims``: a model's dimensions, from a config or, for user code, from its traced graph.

``complete_dims(dims, graph)`` fills what a ``module:function`` model's dims leave unknown (0) from the
``OpGraph``. What "seq" means, per model kind (``sequence_length``):

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

from planner.graph import OpGraph

log = logging.getLogger(__name__)

Arch = Literal["gpt", "llama", "mixtral", "hf", "custom"]


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
    """``dims`` with its unknown (0) fields filled from ``graph``; configs' dims are returned as they are."""
    if dims.arch != "custom":
        return dims
    seq = sequence_length(graph)
    if dims.seq and dims.seq != seq:
        log.warning("seq=%d from the example inputs, %d from the traced graph: using the graph's", dims.seq, seq)
    return replace(dims, seq=seq, layers=dims.layers or len(graph.layer_fqns))
