"""The hand-written models of ``tests/models`` (plain torch.nn) built through ``module:function`` specs: they
build on meta at the published sizes and run a real forward on CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from planner.models import build_model

SPECS = ["tests.models.gpt:small", "tests.models.gpt:untied", "tests.models.gpt:manual", "tests.models.gpt:fused",
         "tests.models.mlp:tiny", "tests.models.vit:tiny", "tests.models.cnn:small"]


def gpt_params(*, l: int, h: int, V: int, s: int, ffn: int, tied: bool) -> int:
    layer = 4 * (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 4 * h  # q/k/v/o, fc1, fc2, 2 LayerNorms
    return V * h + s * h + l * layer + 2 * h + (0 if tied else V * h)


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("spec", SPECS)
def test_builds_on_meta_and_runs_on_cpu(spec):
    b = build_model(spec, batch=2)
    assert {p.device.type for p in b.model.parameters()} == {"meta"}
    cpu = build_model(spec, batch=2, device="cpu")
    torch.manual_seed(0)
    for p in cpu.model.parameters():
        p.data.normal_(0, 0.02)
    out = cpu.model(*cpu.example_inputs)
    assert out.shape[0] == 2 and torch.isfinite(out).all()
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in cpu.model.parameters())


def test_published_sizes():
    assert _numel(build_model("tests.models.gpt:small").model) == gpt_params(l=4, h=256, V=1000, s=128, ffn=1024,
                                                                              tied=True)
    assert _numel(build_model("tests.models.gpt:untied").model) == gpt_params(l=3, h=128, V=500, s=64, ffn=512,
                                                                               tied=False)
    assert _numel(build_model("tests.models.vit:vit_l16").model) == 304_326_632  # timm vit_large_patch16_224
    w, f = 8192, 32768
    assert _numel(build_model("tests.models.mlp:mlp_8b").model) == (1024 * w + w) + 16 * (2 * w + 2 * w * f + f + w) \
        + (w * 1000 + 1000)


def test_mlp_8b_builds_in_little_memory():
    """In a fresh process (its own peak RSS): 8.6B parameters would be 34 GB in fp32."""
    code = ("import resource; from planner.models import build_model; "
            "b = build_model('tests.models.mlp:mlp_8b'); "
            "print(sum(p.numel() for p in b.model.parameters()), "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    params, rss_kb = int(out[0]), int(out[1])
    assert params == 8_607_441_896
    assert rss_kb < 1.5 * 2**20  # < 1.5 GB peak


def _dims(spec: str):
    from planner.workload import trace_spec

    return trace_spec(spec).dims


@pytest.mark.parametrize("spec,expected", [
    ("tests.models.gpt:small", dict(layers=4, hidden=256, heads=8, kv_heads=8, ffn_hidden=1024, vocab=1000, seq=128,
                                    glu=False, tied_embeddings=True)),
    ("tests.models.gpt:untied", dict(layers=3, hidden=128, heads=4, kv_heads=4, ffn_hidden=512, vocab=500, seq=64,
                                     tied_embeddings=False)),
    ("tests.models.gpt:fused", dict(hidden=128, heads=4, ffn_hidden=512)),  # c_attn (3h) feeds attention: not ffn
    ("tests.models.vit:tiny", dict(layers=4, hidden=64, heads=4, kv_heads=4, ffn_hidden=256, vocab=0, seq=17)),
    ("tests.models.mlp:tiny", dict(layers=4, hidden=128, heads=0, ffn_hidden=512, vocab=0, seq=1)),
    ("tests.models.cnn:cnn:channels=24", dict(layers=4, hidden=24, heads=0, ffn_hidden=0, vocab=0, seq=1)),
])
def test_dims_inferred_from_the_graph(spec, expected):
    d = _dims(spec)
    assert d.arch == "custom"
    assert {k: getattr(d, k) for k in expected} == expected


def test_dims_of_a_llama_graph_match_its_config():
    """The same rules on a transformers Llama (GQA, SwiGLU, RoPE between q_proj and sdpa) recover its config."""
    from dataclasses import replace

    from planner.dims import complete_dims
    from planner.workload import trace_spec

    t = trace_spec("llama:layers=3,hidden=128,ffn=320,heads=8,kv_heads=2,vocab=300,seq=32")
    unknown = replace(t.dims, arch="custom", hidden=0, heads=0, kv_heads=0, ffn_hidden=0, vocab=0, seq=0,
                      glu=False, tied_embeddings=False)
    assert complete_dims(unknown, t.graph) == replace(t.dims, arch="custom")


def test_heads_of_a_hand_written_attention(caplog):
    with caplog.at_level("WARNING", logger="planner.dims"):
        d = _dims("tests.models.gpt:manual")
    assert (d.heads, d.kv_heads, d.hidden) == (0, 0, 128)  # 0 = unknown, never a guess
    assert "heads unknown" in caplog.text and "heads=N" in caplog.text
    d = _dims("tests.models.gpt:manual:heads=4")
    assert (d.heads, d.kv_heads) == (4, 4)
    from costmodel.errors import ConfigError

    with pytest.raises(ConfigError, match="heads=3 does not divide the hidden width 128"):
        _dims("tests.models.gpt:manual:heads=3")
    with pytest.raises(ConfigError, match=r"spec says heads=8, kv_heads=8 but the traced attention .* has heads=4"):
        _dims("tests.models.gpt:untied:heads=8")  # untied() takes no heads: the hint contradicts the graph
    assert _dims("tests.models.gpt:small:heads=4").heads == 4  # small() takes heads: it builds 4 heads


# --- per-block coarse ops and their sharding candidates ----------------------------------------------------------


def _op_list(spec: str, block: int = 1):
    from planner.graph import find_blocks
    from planner.search.block_ops import layer_ops_from_block
    from planner.workload import trace_spec

    t = trace_spec(spec)
    return layer_ops_from_block(find_blocks(t.graph)[block], t.graph, microbatch=1, seq=t.dims.seq)


def _layer_ops(spec: str, block: int = 1):
    """Ops by their first module, or by kind for module-less ops (attention)."""
    return {op.modules[0] if op.modules else op.kind: op for op in _op_list(spec, block)}


def _cands(op, tp: int = 2) -> set[str]:
    from planner.search.strategies import MeshShape, candidates

    return {s.name for s in candidates(op, MeshShape(tp=tp))}


def test_gpt_block_ops():
    ops = _layer_ops("tests.models.gpt:small")
    qkv = ops["attn.q"]
    assert qkv.modules == ("attn.q", "attn.k", "attn.v") and qkv.shard_dims == (8, 8, 8, 256)  # whole heads
    assert _cands(qkv) == {"replicate", "colwise"}
    assert ops["attention"].shard_dims == (8, 8) and _cands(ops["attention"]) == {"replicate", "heads"}
    assert ops["attn.o"].shard_dims == (256, 8) and _cands(ops["attn.o"]) == {"replicate", "colwise", "rowwise"}
    assert _cands(ops["mlp.fc1"]) >= {"colwise"} and _cands(ops["mlp.fc2"]) >= {"rowwise"}
    assert _cands(ops["attention"], tp=16) == {"replicate"}  # 16 does not divide 8 heads


def test_vit_multihead_attention_is_replicated_its_mlp_sharded():
    ops = _layer_ops("tests.models.vit:tiny")
    # nn.MultiheadAttention runs F.linear on its packed in_proj_weight and on out_proj's weight: no TP style
    assert _cands(ops["self_attn"]) == {"replicate"} and _cands(ops["self_attn.out_proj"]) == {"replicate"}
    assert _cands(ops["attention"]) == {"replicate"}
    assert _cands(ops["linear1"]) >= {"colwise"} and _cands(ops["linear2"]) >= {"rowwise"}


def test_fused_qkv_and_hand_written_attention_are_replicated():
    fused = _layer_ops("tests.models.gpt:fused")
    assert _cands(fused["attn.c_attn"]) == {"replicate"}  # c_attn(x).split(h): a column shard is not q/k/v
    assert _cands(fused["attention"]) == {"replicate"}
    manual = _op_list("tests.models.gpt:manual")
    matmuls = [op for op in manual if op.kind == "matmul"]  # QK^T and AV, written by hand
    assert len(matmuls) == 2 and all(_cands(op) == {"replicate"} for op in matmuls)
    assert not any(op.kind == "attention" for op in manual)


def test_mlp_and_cnn_block_ops():
    mlp = _layer_ops("tests.models.mlp:tiny")
    assert _cands(mlp["fc1"]) >= {"colwise"} and _cands(mlp["fc2"]) >= {"rowwise"}
    assert mlp["fc1"].shard_dims == (512, 128)
    cnn = _layer_ops("tests.models.cnn:small")
    assert [op.kind for op in cnn.values() if op.kind in ("conv", "batchnorm")] == ["conv", "batchnorm"] * 2
    assert all(_cands(op, tp=4) == {"replicate"} for op in cnn.values() if op.kind in ("conv", "batchnorm"))
    assert not any(op.kind == "experts" for op in cnn.values())  # 4-D conv kernels are not expert weights
    stem = _layer_ops("tests.models.cnn:small", block=0)
    assert stem["stem"].kind == "conv" and stem["stem"].flops_fwd == 2 * 32 * 32 * 32 * 3 * 9


@pytest.mark.parametrize("spec", SPECS)
def test_every_block_solves(spec):
    from costmodel.profiles import make_cluster
    from planner.graph import find_blocks
    from planner.search.block_plan import StrategyCache, block_strategy
    from planner.workload import trace_spec

    cluster, cache = make_cluster("dgx-a100-80gb", 1), StrategyCache()
    t = trace_spec(spec)
    for b in find_blocks(t.graph):
        for tp in (1, 2):
            bs = block_strategy(b, graph=t.graph, tp=tp, microbatch=2, seq=t.dims.seq, cluster=cluster, cache=cache)
            assert bs.solver["status"] == "optimal" and bs.time_fwd_s > 0
            assert bool(bs.shardings) == bool(b.params)  # every block with weights says how they are held


def test_large_blocks_choose_megatron_shardings():
    """At a compute-heavy size the ILP shards the GPT Megatron-style and the ViT's MLP, not its attention. (At
    hidden 1024 / seq 512 the runtime's three separate q / k / v input-gradient all-reduces already cost more than
    the attention's share of compute saves, and the ILP keeps attention replicated.)"""
    from costmodel.profiles import make_cluster
    from planner.graph import find_blocks
    from planner.search.block_plan import block_strategy
    from planner.workload import trace_spec

    cluster = make_cluster("dgx-a100-80gb", 1)
    expect = {
        "tests.models.gpt:gpt:hidden=2048,heads=16,seq=1024": {
            "attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
            "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
        "tests.models.vit:vit:hidden=1024,heads=16,mlp=4096,image=224,patch=16": {
            "self_attn": "replicate", "self_attn.out_proj": "replicate", "linear1": "colwise", "linear2": "rowwise"},
        "tests.models.mlp:mlp:width=4096,hidden=16384": {"fc1": "colwise", "fc2": "rowwise"},
        "tests.models.gpt:gpt:hidden=1024,heads=16,seq=512,impl=manual": {
            "attn.q": "replicate", "attn.o": "replicate", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
        "tests.models.gpt:gpt:hidden=1024,heads=16,seq=512,impl=fused": {
            "attn.c_attn": "replicate", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
    }
    for spec, styles in expect.items():
        t = trace_spec(spec)
        b = find_blocks(t.graph)[1]
        bs = block_strategy(b, graph=t.graph, tp=4, microbatch=16, seq=t.dims.seq, cluster=cluster)
        assert {m.fqn: m.style for m in bs.shardings if m.fqn in styles} == styles, spec
