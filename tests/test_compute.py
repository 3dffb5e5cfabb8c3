"""Roofline op time: hand-computed cases, the skinny / small matmul curve, calibration override."""

from __future__ import annotations

import math

import pytest

from costmodel.calibration import Calibration, MatmulFit
from costmodel.compute import ComputeEfficiency, matmul_efficiency, matmul_time_s, op_time_s
from costmodel.errors import ConfigError
from costmodel.profiles import get_accelerator, make_cluster

A100 = get_accelerator("A100-SXM4-80GB")


def test_large_matmul_without_shape_runs_at_matmul_max():
    flops = 1e15
    t = op_time_s(flops=flops, bytes_moved=1e9, op_class="matmul", device=A100)
    assert math.isclose(t, flops / (312e12 * 0.85), rel_tol=1e-12)


def test_matmul_curve_hand_computed():
    m, n, k = 512, 4096, 4096
    ideal = 2 * m * n * k / 312e12
    expected = ideal / (ideal / 0.85 * (1 + 128 / 512) + 4e-6)
    assert math.isclose(matmul_efficiency(m, n, k, A100), expected, rel_tol=1e-12)
    # time = the larger of the compute time and the memory time of reading A, B and writing C in bf16
    bytes_moved = (m * k + k * n + m * n) * 2
    t = matmul_time_s(m, n, k, device=A100)
    assert math.isclose(t, max(ideal / expected, bytes_moved / (2039e9 * 0.85)), rel_tol=1e-12)


def test_skinny_and_small_matmuls_do_not_reach_peak():
    square = matmul_efficiency(8192, 8192, 8192, A100)
    assert 0.80 < square < 0.85
    by_min_dim = [matmul_efficiency(d, 8192, 8192, A100) for d in (16, 64, 256, 1024, 4096)]
    assert by_min_dim == sorted(by_min_dim) and by_min_dim[0] < 0.15
    by_size = [matmul_efficiency(s, s, s, A100) for s in (256, 512, 1024, 2048, 4096)]
    assert by_size == sorted(by_size) and by_size[0] < 0.3
    # a 16-token decode GEMM is memory-bound: its time is close to streaming the weight once
    t = matmul_time_s(16, 4096, 4096, device=A100)
    assert t == pytest.approx(4096 * 4096 * 2 / (2039e9 * 0.85), rel=0.3)


def test_memory_bound_ops_run_at_hbm_bandwidth_times_efficiency():
    t = op_time_s(flops=1e6, bytes_moved=4e9, op_class="elementwise", device=A100)
    assert math.isclose(t, 4e9 / (2039e9 * 0.85), rel_tol=1e-12)
    t_norm = op_time_s(flops=1e6, bytes_moved=4e9, op_class="norm", device=A100)
    assert math.isclose(t_norm, 4e9 / (2039e9 * 0.70), rel_tol=1e-12)
    assert op_time_s(flops=0, bytes_moved=4e9, op_class="view", device=A100) == 0.0


def test_attention_and_efficiency_override():
    t = op_time_s(flops=1e14, bytes_moved=0.0, op_class="attention", device=A100)
    assert math.isclose(t, 1e14 / (312e12 * 0.55), rel_tol=1e-12)
    half = ComputeEfficiency(matmul_max=0.425)
    t_half = op_time_s(flops=1e15, bytes_moved=0.0, op_class="matmul", device=A100, efficiency=half)
    assert math.isclose(t_half, 1e15 / (312e12 * 0.425), rel_tol=1e-12)


def test_dtype_selects_the_peak():
    h100 = get_accelerator("H100-SXM5-80GB")
    t_bf16 = op_time_s(flops=1e15, bytes_moved=0, op_class="matmul", device=h100, dtype="bf16")
    t_fp32 = op_time_s(flops=1e15, bytes_moved=0, op_class="matmul", device=h100, dtype="fp32")
    assert t_fp32 / t_bf16 == pytest.approx(989.4 / 66.9)


def test_calibration_overrides_the_defaults():
    fit = MatmulFit(dtype="fp32", peak_tflops=0.04, dim_half=8.0, flops_half=1e5)
    cal = Calibration(
        device_name="test cpu", accelerator="cpu-local", date="2026-01-01T00:00:00+00:00", backend="gloo",
        memory_gb=8.0, matmul=(), membound=(), membound_gbps=6.0, collectives=(), matmul_fits=(fit,),
        collective_fits=(),
    )  # fmt: skip
    cpu = make_cluster("local", 1, gpus_per_node=2, calibration=cal).gpu
    assert cpu.tflops("fp32") == 0.04 and cpu.hbm_gbps == 6.0
    m, n, k = 256, 256, 256
    t = op_time_s(flops=2 * m * n * k, bytes_moved=0, op_class="matmul", device=cpu, dtype="fp32", shape=(m, n, k), calibration=cal)
    assert math.isclose(t, (2 * m * n * k * (1 + 8 / 256) + 1e5) / 0.04e12, rel_tol=1e-12)
    t_mem = op_time_s(flops=0, bytes_moved=6e9, op_class="elementwise", device=cpu, calibration=cal)
    assert math.isclose(t_mem, 1.0, rel_tol=1e-12)  # the measured 6 GB/s
    # a calibration of another device is ignored
    assert matmul_efficiency(m, n, k, A100, cal) == matmul_efficiency(m, n, k, A100)


def test_bad_inputs():
    with pytest.raises(ConfigError, match="unknown op_class 'conv'"):
        op_time_s(flops=1, bytes_moved=1, op_class="conv", device=A100)
    with pytest.raises(ConfigError, match="must be >= 0"):
        op_time_s(flops=-1, bytes_moved=1, op_class="matmul", device=A100)
    with pytest.raises(ConfigError, match="must all be >= 1"):
        matmul_efficiency(0, 8, 8, A100)


def test_dropless_experts_take_at_least_the_host_time_of_their_per_expert_gemms():
    """A tiny MoE block (8 experts, FLOPs of microseconds) priced for megatron with ``expert_gemm_host_s`` 1 ms:
    each pass takes the host time of its per-expert GEMMs, 2 (forward) / 4 (backward) per local expert, expert
    parallelism dividing the local experts; with 0 the same block takes microseconds, and a dense block is
    unchanged (``planner.search.block_cost.expert_host_s``)."""
    from dataclasses import replace

    from costmodel.step import layer_contexts
    from costmodel.step_config import ParallelConfig
    from costmodel.targets import load_target
    from planner.workload import workload_from_model

    megatron = load_target("megatron")
    cluster = make_cluster("dgx-h100", 1, gpus_per_node=2)

    def block(spec: str, host_s: float, ep: int):
        w = workload_from_model(spec)[0]
        target = replace(megatron, constants=replace(megatron.constants, expert_gemm_host_s=host_s))
        ctxs = layer_contexts(w, ParallelConfig(dp=2, ep=ep, microbatch=1, global_batch=2), cluster, target=target)
        i = next(i for i, layer in enumerate(w.layers) if layer.kind == "transformer")
        return w.coster(w.layers[i], ctxs[i])

    moe = "mixtral:layers=2,hidden=64,ffn=128,heads=4,kv_heads=2,vocab=128,seq=16,experts=8,topk=2"
    for ep in (1, 2):
        c = block(moe, 1e-3, ep)
        assert c.fwd_s == pytest.approx(2 * (8 // ep) * 1e-3)
        assert c.bwd_s == pytest.approx(4 * (8 // ep) * 1e-3)
    free = block(moe, 0.0, 2)
    assert free.fwd_s < 1e-4 and free.bwd_s < 2e-4
    dense = "llama:layers=2,hidden=64,ffn=128,heads=4,kv_heads=2,vocab=128,seq=16"
    assert block(dense, 1e-3, 1).fwd_s == block(dense, 0.0, 1).fwd_s < 1e-4
