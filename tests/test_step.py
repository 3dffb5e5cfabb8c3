"""costmodel.step: FLOP accounting, validation errors, monotonic behaviour, speed, and the SC21 fidelity."""

import time

import pytest

from costmodel.analytic import gpt_workload, llama_workload, sc21_model_flops
from costmodel.errors import ConfigError
from costmodel.profiles import make_cluster
from costmodel.comm import DEFAULT_EFFICIENCY
from costmodel.step import ParallelConfig, estimate_step, even_stage_layers
from costmodel.targets import load_target

AUTOPAR = load_target("autopar").constants


@pytest.fixture(scope="module")
def gpt175():
    return gpt_workload(layers=96, hidden=12288, heads=96)


@pytest.fixture(scope="module")
def cluster64():
    return make_cluster("dgx-a100-80gb", 64)  # 512 GPUs


def cfg(**kw):
    base = dict(tp=8, pp=8, dp=8, microbatch=1, global_batch=512, schedule="1f1b", recompute="full")
    base.update(kw)
    return ParallelConfig(**base)


def test_flops_are_sc21_eq3(gpt175, cluster64):
    est = estimate_step(gpt175, cfg(), cluster64)
    model = sc21_model_flops(batch=512, seq=2048, layers=96, hidden=12288, vocab=51200, recompute=False)
    hw = sc21_model_flops(batch=512, seq=2048, layers=96, hidden=12288, vocab=51200, recompute=True)
    assert est.model_tflops_per_gpu * est.step_time_s * 512 * 1e12 == pytest.approx(model, rel=1e-9)
    assert est.hw_tflops_per_gpu * est.step_time_s * 512 * 1e12 == pytest.approx(hw, rel=1e-9)
    assert est.mfu == pytest.approx(est.model_tflops_per_gpu / 312.0)
    assert est.tokens_per_s == pytest.approx(512 * 2048 / est.step_time_s)
    no_rec = estimate_step(gpt175, cfg(recompute="none"), cluster64)
    assert no_rec.hw_tflops_per_gpu == pytest.approx(no_rec.model_tflops_per_gpu)


def test_breakdown_sums_to_step_time(gpt175, cluster64):
    for c in (cfg(), cfg(schedule="interleaved-1f1b", virtual_stages=2), cfg(zero_stage=1, pp=4, dp=16),
              cfg(schedule="zero-bubble", recompute="none", microbatch=1)):
        est = estimate_step(gpt175, c, cluster64)
        assert sum(est.breakdown_s.values()) == pytest.approx(est.step_time_s)
        assert est.bottleneck == max(est.breakdown_s, key=est.breakdown_s.get)
        assert {"compute", "bubble", "optimizer"} <= set(est.breakdown_s)
        assert any(k.startswith("comm_") for k in est.breakdown_s)


def test_bubble_matches_closed_form(gpt175, cluster64):
    m = 512 // (8 * 1)
    est = estimate_step(gpt175, cfg(), cluster64)
    ideal = est.breakdown_s["compute"] + sum(v for k, v in est.breakdown_s.items() if k == "comm_nvswitch")
    # the even split puts the embedding / head on the outer stages, so the bubble is at least (p-1)/m
    assert est.breakdown_s["bubble"] / ideal == pytest.approx((8 - 1) / m, rel=0.25)
    inter = estimate_step(gpt175, cfg(schedule="interleaved-1f1b", virtual_stages=4), cluster64)
    assert inter.breakdown_s["bubble"] < est.breakdown_s["bubble"] / 3


def test_recompute_trades_time_for_memory(gpt175, cluster64):
    full, sel, none = (estimate_step(gpt175, cfg(recompute=r, flash_attention=False), cluster64)
                       for r in ("full", "selective", "none"))
    assert full.step_time_s > sel.step_time_s > none.step_time_s
    assert full.memory_breakdown_gb["activations"] < sel.memory_breakdown_gb["activations"]
    assert sel.memory_breakdown_gb["activations"] < none.memory_breakdown_gb["activations"]
    # flash attention never stores the scores: selective recomputation saves nothing more
    fl = [estimate_step(gpt175, cfg(recompute=r), cluster64).memory_breakdown_gb["activations"]
          for r in ("selective", "none")]
    assert fl[0] == pytest.approx(fl[1]) and fl[1] < none.memory_breakdown_gb["activations"]


def test_recompute_layers_per_stage(gpt175, cluster64):
    """Recomputing k of each stage's 12 layers sits between none and all of them, monotone in k, and the
    endpoints equal the whole-model modes."""
    full = estimate_step(gpt175, cfg(), cluster64)
    none = estimate_step(gpt175, cfg(recompute="none"), cluster64)
    assert estimate_step(gpt175, cfg(recompute_layers=(12,) * 8), cluster64).step_time_s == pytest.approx(
        full.step_time_s)
    zero = estimate_step(gpt175, cfg(recompute_layers=(0,) * 8), cluster64)
    assert zero.step_time_s == pytest.approx(none.step_time_s)
    assert zero.memory_gb_per_device == pytest.approx(none.memory_gb_per_device)
    assert zero.hw_tflops_per_gpu == pytest.approx(zero.model_tflops_per_gpu)
    times, mems = [], []
    for k in (0, 3, 6, 12):
        est = estimate_step(gpt175, cfg(recompute_layers=(k,) * 8), cluster64)
        times.append(est.step_time_s)
        mems.append(est.memory_breakdown_gb["activations"])
    assert times == sorted(times) and mems == sorted(mems, reverse=True)
    assert len(set(times)) == 4 and len(set(mems)) == 4
    # only the stage that recomputes pays for it
    one = estimate_step(gpt175, cfg(recompute_layers=(12,) + (0,) * 7), cluster64)
    assert one.stage_time_s[0] == pytest.approx(full.stage_time_s[0])
    assert one.stage_time_s[1] == pytest.approx(none.stage_time_s[1])
    assert one.stage_memory_gb[0] < none.stage_memory_gb[0]
    assert one.stage_memory_gb[1] == pytest.approx(none.stage_memory_gb[1])


@pytest.mark.parametrize("rl, match", [((1,) * 7, "one per pipeline chunk"), ((13,) * 8, "use 0..12"),
                                       ((-1,) * 8, "use 0..12")])
def test_recompute_layers_errors(gpt175, cluster64, rl, match):
    with pytest.raises(ConfigError, match=match):
        estimate_step(gpt175, cfg(recompute_layers=rl), cluster64)


def test_zero_stages_shrink_model_states(cluster64):
    """Model states in the target's layout: DeepSpeed's ZeRO stages (2 + 2 + 12 bytes, SC20), autopar's fp32
    DDP (4 + 4 + 4 bucket copy + 8)."""
    w = gpt_workload(layers=24, hidden=2048, heads=16)

    def states(z: int, target: str) -> float:
        est = estimate_step(w, ParallelConfig(tp=1, pp=1, dp=512, microbatch=1, global_batch=512, zero_stage=z),
                            cluster64, target=load_target(target))
        mb = est.memory_breakdown_gb
        return mb["weights"] + mb["gradients"] + mb["optimizer"]

    totals = [states(z, "deepspeed") for z in (0, 1, 2, 3)]
    p = w.params
    assert totals[0] == pytest.approx(16 * p / 1e9)
    assert totals[1] == pytest.approx((4 + 12 / 512) * p / 1e9)
    assert totals[3] == pytest.approx(16 * p / 512 / 1e9)
    assert totals == sorted(totals, reverse=True)
    assert states(0, "autopar") == pytest.approx(20 * p / 1e9)


def test_pipeline_inflight_sets_activation_memory(gpt175, cluster64):
    one = estimate_step(gpt175, cfg(), cluster64)
    gpipe = estimate_step(gpt175, cfg(schedule="gpipe"), cluster64)
    # 1F1B: first stage holds pp=8 micro-batches, GPipe all m=64
    assert gpipe.memory_breakdown_gb["activations"] > 6 * one.memory_breakdown_gb["activations"]
    assert one.stage_memory_gb[0] > one.stage_memory_gb[-2]  # earlier stages hold more in flight


def test_uneven_stage_layers(gpt175, cluster64):
    even = estimate_step(gpt175, cfg(), cluster64)
    assert even.stage_layers == even_stage_layers(gpt175, 8) == (13, 12, 12, 12, 12, 12, 12, 13)
    skew = estimate_step(gpt175, cfg(), cluster64, stage_layers=(20, 10, 12, 12, 12, 12, 12, 8))
    assert skew.step_time_s > even.step_time_s
    assert skew.stage_time_s[0] > even.stage_time_s[0]
    with pytest.raises(ConfigError, match="summing"):
        estimate_step(gpt175, cfg(), cluster64, stage_layers=(13, 12))


def test_chooses_microbatch_and_virtual_stages(gpt175, cluster64):
    est = estimate_step(gpt175, cfg(microbatch=None, schedule="interleaved-1f1b", virtual_stages=None), cluster64)
    assert set(est.chosen) == {"microbatch", "virtual_stages"}
    assert est.config.microbatch == est.chosen["microbatch"] and est.fits
    for mb in (1, 2, 4):
        try:
            other = estimate_step(gpt175, cfg(microbatch=mb, schedule="interleaved-1f1b",
                                              virtual_stages=est.chosen["virtual_stages"]), cluster64)
        except ConfigError:
            continue
        assert not other.fits or other.step_time_s >= est.step_time_s - 1e-12


def test_does_not_fit(cluster64):
    w = gpt_workload(layers=96, hidden=12288, heads=96)
    est = estimate_step(w, ParallelConfig(tp=1, pp=1, dp=512, microbatch=1, global_batch=512, zero_stage=0),
                        cluster64, target=load_target("deepspeed"))
    assert not est.fits and est.memory_gb_per_device > 16 * w.params / 1e9 * 0.99
    assert est.memory.dominant == "optimizer"  # fp32 master weights + Adam: 12 of the 16 bytes


@pytest.mark.parametrize("kw,match", [
    (dict(tp=7, dp=9), "tp=7 does not divide heads=96"),
    (dict(dp=4), "!= 512 devices; use dp=8"),
    (dict(global_batch=500), "global_batch 496 or 504"),
    (dict(microbatch=3), r"microbatch in \[2, 4\]"),
    (dict(schedule="interleaved-1f1b", virtual_stages=2, global_batch=8 * 12), "num_microbatches % pp"),
    (dict(recompute="most"), "recompute='most'"),
    (dict(ep=2), "needs a MoE model"),
    (dict(pp=64, dp=1, virtual_stages=2, schedule="interleaved-1f1b", global_batch=64), "exceeds the 96"),
])
def test_config_errors(gpt175, cluster64, kw, match):
    with pytest.raises(ConfigError, match=match):
        estimate_step(gpt175, cfg(**kw), cluster64)


def test_kv_heads_and_moe():
    cl = make_cluster("dgx-h100", 4)
    llama = llama_workload(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256, seq=8192)
    with pytest.raises(ConfigError, match="kv_heads=8"):
        estimate_step(llama, ParallelConfig(tp=16, pp=1, dp=2, microbatch=1, global_batch=8), cl)
    moe = llama_workload(layers=8, hidden=1024, heads=16, kv_heads=4, ffn_hidden=2048, vocab=32000, seq=2048,
                         experts=8, topk=2)
    base = dict(tp=2, pp=1, microbatch=1, global_batch=64, flash_attention=True)
    dense = estimate_step(moe, ParallelConfig(dp=16, ep=1, **base), cl)
    ep = estimate_step(moe, ParallelConfig(dp=16, ep=8, **base), cl)
    assert ep.memory_breakdown_gb["weights"] < dense.memory_breakdown_gb["weights"]  # experts sharded over ep
    assert ep.breakdown_s.get("comm_nvswitch", 0) + ep.breakdown_s.get("comm_infiniband", 0) > \
        dense.breakdown_s.get("comm_nvswitch", 0) + dense.breakdown_s.get("comm_infiniband", 0) - 1e-12
    cp = estimate_step(llama, ParallelConfig(tp=8, cp=2, pp=1, dp=2, microbatch=1, global_batch=8), cl)
    no_cp = estimate_step(llama, ParallelConfig(tp=8, cp=1, pp=1, dp=4, microbatch=1, global_batch=8), cl)
    assert cp.memory_breakdown_gb["activations"] < no_cp.memory_breakdown_gb["activations"]


def test_fast_enough(gpt175, cluster64):
    w = gpt_workload(layers=100, hidden=8192, heads=64)
    c = cfg(schedule="interleaved-1f1b", virtual_stages=2, pp=4, dp=16)
    estimate_step(w, c, cluster64)
    n = 200
    t0 = time.process_time()
    for _ in range(n):
        estimate_step(w, c, cluster64)
    per_call_ms = (time.process_time() - t0) / n * 1e3
    print(f"estimate_step: {per_call_ms:.3f} ms CPU per call")
    assert per_call_ms < 5.0  # target < 1 ms on an idle core; generous for a loaded CI machine


def test_fidelity_sc21_targets():
    """benchmarks/fidelity.py on every Table 1 / Table 2 case (analytic workload): the regression gate."""
    from benchmarks.fidelity import run, summary

    rows = run(workload="analytic")
    s = summary(rows)
    assert s["cases"] == 22
    assert s["median_abs_error"] <= 0.05
    for r in rows:
        assert abs(r["error"]) <= 0.10, (r["case"], r["predicted_tflops"], r["measured_tflops"])


def test_data_parallel_overlap(cluster64):
    import dataclasses

    # one gradient all-reduce (no DDP buckets, each paying the 512-rank ring latency: test_priced_collectives)
    one = load_target("autopar")
    one = dataclasses.replace(one, constants=dataclasses.replace(one.constants, first_bucket_bytes=0.0))
    w = gpt_workload(layers=24, hidden=2304, heads=24)
    base = dict(tp=1, pp=1, dp=512, microbatch=1, global_batch=512)
    over = estimate_step(w, ParallelConfig(**base), cluster64, target=one)
    after = estimate_step(w, ParallelConfig(**base, overlap_grad_reduce=False), cluster64, target=one)
    exposed = lambda e: sum(v for k, v in e.breakdown_s.items() if k.startswith("comm_"))  # noqa: E731
    # the all-reduce (~0.04 s) hides inside the backward (~0.1 s): only the slowdown share stays exposed
    assert exposed(over) == pytest.approx(AUTOPAR.overlap_slowdown * exposed(after))
    assert exposed(after) > exposed(over) > 0
    assert after.step_time_s - over.step_time_s == pytest.approx(exposed(after) - exposed(over))


@pytest.mark.parametrize("per_layer", [1, 6])  # FSDP2 per block (autopar's runtime); DeepSpeed per module
def test_zero3_traffic_by_hand(per_layer):
    """ZeRO-3 on 2 DGX-A100 nodes, dp=16, one micro-batch: three passes (gather, gather for recompute +
    backward, reduce-scatter), each split into ``per_layer`` collectives per layer + 1 for embedding / head, each
    a flat ring at one HDR NIC per GPU: (n - 1) alpha + (n - 1) / n bytes / (25 GB/s x 0.92)."""
    import dataclasses

    from costmodel.step import _dp_comm, ByIdentity

    cluster = make_cluster("dgx-a100-80gb", 2)
    k = dataclasses.replace(AUTOPAR, zero3_collectives_per_layer=per_layer)
    n, layers, params = 16, 4, 1e9
    units = layers * per_layer + 1
    ring = lambda nbytes: (n - 1) * 5e-6 + (n - 1) / n * nbytes / (25e9 * DEFAULT_EFFICIENCY.infiniband)  # noqa: E731
    expected = 3 * units * ring(params * 2 / units)
    kind, got = _dp_comm((2.0, 2.0), ByIdentity(cluster), params, 0.0, 1, k, dp=n, cp=1, tp=1, ep=1, zero_stage=3,
                         recompute="full", layers=layers)
    assert kind == "infiniband"
    assert got == pytest.approx(expected, rel=1e-9)


def test_tensor_parallel_backward_counts_the_runtime_all_reduces():
    """Forward: 2 all-reduces per layer (attention and MLP outputs), or 2 all-gathers + 2 reduce-scatters under
    sequence parallelism. Backward as autopar's runtime runs it (CommDebugMode counts, see ``_tp_comm``): one
    all-reduce per column-parallel projection's input gradient (q, k, v, gate, up: 5 for SwiGLU), plus 2
    all-gathers under sequence parallelism; with Megatron-LM's fused q/k/v the mirror of the forward."""
    import dataclasses

    from costmodel.block_cost import LayerCtx
    from costmodel.comm import Group, collective_time_s

    cluster = make_cluster("dgx-a100-80gb", 1)
    w = llama_workload(layers=2, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=32000, seq=4096)
    layer = next(l for l in w.layers if l.kind == "transformer")
    t_of = lambda op: collective_time_s(op, 4096 * 4096 * 2, Group(size=8, stride=1), cluster).time_s  # noqa: E731
    ar, ag, rs = t_of("all_reduce"), t_of("all_gather"), t_of("reduce_scatter")
    cases = [(False, False, 2 * ar, 5 * ar), (True, False, 2 * ar, 2 * ar),
             (False, True, 2 * (ag + rs), 5 * ar + 2 * ag), (True, True, 2 * (ag + rs), 2 * (ag + rs))]
    for fused, sp, fwd, bwd in cases:
        k = dataclasses.replace(AUTOPAR, tp_fused_input_projections=fused)
        ctx = LayerCtx(device=cluster.groups[0].node.gpu, cluster=cluster, microbatch=1, tp=8, cp=1,
                       ep=1, sp=sp, recompute="none", flash=True, constants=k)
        t = w.coster(layer, ctx)
        assert t.comm_fwd == pytest.approx({"nvswitch": fwd}), (fused, sp)
        assert t.comm_bwd == pytest.approx({"nvswitch": bwd}), (fused, sp)


def test_pipeline_and_per_rank_rest_bound_the_step(gpt175, cluster64):
    """``pipeline_s`` is the pipeline part of the step and ``stage_rest_s`` each rank's exposed data-parallel
    traffic plus optimizer: the step is the pipeline plus the largest of each, so their sum bounds it below."""
    for c in (cfg(), cfg(zero_stage=3, pp=4, dp=16), cfg(zero_stage=2, schedule="interleaved-1f1b", virtual_stages=2)):
        est = estimate_step(gpt175, c, cluster64)
        assert len(est.stage_rest_s) == c.pp and min(est.stage_rest_s) > 0
        assert est.pipeline_s + max(est.stage_rest_s) <= est.step_time_s * (1 + 1e-12)
        exposed = est.step_time_s - est.pipeline_s - est.breakdown_s["optimizer"]  # the largest exposed dp traffic
        assert 0 <= exposed <= max(est.stage_rest_s)
        assert est.breakdown_s["optimizer"] <= max(est.stage_rest_s)
