"""DeepSeek-V3's multi-head latent attention (q / k head dim 192, v head dim 128) through one fused sdpa call with
v zero-padded (planner.mla_attention): exact against transformers' own eager and sdpa attention, traced as one
attention op that saves no score-sized tensor, FLOPs of the unpadded v, and the saved activations of a layer
within 20% of a Korthikanti-style count of what a flash-attention layer keeps."""

from __future__ import annotations

import json

import pytest
import torch

ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

from planner import mla_attention  # noqa: E402
from planner.mla_attention import PADDED_V_SDPA  # noqa: E402

# DeepSeek-V3's attention shape (qk_nope 128 + rope 64 = 192 against v 128, yarn rope) at a small width
_SMALL = dict(model_type="deepseek_v3", hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
              n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
              num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128, num_hidden_layers=4, first_k_dense_replace=2, vocab_size=256,
              max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000,
              rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"})


def _tiny_models(*impls: str) -> list:
    from transformers import DeepseekV3Config

    cfg = dict(_SMALL, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32, kv_lora_rank=16, num_hidden_layers=2,
               first_k_dense_replace=1, intermediate_size=64, moe_intermediate_size=16, vocab_size=64)
    cfg.pop("model_type")
    mla_attention.register()
    models = []
    for impl in impls:
        torch.manual_seed(0)
        m = ds.DeepseekV3ForCausalLM(DeepseekV3Config(**cfg, attn_implementation=impl)).float().eval()
        models.append(m)
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return models


def test_padded_v_equals_eager_and_sdpa_attention_and_their_gradients():
    eager, sdpa, padded = _tiny_models("eager", "sdpa", PADDED_V_SDPA)
    assert padded.config._attn_implementation == PADDED_V_SDPA
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (eager, sdpa, padded):
        logits = m(input_ids=ids).logits
        logits.square().mean().backward()
        grad = m.model.layers[0].self_attn.kv_b_proj.weight.grad.clone()
        outs.append((logits.detach(), grad))
    for logits, grad in outs[:2]:
        torch.testing.assert_close(outs[2][0], logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[2][1], grad, rtol=1e-4, atol=1e-6)


def test_padded_v_runs_the_fused_cpu_kernel():
    """The unpadded call takes sdpa's math path (scores materialised); the padded one the fused kernel."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = torch.randn(1, 2, 16, 24), torch.randn(1, 2, 16, 24), torch.randn(1, 2, 16, 16)
    attn = type("A", (torch.nn.Module,), {})()
    attn.is_causal, attn.num_key_value_groups = True, 1
    for fn, fused in ((lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), False),
                      (lambda: mla_attention.padded_v_sdpa_forward(attn, q, k, v, None)[0], True)):
        with Ops() as ops:
            out = fn()
        assert out.shape[-1] == 16
        assert any("_scaled_dot_product_flash_attention_for_cpu" in s for s in ops.seen) == fused, ops.seen


def test_configs_with_narrower_v_are_selected(tmp_path):
    from planner.models import build_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(_SMALL, num_hidden_layers=2)))
    assert build_model(str(path), seq=16).model.config._attn_implementation == PADDED_V_SDPA
    assert mla_attention.qk_v_head_dims(build_model(str(path), seq=16).model.config) == (192, 128)
    path.write_text(json.dumps(dict(_SMALL, num_hidden_layers=2, v_head_dim=192)))  # equal dims: plain sdpa
    assert build_model(str(path), seq=16).model.config._attn_implementation == "sdpa"


def _flash_layer_bytes_per_token(c: dict, *, moe: bool) -> float:
    """Bytes one token's activations in a DeepSeek-V3 layer keep for backward with a flash kernel, bf16 (2 bytes)
    unless said, counted per tensor autograd saves (Korthikanti et al. 2022, Sec. 4.1, for this layer):

    - each RMSNorm of width n (input, q_a, kv_a, post-attention) and the GEMMs it feeds: the norm's input 2n and
      fp32 1 / rms 4, the GEMMs' input 2n: 4n + 4 (Korthikanti's "LayerNorm input" and "QKV / MLP input");
    - flash attention over H heads: q, k, v (padded to d_qk) and the output (d_qk wide) 4 * 2 H d_qk, the fp32
      log-sum-exp 4H; no (S x S) term;
    - o_proj's input 2 H d_v;
    - dense GLU MLP of width f: gate, SiLU, up outputs and their product (down's input): 8f;
    - MoE: the router's fp32 input and expert scores 4h + 4E; per routed copy (top-k) the token 2h, the gate/up
      outputs 4 f_e, SiLU and product 4 f_e, the expert output the routing weight multiplies 2h; the shared
      experts a GLU MLP of width n_shared f_e.
    """
    h, heads = c["hidden_size"], c["num_attention_heads"]
    dqk, dv = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    total = (4 * (2 * h + c["q_lora_rank"] + c["kv_lora_rank"]) + 4 * 4 + 4 * 2 * heads * dqk + 4 * heads
             + 2 * heads * dv)
    if not moe:
        return total + 8 * c["intermediate_size"]
    fe, k = c["moe_intermediate_size"], c["num_experts_per_tok"]
    return total + 4 * h + 4 * c["n_routed_experts"] + k * (4 * h + 8 * fe) + 8 * c["n_shared_experts"] * fe


def test_traced_block_has_one_flash_attention_and_flash_sized_activations(tmp_path):
    from costmodel.block_cost import LayerCtx
    from costmodel.profiles import make_cluster
    from costmodel.targets import load_target
    from planner.workload import workload_from_model

    seq = 1024
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_SMALL))
    w, bits = workload_from_model(str(path), seq=seq)
    graph = bits.graph
    heads, dqk, dv = _SMALL["num_attention_heads"], 192, 128
    score_bytes = heads * seq * seq * 2  # one bf16 (B=1, H, S, S) tensor
    cluster = make_cluster("dgx-h100", 1)
    ctx = LayerCtx(device=cluster.groups[0].node.gpu, cluster=cluster, microbatch=1, tp=1, cp=1, ep=1, sp=False,
                   recompute="none", flash=True, constants=load_target("autopar").constants)
    blocks = [layer for layer in w.layers if layer.kind == "transformer"]
    assert len(blocks) == _SMALL["num_hidden_layers"]
    for i, fqn in ((1, "model.layers.1"), (3, "model.layers.3")):
        nodes = [n for n in graph.nodes if n.block == fqn]
        attention = [n for n in nodes if n.op_class == "attention"]
        assert len(attention) == 1 and "scaled_dot_product_attention" in attention[0].target
        assert attention[0].input_shapes[2][-1] == dqk  # v padded to the q / k head dim
        assert max(n.saved_bytes or 0.0 for n in nodes) < score_bytes / 4  # nothing score-sized is kept
        assert not any(n.op_class in ("matmul",) and len(n.output_shapes[0]) == 4 and n.output_shapes[0][-1] == seq
                       for n in nodes)  # no q k^T bmm
        # FLOPs of the unpadded v: 2 S^2 H (d_qk + d_v) forward (dense count; the causal fraction is separate)
        assert attention[0].flops_fwd == pytest.approx(2 * seq * seq * heads * (dqk + dv))
        assert attention[0].causal_fraction == pytest.approx((seq + 1) / (2 * seq))
        expect = _flash_layer_bytes_per_token(_SMALL, moe=i >= _SMALL["first_k_dense_replace"]) * seq
        got = w.coster(blocks[i], ctx).activation_bytes
        print(f"layer {i}: activation_bytes {got:.4g}, flash estimate {expect:.4g} ({got / expect - 1:+.1%})")
        assert got == pytest.approx(expect, rel=0.2), (i, got, expect)


def test_gpt_oss_sink_attention_pads_v_too(tmp_path):
    """GPT-OSS's sink attention (planner.sink_attention) gives q / k one more feature than v: v is zero-padded as
    well, so each layer's sdpa saves q, k, v, the output and the log-sum-exp, not the scores, and the FLOPs are
    those of the unpadded v."""
    from planner.workload import workload_from_model

    seq, heads, d = 512, 4, 16
    cfg = {"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": d, "num_local_experts": 4,
           "num_experts_per_tok": 2, "vocab_size": 128, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 1024}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    graph = workload_from_model(str(path), seq=seq)[1].graph
    full = [n for n in graph.nodes if n.op_class == "attention" and n.block == "model.layers.1"]
    assert len(full) == 1
    q, k, v = full[0].input_shapes[:3]
    assert q[-1] == k[-1] == v[-1] == d + 1
    # q, k, v and the output (1, H, S + 1, d + 1) bf16 plus an fp32 log-sum-exp (the padded v is the pad op's)
    flash = (3 * heads * (seq + 1) * (d + 1)) * 2 + heads * (seq + 1) * 4
    assert full[0].saved_bytes <= flash < heads * seq * seq * 2
    assert full[0].flops_fwd == pytest.approx(2 * heads * (seq + 1) ** 2 * ((d + 1) + d))
