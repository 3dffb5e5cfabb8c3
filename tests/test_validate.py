"""``autopar validate``: a measured 2-rank run of a hand-made plan (numbers come from the run, not the plan), the
table's arithmetic, and bad input (typed errors, exit 1)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re

import pytest

from cli.commands import validate as cmd


def _opt():
    from runtime_cases import opt_model

    return opt_model()


@pytest.mark.distributed
@pytest.mark.slow  # spawns 2 ranks that import transformers: 20-50 s on 2 shared cores
def test_measure_plan_two_ranks():
    from runtime.manual_plan import manual_plan
    from runtime.measure.validate import measure_plan

    plan = manual_plan(_opt(), dp=2, microbatch_size=1, num_microbatches=1, seq_len=8)
    got = measure_plan(plan, model_factory=functools.partial(_opt), steps=2, warmup=1, compute_dtype="fp32")
    assert [m.rank for m in got] == [0, 1]
    for m in got:
        assert len(m.step_times_s) == 2 and all(t > 0 for t in m.step_times_s)
        assert min(m.step_times_s) <= m.step_time_s <= max(m.step_times_s)
        assert m.peak_rss_bytes >= m.base_rss_bytes > 0
        assert len(m.losses) == 2 and all(0 < x < 20 for x in m.losses)
    assert got[0].losses == got[1].losses  # the global mean loss on every rank


@pytest.mark.distributed
@pytest.mark.slow  # spawns 2 ranks that import transformers
def test_measure_plans_in_turns():
    from costmodel.errors import ConfigError
    from runtime.manual_plan import manual_plan
    from runtime.measure.validate import measure_plans

    plans = [manual_plan(_opt(), dp=2, zero_stage=z, microbatch_size=1, num_microbatches=1, seq_len=8)
             for z in (0, 3)]
    got = measure_plans(plans, model_factories=[functools.partial(_opt)] * 2, steps=3, warmup=1,
                        compute_dtype="fp32")
    assert len(got) == 2 and all([m.rank for m in per_plan] == [0, 1] for per_plan in got)
    for per_plan in got:
        for m in per_plan:
            assert len(m.step_times_s) == 3 and all(t > 0 for t in m.step_times_s)
            assert len(m.losses) == 3 and all(0 < x < 20 for x in m.losses)
        assert per_plan[0].losses == per_plan[1].losses
    assert got[0][0].model_rss_bytes > 0  # the first plan's model and optimizer
    with pytest.raises(ConfigError, match="world sizes"):
        measure_plans([plans[0], manual_plan(_opt(), dp=1, seq_len=8)], model_factories=[_opt, _opt])


def _parse(*argv):
    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    return p.parse_args(list(argv))


def test_row_error_is_relative_to_measured():
    from runtime.manual_plan import manual_plan
    from runtime.measure.validate import RankMeasurement, step_times_s

    plan = manual_plan(_opt(), dp=2)
    plan = dataclasses.replace(plan, prediction=dataclasses.replace(plan.prediction, step_time_s=1.2,
                                                                     memory_gb_per_device=0.5))
    # per step the slowest rank counts: steps (1.0, 0.8, 1.3) -> median 1.0, fastest 0.8
    times = ((0.9, 0.8, 1.3), (1.0, 0.7, 1.2))
    ms = [RankMeasurement(rank=r, step_times_s=t, step_time_s=sorted(t)[1], peak_rss_bytes=int(3e8),
                          base_rss_bytes=int(1e8), losses=(1.0,) * 3, peak_live_bytes=int(4e8) + r * int(1e8),
                          live_bytes={"parameters": int(1e8)}) for r, t in enumerate(times)]
    assert step_times_s(ms) == [1.0, 0.8, 1.3]
    row = cmd._row(plan, ms)
    assert row["measured_s"] == 1.0 and row["fastest_s"] == 0.8 and row["error"] == pytest.approx(0.2)
    assert row["measured_gb"] == pytest.approx(0.5)  # the fullest rank's live tensor bytes
    assert row["memory_error"] == pytest.approx(0.0) and row["model_rss_gb"] == pytest.approx(0.2)
    table = cmd._format([row], header=True)
    assert "+20.0%" in table and "0.800" in table and "1.200" in table and "+0.0%" in table
    # a GPU plan's allocator reserve (CUDA context, fragmentation) is no tensor: the error leaves it out
    gpu = dataclasses.replace(plan, prediction=dataclasses.replace(
        plan.prediction, memory_gb_per_device=0.8, memory_breakdown_gb={"weights": 0.5, "allocator_reserve": 0.3}))
    row = cmd._row(gpu, ms)
    assert row["predicted_tensor_gb"] == pytest.approx(0.5) and row["memory_error"] == pytest.approx(0.0)
    assert row["predicted_gb"] == pytest.approx(0.8)
    # plans run in turns count no live bytes: memory is not measured, and the table says so rather than 0.000
    unmeasured = [dataclasses.replace(m, peak_live_bytes=0, live_bytes={}) for m in ms]
    row = cmd._row(plan, unmeasured)
    assert row["measured_gb"] is None and row["memory_error"] is None
    line = cmd._format([row], header=False)
    assert "0.000" not in line and re.search(r" 0\.500 +- +- +0\.300 ", line), line  # pred GB, meas GB, mem err, RSS


TINY = "llama:layers=2,hidden=64,ffn=128,heads=2,kv_heads=2,vocab=128,seq=16"


def _cal(scale: float = 1.0, bf16_peak: float | None = None):
    import test_calibration as tc
    from costmodel.calibration import MatmulPoint, build_calibration

    base = tc._with_dispatch(cpu_cores=2, concurrent_ranks=2)
    matmul = tuple(dataclasses.replace(p, time_s=p.time_s / scale) for p in base.matmul)
    if bf16_peak is not None:  # bf16 points at a flat rate
        matmul += tuple(MatmulPoint(m=p.m, n=p.n, k=p.k, dtype="bf16", time_s=p.flops / (bf16_peak * 1e12))
                        for p in base.matmul)
    return build_calibration(
        device_name=base.device_name, accelerator=base.accelerator, date=base.date, backend=base.backend,
        memory_gb=base.memory_gb, matmul=matmul, membound=base.membound, collectives=base.collectives,
        dispatch=base.dispatch, cpu_cores=2, concurrent_ranks=2,
    )  # fmt: skip


def test_compute_dtype_follows_the_calibration():
    from planner.reprice import calibration_for
    from runtime.measure.validate import compute_dtype

    emulated = _cal(bf16_peak=1e-4)  # bf16 far below fp32 (0.05 TFLOP/s): a CPU without native bf16
    assert compute_dtype(emulated, "auto") == "fp32" and compute_dtype(emulated, "bf16") == "bf16"
    assert compute_dtype(_cal(bf16_peak=1.0), "auto") == "bf16"
    assert compute_dtype(None, "auto") == "fp32"
    fp32_only = calibration_for(emulated, "fp32")
    assert [f.dtype for f in fp32_only.matmul_fits] == ["fp32"] and fp32_only.dispatch_fit == emulated.dispatch_fit
    assert calibration_for(emulated, "bf16") is emulated


def test_plans_made_on_the_fly_are_priced_with_the_calibration():
    from costmodel.profiles import make_cluster
    from planner.reprice import reprice

    args = _parse("--model", TINY, "--gpus-per-node", "2", "--global-batch", "4", "--fix", "dp=2,zero=0")
    slow, fast = _cal(), _cal(scale=4.0)
    (p_slow,), (p_fast,) = cmd._plans(args, slow, "fp32"), cmd._plans(args, fast, "fp32")
    assert p_fast.prediction.step_time_s < p_slow.prediction.step_time_s
    # the same configuration re-priced on the calibrated cluster gives the plan's own prediction
    again = reprice(p_slow, make_cluster("local", 1, gpus_per_node=2, calibration=slow), dtype="fp32")
    assert again.prediction.step_time_s == pytest.approx(p_slow.prediction.step_time_s, rel=1e-12)
    assert p_slow.prediction.breakdown_s["compute"] > 3 * (1e-3 + 2e-3)  # the calibrated dispatch time is in it
    bf16 = reprice(p_slow, make_cluster("local", 1, gpus_per_node=2, calibration=slow), dtype="bf16")
    assert bf16.prediction.step_time_s < p_slow.prediction.step_time_s  # half the bytes to reduce


def test_bad_input_is_a_typed_error():
    from costmodel.errors import ConfigError
    from runtime.manual_plan import manual_plan
    from runtime.measure.validate import measure_plan

    with pytest.raises(ConfigError, match="nothing to validate"):
        cmd._plans(_parse(), None)
    with pytest.raises(ConfigError, match="not both"):
        cmd._plans(_parse("x.json", "--model", "gpt2"), None)
    with pytest.raises(ConfigError, match="steps=0"):
        measure_plan(manual_plan(_opt(), dp=2), model_factory=_opt, steps=0)


def test_cli_registered_and_error_exit(capsys):
    from cli.main import main

    assert main(["validate"]) == 2
    assert "nothing to validate" in capsys.readouterr().err


def test_pooled_compute_takes_the_median_run_of_each_slowest_rank():
    """Three plans' sweeps (two ranks each): per point the slower rank, then the median over the plans."""
    import dataclasses as dc

    from runtime.measure.compute import pooled_compute

    base = _cal()

    def sweep(scale: float) -> tuple[list, list, list]:
        return ([dc.replace(p, time_s=p.time_s * scale) for p in base.matmul],
                [dc.replace(p, time_s=p.time_s * scale) for p in base.membound],
                [dc.replace(p, fwd_s=p.fwd_s * scale, bwd_s=p.bwd_s * scale) for p in base.dispatch])

    runs = [[sweep(1.0), sweep(3.0)], [sweep(1.5), sweep(1.0)], [sweep(9.0), sweep(0.5)]]  # slowest: 3, 1.5, 9
    pooled = pooled_compute(base, runs)
    assert [p.time_s for p in pooled.matmul] == pytest.approx([3.0 * p.time_s for p in base.matmul])
    assert [p.time_s for p in pooled.membound] == pytest.approx([3.0 * p.time_s for p in base.membound])
    assert pooled.dispatch_fit.layer_fwd_s == pytest.approx(3.0 * base.dispatch_fit.layer_fwd_s)
    assert pooled.collectives == base.collectives
