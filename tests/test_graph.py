"""planner.graph: coarsening keeps totals, blocks and identical-block groups (unit tests on hand-made graphs,
plus one traced model)."""

from __future__ import annotations

import pytest

from planner.graph import Edge, OpGraph, OpNode, coarsen, coverage, find_block_groups, find_blocks


def _node(name, op_class, block, *, flops=0.0, params=(), module="", target=None, out=(4, 8), covered=True):
    return OpNode(name=name, target=target or f"aten.{name}.default", op_class=op_class, input_shapes=((4, 8),),
                  input_dtypes=("float32",), output_shapes=(out,), output_dtypes=("float32",), flops_fwd=flops,
                  flops_bwd=2 * flops, bytes_read=128.0, bytes_written=128.0, params=params, module_fqn=module,
                  block=block, covered=covered)


def _layer(i: int, *, width: int = 8) -> list[OpNode]:
    p = f"layers.{i}"
    w = ((f"{p}.fc.weight", (width, 8), "float32"),)
    return [
        _node(f"mm{i}", "matmul", p, flops=512.0, params=w, module=f"{p}.fc", target="aten.linear.default",
              out=(4, width)),
        _node(f"view{i}", "view", p, module=p, target="aten.view.default", out=(4, width)),
        _node(f"gelu{i}", "elementwise", p, module=f"{p}.act", target="aten.gelu.default", out=(4, width)),
        _node(f"sum{i}", "reduction", p, module=p, target="aten.sum.dim_IntList", out=(4, 1)),
    ]


def _graph(widths=(8, 8, 8)) -> OpGraph:
    emb = _node("emb", "embedding", "embedding", params=(("emb.weight", (100, 8), "float32"),), module="emb")
    nodes = [emb]
    edges = []
    prev = "emb"
    for i, w in enumerate(widths):
        layer = _layer(i, width=w)
        nodes += layer
        edges.append(Edge(src=prev, dst=layer[0].name, nbytes=128.0))
        edges += [Edge(src=a.name, dst=b.name, nbytes=128.0) for a, b in zip(layer, layer[1:])]
        prev = layer[-1].name
    head = _node("head", "matmul", "head", flops=1000.0, params=(("emb.weight", (100, 8), "float32"),),
                 module="lm_head", target="aten.linear.default")
    nodes.append(head)
    edges.append(Edge(src=prev, dst="head", nbytes=16.0))
    sizes = {}
    for n in nodes:
        for f, s, _ in n.params:
            sizes.setdefault(f, s[0] * s[1])
    return OpGraph(nodes=tuple(nodes), edges=tuple(edges), param_sizes=tuple(sizes.items()),
                   layer_fqns=tuple(f"layers.{i}" for i in range(len(widths))), traced_layers=len(widths))


def test_coarsen_folds_views_and_pointwise_into_producer_and_keeps_totals():
    g = _graph()
    c = coarsen(g)
    assert [n.name for n in c.nodes] == ["emb", "mm0", "sum0", "mm1", "sum1", "mm2", "sum2", "head"]
    assert c.nodes[1].folded == ("aten.view.default", "aten.gelu.default")
    for attr in ("flops_fwd", "flops_bwd", "params"):
        assert getattr(c, attr) == getattr(g, attr)
    assert sum(n.bytes_read + n.bytes_written for n in c.nodes) == sum(n.bytes_read + n.bytes_written for n in g.nodes)
    names = {n.name for n in c.nodes}
    assert all(e.src in names and e.dst in names and e.src != e.dst for e in c.edges)
    assert ("mm0", "sum0") in {(e.src, e.dst) for e in c.edges}


def test_coarsen_does_not_fold_across_blocks():
    g = _graph()
    # a view at the start of layer 1 whose producer is in layer 0 must stay
    nodes = list(g.nodes)
    first = next(i for i, n in enumerate(nodes) if n.name == "mm1")
    nodes[first] = _node("mm1", "view", "layers.1", module="layers.1")
    c = coarsen(OpGraph(nodes=tuple(nodes), edges=g.edges, param_sizes=g.param_sizes, layer_fqns=g.layer_fqns))
    assert "mm1" in {n.name for n in c.nodes}


def test_blocks_and_identical_groups():
    blocks = find_blocks(_graph())
    assert [(b.name, b.kind) for b in blocks] == [
        ("embedding", "embedding"), ("layers.0", "transformer"), ("layers.1", "transformer"),
        ("layers.2", "transformer"), ("head", "head")]
    assert blocks[0].params == 800 and blocks[-1].params == 0  # tied weight counted once, on first use
    assert blocks[1].params == 64 and blocks[1].flops_fwd == 512.0
    groups = find_block_groups(blocks)
    assert [g.repeat for g in groups] == [1, 3, 1]
    assert groups[1].members == ("layers.0", "layers.1", "layers.2")


def test_different_layers_are_not_grouped():
    blocks = find_blocks(_graph(widths=(8, 16, 8)))
    groups = find_block_groups(blocks)
    layer_groups = [g.members for g in groups if g.members[0].startswith("layers")]
    assert layer_groups == [("layers.0", "layers.2"), ("layers.1",)]


def test_coverage_counts_ops_without_rule():
    g = _graph()
    odd = _node("odd", "other", "head", target="aten.erfinv.default", covered=False)
    g2 = OpGraph(nodes=g.nodes + (odd, odd), edges=g.edges, param_sizes=g.param_sizes)
    assert coverage(g2) == {"aten.erfinv.default": 2}


def test_traced_llama_blocks():
    from planner.models import build_model
    from planner.trace import trace

    b = build_model("llama:layers=4,hidden=128,ffn=256,heads=4,kv_heads=2,vocab=500,seq=64")
    g = trace(b.model, b.example_inputs)
    blocks = find_blocks(g)
    assert [x.name for x in blocks] == ["embedding", *(f"model.layers.{i}" for i in range(4)), "head"]
    assert blocks[0].modules[0] == "model.embed_tokens"
    assert set(blocks[-1].modules) == {"model.norm", "lm_head"}
    assert sum(x.params for x in blocks) == sum(p.numel() for p in b.model.parameters())
    groups = find_block_groups(blocks)
    assert [gr.repeat for gr in groups] == [1, 4, 1]
    layer = blocks[1]
    assert layer.attn_flops_fwd == pytest.approx(4 * 64 * 64 * 128)
    assert layer.attn_flops_fwd_causal == pytest.approx(layer.attn_flops_fwd * 65 / 128)
    c = coarsen(g)
    assert len(c.nodes) < len(g.nodes) / 2
    assert c.model_flops == g.model_flops
    assert [x.signature for x in find_blocks(c)][1:5] == [find_blocks(c)[1].signature] * 4


@pytest.mark.parametrize("spec,layers,prefix", [
    ("tests.models.gpt:small", 4, "blocks"), ("tests.models.mlp:tiny", 4, "blocks"),
    ("tests.models.vit:tiny", 4, "encoder.layers"), ("tests.models.cnn:small", 4, "blocks"),
])
def test_hand_written_model_blocks_in_order(spec, layers, prefix):
    from planner.models import build_model
    from planner.trace import trace

    b = build_model(spec)
    g = trace(b.model, b.example_inputs)
    blocks = find_blocks(g)
    names = [f"{prefix}.{i}" for i in range(layers)]
    assert [x.name for x in blocks] == ["embedding", *names, "head"]
    assert [x.kind for x in blocks] == ["embedding", *["transformer"] * layers, "head"]
    groups = find_block_groups(blocks)
    assert [gr.members for gr in groups] == [("embedding",), tuple(names), ("head",)]
    assert sum(x.params for x in blocks) == sum(p.numel() for p in b.model.parameters())
