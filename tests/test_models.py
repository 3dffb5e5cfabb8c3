"""planner.models: presets match published parameter counts, specs parse, bad specs give typed errors."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from costmodel.errors import ConfigError, UnsupportedModelError
from planner.models import build_model, list_presets, model_dims


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def megatron_eq2(*, l: int, h: int, V: int, s: int) -> float:
    """Narayanan et al. SC21 Eq. 2: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


MEGATRON = ["megatron-1.7b", "megatron-3.6b", "megatron-7.5b", "megatron-18b", "megatron-39b", "megatron-76b",
            "megatron-145b", "megatron-310b", "megatron-530b", "megatron-1t", "gpt3-175b"]


@pytest.mark.parametrize("name", MEGATRON)
def test_gpt_presets_match_megatron_eq2(name):
    b = build_model(name)
    d = b.dims
    assert d.arch == "gpt" and d.vocab == 51200 and d.seq == 2048 and d.ffn_hidden == 4 * d.hidden
    eq2 = megatron_eq2(l=d.layers, h=d.hidden, V=d.vocab, s=d.seq)
    assert _numel(b.model) == pytest.approx(eq2, rel=0.01)


def test_megatron_presets_match_the_published_table():
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "megatron_sc21.json")
    rows = json.load(open(path))["table1_weak_scaling"]
    names = {1.7: "megatron-1.7b", 3.6: "megatron-3.6b", 7.5: "megatron-7.5b", 18.4: "megatron-18b",
             39.1: "megatron-39b", 76.1: "megatron-76b", 145.6: "megatron-145b", 310.1: "megatron-310b",
             529.6: "megatron-530b", 1008.0: "megatron-1t"}
    for row in rows:
        m = row["model"]
        d = model_dims(names[m["params_b"]])
        assert (d.layers, d.hidden, d.heads, d.ffn_hidden) == (m["layers"], m["hidden"], m["heads"], m["ffn_hidden"])
    d175 = model_dims("gpt3-175b")
    d530 = model_dims("megatron-530b", seq=4096)
    assert d530.seq == 4096 and build_model("megatron-530b").dims == model_dims("megatron-530b")
    assert (d175.layers, d175.hidden, d175.heads) == (96, 12288, 96)
    assert (d530.layers, d530.hidden, d530.heads) == (105, 20480, 128)


def test_gpt_family_uses_separate_qkv_linears():
    import torch.nn as nn

    m = build_model("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=32").model
    attn = m.model.decoder.layers[0].self_attn
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert isinstance(getattr(attn, proj), nn.Linear)
    assert m.lm_head.weight is m.model.decoder.embed_tokens.weight  # tied


def test_gpt2_is_hf_gpt2_124m():
    b = build_model("gpt2")
    assert type(b.model).__name__ == "GPT2LMHeadModel"
    V, P, h, l = 50257, 1024, 768, 12
    analytic = V * h + P * h + l * (12 * h * h + 13 * h) + 2 * h
    assert _numel(b.model) == analytic == 124_439_808


def llama_params(*, l, h, ffn, heads, kv, V, tied=False) -> int:
    hd = h // heads
    layer = h * h + 2 * h * kv * hd + h * h + 3 * h * ffn + 2 * h
    return V * h * (1 if tied else 2) + l * layer + h


@pytest.mark.parametrize("name,l,h,ffn,heads,kv,published", [
    ("llama3-8b", 32, 4096, 14336, 32, 8, 8.03e9),
    ("llama3-70b", 80, 8192, 28672, 64, 8, 70.6e9),
    ("llama3-405b", 126, 16384, 53248, 128, 8, 405.9e9),
])
def test_llama_presets(name, l, h, ffn, heads, kv, published):
    b = build_model(name)
    n = _numel(b.model)
    assert n == llama_params(l=l, h=h, ffn=ffn, heads=heads, kv=kv, V=128256)
    assert n == pytest.approx(published, rel=0.005)
    assert b.example_inputs[0].shape == (1, 8192)


def test_mixtral_preset():
    b = build_model("mixtral-8x7b")
    d = b.dims
    assert (d.experts, d.topk, d.layers) == (8, 2, 32)
    assert _numel(b.model) == pytest.approx(46.7e9, rel=0.005)
    assert b.model.config._experts_implementation == "batched_mm"


def test_meta_build_allocates_nothing():
    import psutil

    proc = psutil.Process()
    before = proc.memory_info().rss
    b = build_model("llama3-405b")
    after = proc.memory_info().rss
    assert {p.device.type for p in b.model.parameters()} == {"meta"}
    assert {x.device.type for x in b.example_inputs} == {"meta"}
    assert after - before < 300 * 2**20  # 405B fp32 weights would be 1.6 TB


def test_batch_and_seq_overrides():
    b = build_model("llama3-8b", batch=3, seq=128)
    assert b.example_inputs[0].shape == (3, 128)
    assert b.labels.shape == (3, 128)
    assert b.dims.seq == 128
    g = build_model("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=32", seq=16)
    assert g.example_inputs[0].shape == (1, 16)


def test_inline_specs():
    d = build_model("gpt:layers=2,hidden=64,heads=4").dims
    assert (d.vocab, d.seq, d.ffn_hidden) == (51200, 2048, 256)
    d = build_model("llama:layers=2,hidden=64,ffn=96,heads=4,kv_heads=2,vocab=100,seq=32").dims
    assert (d.arch, d.kv_heads, d.glu) == ("llama", 2, True)
    d = build_model("mixtral:layers=2,hidden=64,ffn=96,heads=4,kv_heads=2,vocab=100,seq=32,experts=4,topk=2").dims
    assert (d.arch, d.experts, d.topk) == ("mixtral", 4, 2)
    assert set(list_presets()) >= {"gpt2", "gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b",
                                    "megatron-1.7b", "megatron-1t"}


@pytest.mark.parametrize("spec,needle", [
    ("llama4-9000b", "llama3-8b"),  # unknown preset lists the presets
    ("gpt:layers=2,hidden=64,heads=4,colour=3", "allowed keys"),
    ("gpt:layers=2,hidden=sixty,heads=4", "not an integer"),
    ("gpt:layers=2,heads=4", "misses hidden"),
    ("gpt:layers=2,hidden=64,heads=5", "not divisible"),
    ("gpt:layers=0,hidden=64,heads=4", "positive"),
    ("llama:layers=2,hidden=64,ffn=96,heads=4,kv_heads=3", "kv_heads"),
    ("mixtral:layers=2,hidden=64,ffn=96,heads=4,experts=2,topk=3", "topk=3"),
    ("/no/such/config.json", "cannot read"),
    ("no_such_module_xyz:make", "no module 'no_such_module_xyz'"),
    ("", "non-empty"),
])
def test_bad_specs_raise_config_error(spec, needle):
    with pytest.raises(ConfigError) as e:
        build_model(spec)
    assert needle in str(e.value)


def test_bad_batch():
    with pytest.raises(ConfigError, match="batch=0"):
        build_model("gpt2", batch=0)


def test_hf_config_json(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 32}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    b = build_model(str(path))
    assert b.dims.arch == "hf" and b.dims.layers == 3 and b.dims.seq == 32
    assert _numel(b.model) == llama_params(l=3, h=64, ffn=96, heads=4, kv=2, V=100)
    assert {p.device.type for p in b.model.parameters()} == {"meta"}
    assert build_model(str(tmp_path)).dims.layers == 3  # a directory holding config.json
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(ConfigError, match="model_type"):
        build_model(str(bad))


_USER_CODE = textwrap.dedent("""
    import torch, torch.nn as nn
    import torch.nn.functional as F

    def make(batch=1, seq=8):
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        return m, (torch.zeros(batch, seq, 16),)

    def fixed():  # no batch / seq: inputs on CPU, batch 4
        return nn.Linear(16, 8), torch.zeros(4, 16)

    def tokens():
        return nn.Embedding(10, 4), (torch.zeros(2, 7, dtype=torch.long),)

    def huge():  # 8.6B parameters: 34 GB in fp32 if materialised
        return nn.Sequential(nn.Linear(65536, 65536), nn.Linear(65536, 65536)), torch.zeros(1, 65536)

    def sized(width=8, depth=1):
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]), torch.zeros(1, width)

    def not_a_pair():
        return nn.Linear(2, 2)

    def not_a_module():
        return "model", torch.zeros(1)

    def no_tensor():
        return nn.Linear(2, 2), (3, 4)

    def broken():
        return nn.Linear(2, 2, bias=undefined_name)

    NOT_CALLABLE = 3
""")


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A directory holding ``user_models_t.py``, made the current directory (and nothing else on sys.path)."""
    (tmp_path / "user_models_t.py").write_text(_USER_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    yield tmp_path
    sys.modules.pop("user_models_t", None)


def test_user_function_imports_from_the_current_directory_on_meta(user_dir):
    b = build_model("user_models_t:make", batch=2, seq=5)
    assert b.dims.arch == "custom"
    assert b.example_inputs[0].shape == (2, 5, 16)
    assert {p.device.type for p in b.model.parameters()} == {"meta"}
    assert b.example_inputs[0].device.type == "meta"
    assert str(user_dir) not in sys.path  # the current directory was on sys.path only for the import
    import torch

    assert torch.empty(1).device.type == "cpu"  # the default device is restored


def test_user_inputs_on_cpu_move_to_meta_and_take_the_batch(user_dir):
    b = build_model("user_models_t:fixed", batch=3)
    assert b.example_inputs[0].device.type == "meta" and b.example_inputs[0].shape == (3, 16)
    t = build_model("user_models_t:tokens", batch=1, seq=9)
    assert t.example_inputs[0].shape == (1, 9) and t.dims.seq == 9  # token input: seq = S
    assert build_model("user_models_t:tokens").dims.seq == 7


def test_user_spec_options_are_keyword_arguments(user_dir):
    b = build_model("user_models_t:sized:width=4,depth=3")
    assert sum(p.numel() for p in b.model.parameters()) == 3 * (4 * 4 + 4)
    with pytest.raises(ConfigError, match="takes no argument 'colour'; its arguments: width, depth"):
        build_model("user_models_t:sized:colour=3")
    with pytest.raises(ConfigError, match="not key=value"):
        build_model("user_models_t:sized:width")


def test_huge_user_model_allocates_nothing(user_dir):
    import psutil

    proc = psutil.Process()
    before = proc.memory_info().rss
    b = build_model("user_models_t:huge")
    after = proc.memory_info().rss
    assert sum(p.numel() for p in b.model.parameters()) == 2 * (65536 * 65536 + 65536)  # 8.59e9
    assert {p.device.type for p in b.model.parameters()} == {"meta"}
    assert after - before < 300 * 2**20


@pytest.mark.parametrize("spec,error,needles", [
    ("user_models_nope:make", ConfigError, ["no module 'user_models_nope'", "user_models_nope.py",
                                            "current directory"]),
    ("user_models_t:missing", ConfigError, ["no function 'missing'", "its functions:", "make", "user_models_t.py"]),
    ("user_models_t:NOT_CALLABLE", ConfigError, ["no function 'NOT_CALLABLE'"]),
    ("user_models_t:not_a_pair", ConfigError, ["returned a Linear", "(model, example_inputs)"]),
    ("user_models_t:not_a_module", ConfigError, ["is a str, not an nn.Module"]),
    ("user_models_t:no_tensor", ConfigError, ["holding no tensor"]),
    ("user_models_t:broken", UnsupportedModelError, ["broken() raised NameError", "user_models_t.py:",
                                                     "undefined_name"]),
])
def test_user_spec_errors_name_the_problem(user_dir, spec, error, needles):
    with pytest.raises(error) as e:
        build_model(spec)
    for needle in needles:
        assert needle in str(e.value)
    assert "Traceback" not in str(e.value)
