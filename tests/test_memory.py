"""costmodel.memory: ZeRO model states and Korthikanti et al. 2022 activation formulas, hand-computed."""

import pytest

from costmodel import memory as M
from costmodel.errors import ConfigError

P = 1_000_000  # parameters of the device's shard


@pytest.mark.parametrize("stage,dp,want", [
    (0, 8, 16 * P),                 # 2 + 2 + 12 bytes per parameter
    (1, 8, 4 * P + 12 * P / 8),     # optimizer state sharded
    (2, 8, 2 * P + 14 * P / 8),     # + gradients
    (3, 8, 16 * P / 8),             # + weights
    (3, 1, 16 * P),
])
def test_zero_stages(stage, dp, want):
    got = M.model_state_bytes(params=P, zero_stage=stage, dp=dp)
    assert sum(got.values()) == pytest.approx(want)
    assert set(got) == {"weights", "gradients", "optimizer"}


def test_zero_stage_terms():
    got = M.model_state_bytes(params=P, zero_stage=2, dp=4)
    assert got == {"weights": 2 * P, "gradients": 2 * P / 4, "optimizer": 12 * P / 4}


# GPT-3 175B-like layer: s=2048, b=1, h=12288, a=96
S, B, H, A = 2048, 1, 12288, 96
SBH = S * B * H


def act(**kw):
    base = dict(seq=S, microbatch=B, hidden=H, heads=A)
    base.update(kw)
    return M.activation_bytes_per_layer(**base)


def test_korthikanti_no_parallelism():
    assert act() == pytest.approx(SBH * (34 + 5 * A * S / H))


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_tensor_parallel(t):
    assert act(tp=t) == pytest.approx(SBH * (10 + 24 / t + 5 * A * S / (H * t)))
    assert act(tp=t, sp=True) == pytest.approx(SBH * (34 + 5 * A * S / H) / t)
    assert act(tp=t, sp=True, recompute="selective") == pytest.approx(34 * SBH / t)
    assert act(tp=t, recompute="selective") == pytest.approx(SBH * (10 + 24 / t))
    assert act(tp=t, recompute="full") == pytest.approx(2 * SBH)
    assert act(tp=t, sp=True, recompute="full") == pytest.approx(2 * SBH / t)


def test_flash_attention_drops_the_score_term():
    assert act(flash=True) == pytest.approx(34 * SBH)
    assert act(flash=True, tp=8, sp=True) == pytest.approx(34 * SBH / 8)


def test_context_parallel_divides_the_sequence():
    assert act(flash=True, cp=4) == pytest.approx(34 * SBH / 4)
    assert act(recompute="full", cp=2) == pytest.approx(SBH)
    # scores: s/cp query rows against s keys, per rank
    assert act(cp=2) - act(cp=2, flash=True) == pytest.approx(5 * A * S * S * B / 4)


def test_microbatch_scales_linearly():
    assert act(microbatch=4) == pytest.approx(4 * act())


def test_gqa_and_swiglu_generalisation():
    # Llama-3-8B-like: h=4096, f=14336, 32 heads, 8 kv heads, SwiGLU
    h, f = 4096, 14336
    got = M.activation_bytes_per_layer(seq=S, microbatch=1, hidden=h, heads=32, kv_heads=8, ffn_hidden=f,
                                       glu=True, flash=True)
    want = S * h * (10 + 4 + 4 * 8 / 32 + 6 * f / h)
    assert got == pytest.approx(want)
    rep, shard, score = M.activation_terms(hidden=H, heads=A)
    assert (rep, shard, score) == (10.0, 24.0, 5.0)


def test_memory_estimate_dominant_and_reserve():
    est = M.memory_estimate({"weights": 4e9, "activations": 10e9})
    assert est.dominant == "activations"
    c = M.DEFAULT_MEMORY
    assert est.terms["allocator_reserve"] == pytest.approx(c.context_bytes + c.fragmentation * 14e9)
    assert est.total_gb == pytest.approx((14e9 + est.terms["allocator_reserve"]) / 1e9)


@pytest.mark.parametrize("kw,match", [
    (dict(recompute="some"), "recompute='some'"),
    (dict(tp=0), ">= 1"),
])
def test_bad_inputs(kw, match):
    with pytest.raises(ConfigError, match=match):
        act(**kw)
    with pytest.raises(ConfigError, match="zero_stage"):
        M.model_state_bytes(params=P, zero_stage=4, dp=2)
