"""planner.workload: per-sequence Workload from a traced model, fingerprint, cache."""

from __future__ import annotations

import pytest

from costmodel.errors import ConfigError
from planner.graph import find_blocks
from planner.models import build_model
from planner.plan import model_fingerprint
from planner.workload import trace_spec, workload_from_graph, workload_from_model

SPEC = "llama:layers=4,hidden=128,ffn=256,heads=4,kv_heads=2,vocab=500,seq=64"


def test_workload_layers_and_totals():
    w, bits = workload_from_model(SPEC)
    assert [layer.kind for layer in w.layers] == ["embedding"] + ["transformer"] * 4 + ["head"]
    assert w.layers[1].name == "model.layers.0"
    model = build_model(SPEC).model
    assert w.params == bits.params == sum(p.numel() for p in model.parameters())
    assert (w.hidden, w.heads, w.kv_heads, w.ffn_hidden, w.vocab, w.seq, w.num_layers) == (128, 4, 2, 256, 500, 64, 4)
    assert w.glu and not w.tied_embeddings and w.dtype_bytes == 2  # traced in bf16
    assert w.flops_fwd_per_seq == pytest.approx(bits.graph.flops_fwd)
    assert w.meta["module_groups"]["head"] == ("model.norm", "lm_head")
    assert w.meta["attn_causal_fraction"] == pytest.approx(65 / 128)
    assert bits.num_layers == 4 and bits.seq_len == 64
    assert [g.repeat for g in bits.groups] == [1, 4, 1]


def test_fingerprint_is_over_the_full_model_as_built():
    _, bits = workload_from_model(SPEC)
    model = build_model(SPEC).model
    fp = model_fingerprint([(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()])
    assert bits.fingerprint == fp
    _, other = workload_from_model(SPEC.replace("layers=4", "layers=3"))
    assert other.fingerprint != fp


def test_cached_per_spec_and_seq():
    a = workload_from_model(SPEC)
    assert workload_from_model(SPEC) is a
    assert workload_from_model(SPEC, batch=4) is a  # per-sequence numbers: batch does not change them
    b = workload_from_model(SPEC, seq=32)
    assert b is not a and b[0].seq == 32
    # token-linear work halves, attention quarters
    assert b[0].layers[-1].flops_fwd == pytest.approx(a[0].layers[-1].flops_fwd / 2)


def test_workload_is_per_sequence():
    t2 = trace_spec(SPEC, batch=2)
    w2 = workload_from_graph(t2.graph, t2.dims, name=SPEC, batch=2, blocks=find_blocks(t2.graph))
    w1, _ = workload_from_model(SPEC)
    assert [x.flops_fwd for x in w2.layers] == pytest.approx([x.flops_fwd for x in w1.layers])
    assert [x.flops_bwd for x in w2.layers] == pytest.approx([x.flops_bwd for x in w1.layers])


def test_mixtral_expert_params():
    spec = "mixtral:layers=3,hidden=128,ffn=192,heads=4,kv_heads=2,vocab=500,seq=32,experts=4,topk=2"
    w, _ = workload_from_model(spec)
    layer = w.layers[1]
    assert layer.expert_params == 4 * 3 * 128 * 192
    assert (w.experts, w.topk) == (4, 2)


@pytest.mark.parametrize("kw,needle", [({"batch": 0}, "batch=0"), ({"seq": -1}, "seq=-1")])
def test_bad_arguments(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        workload_from_model(SPEC, **kw)
