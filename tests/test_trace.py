"""planner.trace: FLOPs against Megatron Eq. 3 and hand-derived counts, exact totals under the depth shortcut,
typed errors for untraceable models, the ``autopar trace`` output."""

from __future__ import annotations

import json
import sys
import textwrap
from collections import Counter

import pytest
import torch
import torch.nn as nn

from costmodel.errors import UnsupportedModelError
from planner.flops import causal_fraction
from planner.models import build_model
from planner.trace import trace

SMALL_LLAMA = "llama:layers=4,hidden=128,ffn=256,heads=4,kv_heads=2,vocab=500,seq=64"
SMALL_MIXTRAL = "mixtral:layers=3,hidden=128,ffn=192,heads=4,kv_heads=2,vocab=500,seq=32,experts=4,topk=2"


def megatron_eq3(*, B, s, l, h, V) -> float:
    """SC21 Eq. 3 without recomputation: forward + backward FLOPs, dense attention."""
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def _trace(spec: str, **kw):
    b = build_model(spec, **kw)
    return b, trace(b.model, b.example_inputs)


@pytest.mark.parametrize("name,batch", [("megatron-1.7b", 1), ("megatron-18b", 2), ("gpt3-175b", 1)])
def test_gpt_presets_match_megatron_eq3(name, batch):
    b, g = _trace(name, batch=batch)
    d = b.dims
    assert g.params == sum(p.numel() for p in b.model.parameters())
    eq3 = megatron_eq3(B=batch, s=d.seq, l=d.layers, h=d.hidden, V=d.vocab)
    assert g.model_flops == pytest.approx(eq3, rel=0.01)
    assert g.traced_layers < d.layers == len(g.layer_fqns)


def test_hf_gpt2_totals_exact():
    b, g = _trace("gpt2")
    l, h, s, V = 12, 768, 1024, 50257
    layer_fwd = 24 * s * h * h + 4 * s * s * h  # qkv, proj, 4h MLP; QK^T and AV (dense)
    fwd = l * layer_fwd + 2 * s * h * V
    assert g.params == 124_439_808
    assert g.flops_fwd == pytest.approx(fwd, rel=1e-9)
    assert g.model_flops == pytest.approx(3 * fwd, rel=1e-9)
    # executed backward: matmuls 2x, attention 2.5x (flash recomputes QK^T)
    assert g.flops_bwd == pytest.approx(2 * fwd + 0.5 * l * 4 * s * s * h, rel=1e-9)
    assert g.unsupported == ()


def _attn(s, h):
    return 4 * s * s * h


def test_small_llama_hand_derived():
    b, g = _trace(SMALL_LLAMA)
    l, h, ffn, heads, kv, V, s = 4, 128, 256, 4, 2, 500, 64
    hd = h // heads
    proj = 2 * s * h * (h + 2 * kv * hd + h)  # q, k, v, o
    mlp = 2 * s * h * ffn * 3  # gate, up, down
    head = 2 * s * h * V
    fwd = l * (proj + mlp + _attn(s, h)) + head
    assert g.flops_fwd == pytest.approx(fwd, rel=1e-9)
    assert g.flops_bwd == pytest.approx(2 * (fwd - l * _attn(s, h)) + 2.5 * l * _attn(s, h), rel=1e-9)
    assert g.model_flops == pytest.approx(3 * fwd, rel=1e-9)
    causal = 3 * (fwd - l * _attn(s, h)) + 3 * l * _attn(s, h) * (s + 1) / (2 * s)
    assert g.model_flops_causal == pytest.approx(causal, rel=1e-9)
    assert g.params == sum(p.numel() for p in b.model.parameters())
    emb = [n for n in g.nodes if n.op_class == "embedding"]
    assert len(emb) == 1 and emb[0].flops_fwd == 0 and emb[0].flops_bwd == 0


def test_small_mixtral_counts_only_routed_experts():
    b, g = _trace(SMALL_MIXTRAL)
    l, h, ffn, heads, kv, V, s, E, k = 3, 128, 192, 4, 2, 500, 32, 4, 2
    hd = h // heads
    proj = 2 * s * h * (h + 2 * kv * hd + h)
    router = 2 * s * h * E
    experts_all = E * s * 2 * h * ffn * 3  # what running every expert on every token would cost
    experts = experts_all * k / E
    fwd = l * (proj + router + experts + _attn(s, h)) + 2 * s * h * V
    assert g.flops_fwd == pytest.approx(fwd, rel=1e-9)
    assert g.model_flops == pytest.approx(3 * fwd, rel=1e-9)
    expert_nodes = [n for n in g.nodes if ".experts" in n.module_fqn and n.op_class == "matmul"]
    assert sum(n.flops_fwd for n in expert_nodes) == pytest.approx(l * experts, rel=1e-9)
    assert g.params == sum(p.numel() for p in b.model.parameters())
    # the batched_mm weight gather is not counted as moving T*k copies of the weights
    gathers = [n for n in g.nodes if n.target.startswith("aten.index") and n.params]
    assert gathers and all(n.bytes_written <= sum(
        torch.Size(sh).numel() for _, sh, _ in n.params) * 4 for n in gathers)


def test_shortcut_equals_full_depth_trace():
    b = build_model(SMALL_LLAMA)
    short = trace(b.model, b.example_inputs)
    full = trace(b.model, b.example_inputs, full_depth=True)
    assert short.traced_layers == 2 and full.traced_layers == 4
    assert len(b.model.model.layers) == 4  # the model is restored after the shortcut
    for attr in ("params", "flops_fwd", "flops_bwd", "model_flops"):
        assert getattr(short, attr) == getattr(full, attr)
    key = lambda g: Counter((n.target, n.module_fqn, n.output_shapes, n.params) for n in g.nodes)  # noqa: E731
    assert key(short) == key(full)
    mod = lambda g: {n.name: n.module_fqn for n in g.nodes}  # noqa: E731
    edges = lambda g: Counter((mod(g)[e.src], mod(g)[e.dst], e.nbytes) for e in g.edges)  # noqa: E731
    assert edges(short) == edges(full)
    names = {n.name for n in short.nodes}
    assert all(e.src in names and e.dst in names for e in short.edges)


def test_backward_is_not_blindly_twice_forward():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.zeros(4, 32, device="meta")
    g = trace(model, (x,))
    first, second = [n for n in g.nodes if n.op_class == "matmul"]
    assert first.flops_fwd == 2 * 4 * 32 * 64
    assert first.flops_bwd == first.flops_fwd  # raw input needs no gradient: weight gradient only
    assert second.flops_bwd == 2 * second.flops_fwd
    assert {p[0] for p in first.params} == {"0.weight", "0.bias"}
    assert first.module_fqn == "0"


def test_causal_fraction():
    assert causal_fraction(4, 4) == pytest.approx(10 / 16)
    assert causal_fraction(1, 8) == 1.0
    assert causal_fraction(2048, 2048) == pytest.approx(0.5, abs=1e-3)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent: meta tensors have no values
            return y * 2
        return y


def test_untraceable_model_gives_typed_error_with_suggestion():
    with torch.device("meta"):
        model = _DataDependent()
    with pytest.raises(UnsupportedModelError) as e:
        trace(model, (torch.zeros(2, 8, device="meta"),))
    msg = str(e.value)
    assert "Suggestion:" in msg and "_DataDependent" in msg
    assert "test_trace.py" in msg  # names the source line
    assert "Traceback" not in msg


def test_coverage_lists_ops_without_rule():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.erfinv(self.lin(x)).cosh()

    with torch.device("meta"):
        model = Odd()
    g = trace(model, (torch.zeros(2, 8, device="meta"),))
    assert dict(g.unsupported) == {"erfinv.default": 1, "cosh.default": 1}


def test_cli_json_and_table(capsys):
    from cli.main import main

    spec = "gpt:layers=3,hidden=64,heads=4,vocab=100,seq=16"
    assert main(["trace", "--model", spec, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("params", "flops_fwd", "flops_bwd", "num_nodes", "blocks", "unsupported_ops", "trace_time_s"):
        assert key in out
    assert [b["repeat"] for b in out["blocks"]] == [1, 3, 1]
    assert out["identical_blocks"][0]["members"] == [f"model.decoder.layers.{i}" for i in range(3)]
    for blk in out["blocks"]:
        assert {"name", "repeat", "params", "flops_fwd"} <= set(blk)
    assert sum(b["params"] * b["repeat"] for b in out["blocks"]) == out["params"]
    assert sum(b["flops_fwd"] * b["repeat"] for b in out["blocks"]) == pytest.approx(out["flops_fwd"])
    # saved activations: what the backward keeps, below what the ops write; a layer's within 30% of Korthikanti
    # et al. 2022's 34sbh + 5as^2b bytes (bf16, no recomputation; s 16, b 1, h 64, a 4)
    for blk in out["blocks"]:
        assert 0 < blk["saved_bytes"] < blk["written_bytes"], blk
    layer = out["blocks"][1]
    assert layer["saved_bytes"] == pytest.approx(34 * 16 * 64 + 5 * 4 * 16 * 16, rel=0.3)
    assert main(["trace", "--model", spec]) == 0
    text = capsys.readouterr().out
    assert "traced 2 of 3 layers; 3 identical blocks" in text
    assert "model.decoder.layers.0-2" in text
    assert "saved MB" in text and "written MB" in text
    assert main(["trace", "--model", "nonsense"]) == 2
    assert "unknown model spec" in capsys.readouterr().err


class _Layer(nn.Module):
    def __init__(self, width: int, idx: int, first_special: bool = False):
        super().__init__()
        self.up, self.down = nn.Linear(16, width), nn.Linear(width, 16)
        self.idx, self.first_special = idx, first_special

    def forward(self, x):
        y = x + self.down(torch.relu(self.up(x)))
        if self.first_special and self.idx == 0:  # index-dependent behaviour the structure does not show
            y = y * 2
        return y


class _Stack(nn.Module):
    def __init__(self, widths, first_special=False):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(w, i, first_special) for i, w in enumerate(widths))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _compare_short_full(model, x):
    short = trace(model, (x,))
    full = trace(model, (x,), full_depth=True)
    key = lambda g: Counter((n.target, n.module_fqn, n.output_shapes) for n in g.nodes)  # noqa: E731
    mod = lambda g: {n.name: n.module_fqn for n in g.nodes}  # noqa: E731
    edges = lambda g: Counter((mod(g)[e.src], mod(g)[e.dst], e.nbytes) for e in g.edges)  # noqa: E731
    assert key(short) == key(full) and edges(short) == edges(full)
    assert (short.params, short.model_flops) == (full.params, full.model_flops)
    return short


def test_shortcut_with_two_layer_types():
    with torch.device("meta"):
        model = _Stack([32, 64, 32, 64, 32, 64])
    g = _compare_short_full(model, torch.zeros(2, 5, 16, device="meta"))
    assert g.traced_layers == 4 and len(g.layer_fqns) == 6  # the first two of each structure
    from planner.graph import find_block_groups, find_blocks

    groups = [gr.members for gr in find_block_groups(find_blocks(g)) if gr.members[0].startswith("layers")]
    assert groups == [("layers.0", "layers.2", "layers.4"), ("layers.1", "layers.3", "layers.5")]


def test_shortcut_falls_back_when_copies_differ():
    with torch.device("meta"):
        model = _Stack([32] * 5, first_special=True)
    g = _compare_short_full(model, torch.zeros(2, 5, 16, device="meta"))
    assert g.traced_layers == 5  # layer 0 traced differently from layer 1: exported at full depth


def test_shortcut_with_a_single_odd_layer():
    with torch.device("meta"):
        model = _Stack([32, 32, 32, 32, 64])
    g = _compare_short_full(model, torch.zeros(2, 5, 16, device="meta"))
    assert g.traced_layers == 3  # layers 0, 1 and the odd 4


def test_matmul_flops_match_a_real_forward_backward():
    """torch.utils.flop_counter on a real CPU step counts every matmul autograd runs (it misses the CPU
    attention kernel, which is the reason for our own rule): our forward + backward matmul FLOPs must agree."""
    from torch.utils.flop_counter import FlopCounterMode

    spec = "llama:layers=2,hidden=64,ffn=96,heads=4,kv_heads=2,vocab=50,seq=16"
    meta = build_model(spec)
    g = trace(meta.model, meta.example_inputs, full_depth=True)
    ours = sum(n.flops_fwd + n.flops_bwd for n in g.nodes if n.op_class == "matmul")
    real = build_model(spec, device="cpu")
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (1, 16))
    with FlopCounterMode(display=False) as counter:
        real.model(ids).logits.float().pow(2).mean().backward()
    measured = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "attention" not in str(op))
    assert ours == measured


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_moe_expert_implementations_count_the_same(impl):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
                        attn_implementation="sdpa", experts_implementation=impl, use_cache=False)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    g = trace(model, (torch.zeros(1, 16, dtype=torch.long, device="meta"),))
    s, h, ffn, E, k, l = 16, 64, 96, 4, 2, 2
    experts = k * s * 2 * h * ffn * 3
    attn = 4 * s * s * h
    fwd = l * (2 * s * h * (h + 2 * 2 * 16 + h) + 2 * s * h * E + experts + attn) + 2 * s * h * 100
    assert g.flops_fwd == pytest.approx(fwd, rel=1e-9)
    assert g.unsupported == ()


# --- hand-written models (tests/models) -----------------------------------------------------------------------

USER_SPECS = ["tests.models.gpt:small", "tests.models.mlp:tiny", "tests.models.vit:tiny", "tests.models.cnn:small"]


@pytest.mark.parametrize("spec", USER_SPECS)
def test_user_models_shortcut_equals_full_depth(spec):
    b = build_model(spec)
    g = _compare_short_full(b.model, b.example_inputs[0])
    assert g.traced_layers == 2 and len(g.layer_fqns) == 4
    assert g.params == sum(p.numel() for p in b.model.parameters())


@pytest.mark.parametrize("spec,seq", [("tests.models.gpt:small", 128), ("tests.models.vit:tiny", 17),
                                      ("tests.models.mlp:tiny", 1), ("tests.models.cnn:small", 1)])
def test_seq_is_tokens_per_sample_from_the_graph(spec, seq):
    from planner.workload import trace_spec

    t = trace_spec(spec)
    assert t.dims.seq == seq
    has_attention = any(n.op_class == "attention" for n in t.graph.nodes)
    assert has_attention == spec.startswith(("tests.models.gpt", "tests.models.vit"))


def test_float_inputs_are_cast_with_the_model():
    """trace_spec casts the meta model to bf16; the ViT's float images must follow (it failed on the conv)."""
    from planner.workload import trace_spec

    t = trace_spec("tests.models.vit:tiny")
    conv = next(n for n in t.graph.nodes if n.target.startswith("aten.conv2d"))
    assert set(conv.input_dtypes) == {"bfloat16"}
    b = build_model("tests.models.vit:tiny")
    b.model.to(torch.bfloat16)  # without the cast: a dtype error, and the hint says so
    with pytest.raises(UnsupportedModelError) as e:
        trace(b.model, b.example_inputs)
    msg = str(e.value)
    assert "vit.py:" in msg and "cast float example inputs" in msg and "attn_implementation" not in msg


def test_positional_is_causal_counts_causal_attention():
    b = build_model("tests.models.gpt:small")
    g = trace(b.model, b.example_inputs)
    attn = [n for n in g.nodes if n.op_class == "attention"]
    assert len(attn) == 4 and all(n.causal_fraction == pytest.approx(causal_fraction(128, 128)) for n in attn)


class _Head(nn.Module):
    def __init__(self, h: int, hd: int):
        super().__init__()
        self.q = nn.Linear(h, hd)

    def forward(self, x):
        return self.q(x)


class _PerHeadLayer(nn.Module):
    """minGPT-style: a ModuleList of 8 per-head projections inside each of 3 layers."""

    def __init__(self, h: int = 32, heads: int = 8):
        super().__init__()
        self.heads = nn.ModuleList(_Head(h, h // heads) for _ in range(heads))
        self.proj = nn.Linear(h, h)

    def forward(self, x):
        return x + self.proj(torch.cat([hd(x) for hd in self.heads], dim=-1))


class _Between(nn.Module):
    """Layers with a root op between them (a scale after each layer but the last)."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(_PerHeadLayer() for _ in range(n))
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = x * 0.5
        return self.out(x)


def test_layer_list_is_the_stack_not_the_per_head_list():
    from planner.trace import find_layer_list

    with torch.device("meta"):
        model = _Between(3)
    assert find_layer_list(model)[0] == "layers"  # the 8-long per-head lists hold fewer parameters


def test_blocks_in_execution_order_with_ops_between_layers():
    from planner.graph import find_blocks

    with torch.device("meta"):
        model = _Between(4)
    g = trace(model, (torch.zeros(2, 5, 32, device="meta"),))
    blocks = find_blocks(g)
    assert [b.name for b in blocks] == ["layers.0", "layers.1", "layers.2", "layers.3", "head"]
    order = [n.block for n in g.nodes]
    assert order == sorted(order, key=[b.name for b in blocks].index)  # contiguous, in execution order
    muls = [n.block for n in g.nodes if n.target.startswith("aten.mul") and not n.module_fqn]
    assert muls == ["layers.0", "layers.1", "layers.2"]  # each root scale counts to the layer before it


def test_cli_trace_user_models(capsys):
    from cli.main import main

    assert main(["trace", "--model", "tests.models.vit:tiny"]) == 0
    text = capsys.readouterr().out
    assert "seq 17" in text and "encoder.layers.0-3" in text and "4 identical blocks" in text
    assert "causal; attention 0.0002959 GFLOP forward" in text  # 4 layers x 4 * 17^2 * 64 (QK^T and AV)
    assert main(["trace", "--model", "tests.models.mlp:tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seq"] == 1 and out["attention_flops_fwd"] == 0
    assert [b["name"] for b in out["blocks"]] == ["embedding", "blocks.0-3", "head"]
    assert main(["trace", "--model", "tests.models.mlp:tiny"]) == 0
    assert "no attention ops" in capsys.readouterr().out


def test_untraceable_user_model_names_the_line(tmp_path, monkeypatch):
    from planner.workload import trace_spec

    (tmp_path / "bad_models_t.py").write_text(textwrap.dedent("""
        import torch, torch.nn as nn

        class Bad(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                y = self.lin(x)
                return y[: int(y.sum().item())]  # data-dependent size

        def make():
            return Bad(), torch.zeros(2, 8)
    """))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedModelError) as e:
        trace_spec("bad_models_t:make")
    msg = str(e.value)
    assert "torch.export could not trace Bad" in msg and "bad_models_t.py:11" in msg
    assert "Suggestion:" in msg and "Traceback" not in msg
    sys.modules.pop("bad_models_t", None)


def test_hand_written_gpt_flops_by_hand():
    """tests.models.gpt:small (l=4, h=256, ffn=1024, V=1000, s=128, tied head), traced at batch 2."""
    b = build_model("tests.models.gpt:small", batch=2)
    g = trace(b.model, b.example_inputs)
    B, l, h, ffn, V, s = 2, 4, 256, 1024, 1000, 128
    dense = B * (l * (2 * s * h * 4 * h + 2 * 2 * s * h * ffn) + 2 * s * h * V)  # q/k/v/o, fc1/fc2, head
    attn = B * l * 4 * s * s * h  # QK^T and AV, dense
    assert g.flops_fwd == pytest.approx(dense + attn, rel=1e-12)
    assert g.flops_bwd == pytest.approx(2 * dense + 2.5 * attn, rel=1e-12)  # flash backward recomputes QK^T
    assert g.model_flops == pytest.approx(3 * (dense + attn), rel=1e-12)
    assert g.model_flops_causal == pytest.approx(3 * dense + 3 * attn * (s + 1) / (2 * s), rel=1e-12)
    assert g.params == 3_448_320


def test_hand_written_mlp_flops_by_hand():
    """tests.models.mlp:tiny (64 -> 128, 4 blocks 128 -> 512 -> 128, 128 -> 10), traced at batch 3: the input
    projection reads the raw features, so its backward is the weight gradient alone."""
    b = build_model("tests.models.mlp:tiny", batch=3)
    g = trace(b.model, b.example_inputs)
    B = 3
    first, blocks, out = 2 * B * 64 * 128, 4 * 2 * (2 * B * 128 * 512), 2 * B * 128 * 10
    assert g.flops_fwd == first + blocks + out
    assert g.flops_bwd == first + 2 * (blocks + out)
    assert not any(n.op_class == "attention" for n in g.nodes)
