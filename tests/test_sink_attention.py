"""GPT-OSS attention with per-head sinks through sdpa (planner.sink_attention): exact against the model's own
eager attention, and traced as attention ops (not folded into a norm around the sinks parameter)."""

from __future__ import annotations

import pytest
import torch

from planner.sink_attention import SINK_SDPA, sink_sdpa_forward

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")


class _Attn(torch.nn.Module):
    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.num_key_value_groups = heads // kv_heads


@pytest.mark.parametrize("window", [None, 4, 8])
@pytest.mark.parametrize("kv_heads", [2, 8])
def test_equals_the_eager_attention_with_sinks(window, kv_heads):
    torch.manual_seed(0)
    b, h, s, d = 2, 8, 16, 4
    m = _Attn(h, kv_heads).eval()
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, kv_heads, s, d), torch.randn(b, kv_heads, s, d)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    keep = (j <= i) & ((i - j < window) if window else True)
    mask = torch.zeros(s, s).masked_fill(~keep, float("-inf"))[None, None]
    ref, _ = gpt_oss.eager_attention_forward(m, q, k, v, mask, scaling=d ** -0.5)
    got, _ = sink_sdpa_forward(m, q, k, v, None, scaling=d ** -0.5, sliding_window=window, s_aux=m.sinks)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_gpt_oss_config_builds_and_traces_attention(tmp_path):
    import json

    from planner.models import build_model
    from planner.workload import workload_from_model

    cfg = {"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
           "num_experts_per_tok": 2, "vocab_size": 128, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 64}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    bundle = build_model(str(path), seq=32)
    assert bundle.model.config._attn_implementation == SINK_SDPA
    w = workload_from_model(str(path), seq=32)[0]
    blocks = [l for l in w.layers if l.kind == "transformer"]
    # the windowed layer computes 2 w + 1 keys a query (x the causal fraction), the full one the causal triangle
    assert 0 < blocks[0].attn_flops_fwd < blocks[1].attn_flops_fwd
    from planner.search.block_ops import layer_ops_from_block

    block = w.coster.block_of(blocks[1])
    ops = layer_ops_from_block(block, w.coster._graph, microbatch=1, seq=32, dtype="bf16")
    attention = [o for o in ops if o.kind == "attention"]
    assert len(attention) == 1
    # what is left in the module beside the sdpa call builds the sink key: no score-sized work
    rest = [o for o in ops if o.name.endswith("self_attn")]
    assert all(o.flops_fwd < 0.01 * attention[0].flops_fwd for o in rest)
