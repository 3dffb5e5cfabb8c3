"""Calibration: fits recover known parameters, save -> load round trip, validation, the calibrated cluster."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from costmodel.calibration import (
    CollectivePoint,
    MatmulFit,
    MatmulPoint,
    MemboundPoint,
    build_calibration,
    fit_collective,
    fit_matmul,
)
from cli.calibration_file import save_calibration
from costmodel.collectives import ring_terms
from costmodel.comm import Group, collective_time_s
from costmodel.compute import op_time_s
from costmodel.errors import ProfileError
from costmodel.profiles import PROFILES_DIR, load_calibration, resolve_cluster

TRUE_MATMUL = MatmulFit(dtype="fp32", peak_tflops=0.05, dim_half=16.0, flops_half=2e5)
SHAPES = ((64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (16, 512, 512), (512, 512, 8), (32, 1024, 256))
ALPHA_S, BUS_GBPS = 3e-4, 0.8


def _synthetic():
    matmul = tuple(
        MatmulPoint(m=m, n=n, k=k, dtype="fp32", time_s=2 * m * n * k / (TRUE_MATMUL.tflops(m, n, k) * 1e12))
        for m, n, k in SHAPES
    )
    membound = tuple(MemboundPoint(nbytes=float(b), time_s=b / 9e9) for b in (1 << 20, 1 << 25, 1 << 27))
    collectives = []
    for op in ("all_reduce", "all_gather", "send_recv"):
        for ranks in (2, 3, 4) if op != "send_recv" else (2,):
            for nbytes in (1e3, 1e5, 1e7):
                steps, factor = ring_terms(op, ranks)
                t = steps * ALPHA_S + factor * nbytes / (BUS_GBPS * 1e9)
                collectives.append(CollectivePoint(op=op, ranks=ranks, nbytes=nbytes, time_s=t))
    return build_calibration(
        device_name="Synthetic CPU (2 cores)", accelerator="cpu-local", date="2026-12-02T00:00:00+00:00",
        backend="gloo", memory_gb=16.0, matmul=matmul, membound=membound, collectives=tuple(collectives),
    )  # fmt: skip


def test_fits_recover_the_generating_parameters():
    cal = _synthetic()
    fit = fit_matmul(cal.matmul, "fp32")
    for m, n, k in SHAPES:
        assert fit.tflops(m, n, k) == pytest.approx(TRUE_MATMUL.tflops(m, n, k), rel=0.05)
    for op in ("all_reduce", "all_gather", "send_recv"):
        cfit = fit_collective(cal.collectives, op)
        assert cfit.latency_s == pytest.approx(ALPHA_S, rel=1e-6)
        assert cfit.bus_gbps == pytest.approx(BUS_GBPS, rel=1e-6)
    assert cal.membound_gbps == pytest.approx(9.0)  # the >= 32 MB points, not the cached 1 MB one


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_round_trip(tmp_path, suffix):
    cal = _synthetic()
    path = save_calibration(cal, tmp_path / f"cal{suffix}")
    assert load_calibration(path) == cal


def test_calibrated_local_cluster_uses_the_measured_rates(tmp_path):
    cal = _synthetic()
    path = save_calibration(cal, tmp_path / "cal.json")
    cluster = resolve_cluster("local", nodes=1, gpus_per_node=4, profile_path=path)
    assert cluster.calibration == cal
    cpu = cluster.gpu
    fit = cal.matmul_fit("fp32")
    assert cpu.tflops("fp32") == fit.peak_tflops and cpu.hbm_gbps == cal.membound_gbps
    assert cpu.memory_gb == 16.0
    m = n = k = 256
    t = op_time_s(flops=2 * m * n * k, bytes_moved=0, op_class="matmul", device=cpu, dtype="fp32",
                  shape=(m, n, k), calibration=cluster.calibration)  # fmt: skip
    assert math.isclose(t, 2 * m * n * k / (fit.tflops(m, n, k) * 1e12), rel_tol=1e-12)
    cost = collective_time_s("all_reduce", 1e6, Group(size=4), cluster)
    afit = cal.collective_fit("all_reduce")
    assert cost.algorithm == "calibrated"
    assert math.isclose(cost.time_s, 6 * afit.latency_s + 1.5 * 1e6 / (afit.bus_gbps * 1e9), rel_tol=1e-12)
    default = resolve_cluster("local", nodes=1, gpus_per_node=4)
    assert default.gpu.tflops("fp32") != cpu.tflops("fp32")


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


def test_bad_calibration_files(tmp_path):
    good = json.loads(save_calibration(_synthetic(), tmp_path / "good.json").read_text())
    missing = {k: v for k, v in good.items() if k != "membound_gbps"}
    with pytest.raises(ProfileError, match=r"bad\.json: missing key 'membound_gbps'"):
        load_calibration(_write(tmp_path, missing))
    negative = dict(good, collectives=[dict(good["collectives"][0], time_s=-1.0)] + good["collectives"][1:])
    with pytest.raises(ProfileError, match=r"bad\.json: collectives\[0\]: key 'time_s' = -1.0 must be > 0"):
        load_calibration(_write(tmp_path, negative))
    bad_op = dict(good, collectives=[dict(good["collectives"][0], op="allreduce")])
    with pytest.raises(ProfileError, match="'allreduce'; allowed: all_reduce, all_gather"):
        load_calibration(_write(tmp_path, bad_op))
    bad_backend = dict(good, backend="carrier-pigeon")
    with pytest.raises(ProfileError, match="allowed: gloo, nccl"):
        load_calibration(_write(tmp_path, bad_backend))
    (tmp_path / "syntax.json").write_text('{"device_name": "x",\n "date": }')
    with pytest.raises(ProfileError, match=r"syntax\.json: invalid JSON at line 2"):
        load_calibration(tmp_path / "syntax.json")
    (tmp_path / "syntax.toml").write_text('device_name = "x"\ndate = \n')
    with pytest.raises(ProfileError, match=r"syntax\.toml: invalid TOML: .*line 2"):
        load_calibration(tmp_path / "syntax.toml")
    with pytest.raises(ProfileError, match="autopar calibrate --out"):
        load_calibration(tmp_path / "missing.json")


def test_committed_calibrations_load():
    files = sorted((PROFILES_DIR / "calibration").glob("*.json"))
    assert files, "profiles/calibration/ should hold a calibration of the development machine"
    for path in files:
        cal = load_calibration(path)
        assert cal.matmul_fits and cal.collective_fits and cal.membound_gbps > 0
        assert cal.date[:4].isdigit() and cal.device_name


@pytest.mark.slow
@pytest.mark.distributed
def test_measure_collectives_on_two_gloo_ranks():  # ~10 s on an idle 2-core machine, a minute under load
    from runtime.measure.collectives import measure_collectives
    from runtime.measure.sweep import CalibrationPlan

    plan = CalibrationPlan(
        matmul_shapes=(), dtypes=(), membound_bytes=(), collective_bytes=(4096, 1 << 18), world_sizes=(2,),
        ops=("all_reduce", "send_recv"), collective_iters=2, collective_blocks=1,
    )  # fmt: skip
    ticks = []
    points = measure_collectives(plan, backend="gloo", world=2, progress=lambda: ticks.append(1))
    assert [(p.op, p.ranks) for p in points] == [("all_reduce", 2)] * 2 + [("send_recv", 2)] * 2
    assert all(p.time_s > 0 for p in points) and len(ticks) == 4
    assert points[1].nbytes == 1 << 18


@pytest.mark.slow
@pytest.mark.distributed
def test_measure_collectives_in_concurrent_halves_on_four_gloo_ranks():
    """4 gloo ranks, the quick plan's single world size: the ops also in the two 2-rank groups at once (points of
    2 ranks, send_recv only there); a plan that measures 2 ranks by itself keeps its own 2-rank points."""
    from runtime.measure.collectives import halves_measured, measure_collectives
    from runtime.measure.sweep import CalibrationPlan

    plan = CalibrationPlan(
        matmul_shapes=(), dtypes=(), membound_bytes=(), collective_bytes=(1 << 18,), world_sizes=(4,),
        ops=("all_gather", "send_recv"), collective_iters=2, collective_blocks=1,
    )  # fmt: skip
    assert halves_measured(plan, backend="gloo", world=4) == 2
    assert halves_measured(plan, backend="nccl", world=4) == 0
    assert halves_measured(dataclasses.replace(plan, world_sizes=(2, 3, 4)), backend="gloo", world=4) == 0
    assert halves_measured(plan, backend="gloo", world=2) == 0
    ticks = []
    points = measure_collectives(plan, backend="gloo", world=4, progress=lambda: ticks.append(1))
    assert [(p.op, p.ranks) for p in points] == [("all_gather", 4), ("all_gather", 2), ("send_recv", 2)]
    assert all(p.time_s > 0 for p in points) and len(ticks) == 3


def test_per_rank_count_fits_capture_oversubscription():
    # 4 ranks on a 2-core machine: every step costs 3x the latency of 2 ranks; the all-sizes ring fit cannot say that
    points = []
    for ranks, alpha in ((2, 1e-4), (3, 1e-4), (4, 3e-4)):
        for nbytes in (1e3, 1e5, 1e7):
            steps, factor = ring_terms("all_reduce", ranks)
            points.append(CollectivePoint(op="all_reduce", ranks=ranks, nbytes=nbytes, time_s=steps * alpha + factor * nbytes / 1e9))
    cal = build_calibration(
        device_name="Synthetic CPU", accelerator="cpu-local", date="2026-12-02T00:00:00+00:00", backend="gloo",
        memory_gb=16.0, matmul=_synthetic().matmul, membound=_synthetic().membound, collectives=tuple(points),
    )  # fmt: skip
    assert cal.collective_fit("all_reduce", 4).latency_s == pytest.approx(3e-4, rel=1e-6)
    assert cal.collective_fit("all_reduce", 2).latency_s == pytest.approx(1e-4, rel=1e-6)
    assert cal.collective_fit("all_reduce", 8).ranks == 0  # unmeasured size: the all-sizes fit
    from costmodel.profiles import make_cluster

    cluster = make_cluster("local", 1, gpus_per_node=4, calibration=cal)
    cost = collective_time_s("all_reduce", 1e5, Group(size=4), cluster)
    assert math.isclose(cost.time_s, 6 * 3e-4 + 1.5 * 1e5 / 1e9, rel_tol=1e-6)


@pytest.mark.slow
def test_autopar_calibrate_quick_writes_a_usable_profile(tmp_path, capsys):
    from cli.main import main

    out = tmp_path / "cal.toml"
    assert main(["calibrate", "--quick", "--out", str(out), "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    cal = load_calibration(out)
    assert cal.accelerator == "cpu-local" and cal.backend == "gloo" and cal.matmul_fit("fp32")
    assert {f.op for f in cal.collective_fits} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"}
    cluster = resolve_cluster("local", gpus_per_node=2, profile_path=out)
    assert cluster.gpu.tflops("fp32") == cal.matmul_fit("fp32").peak_tflops


def _dispatch_points(layer=(1e-3, 2e-3), model=(3e-3, 1e-3), tp_layer=(4e-3, 6e-3), tp_model=(5e-3, 2e-3)):
    from costmodel.calibration import DispatchPoint

    pts = []
    for tp, (lf, lb), (mf, mb) in ((False, layer, model), (True, tp_layer, tp_model)):
        pts += [DispatchPoint(layers=n, fwd_s=mf + n * lf, bwd_s=mb + n * lb, tensor_parallel=tp) for n in (1, 4, 6)]
    return tuple(pts)


def test_dispatch_fit_recovers_per_layer_and_fixed_time():
    from costmodel.calibration import fit_dispatch

    fit = fit_dispatch(_dispatch_points())
    assert (fit.layer_fwd_s, fit.layer_bwd_s, fit.model_fwd_s, fit.model_bwd_s) == pytest.approx((1e-3, 2e-3, 3e-3, 1e-3))
    assert (fit.tp_layer_fwd_s, fit.tp_layer_bwd_s, fit.tp_model_fwd_s, fit.tp_model_bwd_s) == pytest.approx(
        (4e-3, 6e-3, 5e-3, 2e-3))
    from costmodel.calibration import DispatchPoint

    with pytest.raises(ProfileError, match=">= 2 layer counts"):
        fit_dispatch([DispatchPoint(layers=2, fwd_s=1e-3, bwd_s=1e-3)])


def _with_dispatch(**kw):
    base = _synthetic()
    return build_calibration(
        device_name=base.device_name, accelerator=base.accelerator, date=base.date, backend=base.backend,
        memory_gb=base.memory_gb, matmul=base.matmul, membound=base.membound, collectives=base.collectives,
        dispatch=_dispatch_points(), **kw,
    )  # fmt: skip


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_round_trip_with_dispatch_and_cores(tmp_path, suffix):
    cal = _with_dispatch(cpu_cores=2, concurrent_ranks=4)
    assert cal.dispatch_fit is not None
    assert load_calibration(save_calibration(cal, tmp_path / f"cal{suffix}")) == cal


def test_ranks_beyond_the_cores_share_them():
    from costmodel.calibration import shared_by

    one = _with_dispatch(cpu_cores=2, concurrent_ranks=1)  # measured alone: 4 ranks get half a core each
    assert one.rank_share(2) == 1.0 and one.rank_share(4) == 0.5 and one.rank_share(8) == 0.25
    four = shared_by(one, 4)
    assert four.matmul_fit("fp32").peak_tflops == pytest.approx(0.5 * one.matmul_fit("fp32").peak_tflops)
    assert four.membound_gbps == pytest.approx(0.5 * one.membound_gbps)
    assert four.dispatch_fit.tp_layer_bwd_s == pytest.approx(2 * one.dispatch_fit.tp_layer_bwd_s)
    assert four.collective_fits == one.collective_fits  # measured with the ranks running
    together = _with_dispatch(cpu_cores=2, concurrent_ranks=4)  # measured with 4 at once: as measured for 4
    assert shared_by(together, 4) is together and together.rank_share(2) == 2.0
    assert shared_by(_synthetic(), 64) == _synthetic()  # cores not recorded: no sharing assumed


def test_dispatch_time_is_priced_per_layer_and_pass():
    from costmodel.analytic import closed_form_priced
    from costmodel.compute import dispatch_time_s
    from costmodel.profiles import make_cluster
    from costmodel.step import ParallelConfig, estimate_step
    from costmodel.workload import LayerWork, Workload

    plain, with_dispatch = _synthetic(), _with_dispatch()
    cpu = make_cluster("local", 1, gpus_per_node=2, calibration=with_dispatch).gpu
    assert dispatch_time_s(part="layer", device=cpu, calibration=with_dispatch) == pytest.approx((1e-3, 2e-3))
    assert dispatch_time_s(part="layer", device=cpu, calibration=with_dispatch, tensor_parallel=True) == pytest.approx(
        (4e-3, 6e-3))
    assert dispatch_time_s(part="model", device=cpu, calibration=plain) == (0.0, 0.0)
    h, s, v = 64, 16, 128
    layers = (LayerWork(name="embedding", kind="embedding", params=v * h, flops_fwd=0.0, flops_bwd=0.0),) + tuple(
        LayerWork(name=f"layers.{i}", kind="transformer", params=12 * h * h, flops_fwd=24.0 * s * h * h,
                  flops_bwd=48.0 * s * h * h) for i in range(3)) + (
        LayerWork(name="head", kind="head", params=v * h, flops_fwd=2.0 * s * h * v, flops_bwd=4.0 * s * h * v),)
    wl = closed_form_priced(Workload(name="tiny", layers=layers, hidden=h, heads=2, kv_heads=2, ffn_hidden=4 * h,
                                     vocab=v, seq=s, num_layers=3))
    cfg = ParallelConfig(tp=1, pp=1, dp=2, microbatch=1, global_batch=4)  # 2 micro-batches per rank
    times = [estimate_step(wl, cfg, make_cluster("local", 1, gpus_per_node=2, calibration=c)).breakdown_s["compute"]
             for c in (plain, with_dispatch)]
    per_microbatch = 3 * (1e-3 + 2e-3) + (3e-3 + 1e-3)  # 3 layers' forward + backward, the model's rest
    assert times[1] - times[0] == pytest.approx(2 * per_microbatch, rel=1e-6)


def test_busy_cpu_ranks_do_not_hide_gradient_traffic(tmp_path):
    """4 ranks on 2 recorded cores: no idle core runs gloo's collectives beside the compute, so the gradient
    all-reduce is exposed whole; with the cores not recorded (an accelerator) the part before the last 25 MB
    bucket hides behind the backward (a 100 MB gradient here)."""
    import dataclasses

    from costmodel.analytic import llama_workload
    from costmodel.step import ParallelConfig, estimate_step

    w = llama_workload(layers=4, hidden=1024, ffn_hidden=4096, heads=8, kv_heads=8, vocab=1024, seq=64)
    cfg = ParallelConfig(dp=4, microbatch=2, global_batch=8)
    comm = lambda e: sum(v for k, v in e.breakdown_s.items() if k.startswith("comm_"))  # noqa: E731
    exposed = {}
    for cores in (2, 0):
        cal = dataclasses.replace(_synthetic(), cpu_cores=cores, concurrent_ranks=4)
        assert cal.overlaps_communication(4) == (cores == 0)
        path = save_calibration(cal, tmp_path / f"cal{cores}.json")
        cluster = resolve_cluster("local", nodes=1, gpus_per_node=4, profile_path=path)
        exposed[cores] = comm(estimate_step(w, cfg, cluster))
    assert exposed[2] > exposed[0] > 0


def test_pipeline_bubble_runs_on_the_cores_idle_stages_leave(tmp_path):
    """4 ranks on 2 recorded cores, pp2 x dp2: in the fill and drain half the ranks wait and the busy half gets a
    whole core each, so the bubble takes half its all-busy time (``costmodel.step.bubble_rate_factor``); with
    the cores not recorded (accelerators) or enough of them, the bubble is the schedule's own."""
    import dataclasses

    from costmodel.analytic import llama_workload
    from costmodel.profiles import make_cluster
    from costmodel.step import ParallelConfig, bubble_rate_factor, estimate_step

    w = llama_workload(layers=4, hidden=256, ffn_hidden=512, heads=4, kv_heads=4, vocab=1024, seq=64)
    cfg = ParallelConfig(pp=2, dp=2, microbatch=1, global_batch=4, schedule="1f1b")
    got = {}
    for cores in (2, 0, 8):
        cal = dataclasses.replace(_synthetic(), cpu_cores=cores, concurrent_ranks=4)
        cluster = resolve_cluster("local", nodes=1, gpus_per_node=4,
                                  profile_path=save_calibration(cal, tmp_path / f"cal{cores}.json"))
        got[cores] = (bubble_rate_factor(cluster, 2), estimate_step(w, cfg, cluster).breakdown_s["bubble"])
    assert got[2][0] == pytest.approx(0.5) and got[0][0] == 1.0 and got[8][0] == 1.0
    assert got[2][1] == pytest.approx(0.5 * got[0][1], rel=1e-6) and got[8][1] == pytest.approx(got[0][1], rel=1e-6)
    four = make_cluster("local", 1, gpus_per_node=4,
                        calibration=dataclasses.replace(_synthetic(), cpu_cores=2, concurrent_ranks=4))
    # pp=4 on 4 ranks, 2 cores: slots with 1, 2, 3 busy ranks run at 2x, 2x, 1.5x the all-busy rate
    assert bubble_rate_factor(four, 4) == pytest.approx((0.5 + 0.5 + 0.75) / 3)


def _fsdp_points(unit_s=5e-3):
    """``_dispatch_points`` plus FSDP2 points: the plain time and ``unit_s`` per unit (n layers and the root),
    split 1:2 over forward and backward."""
    from costmodel.calibration import DispatchPoint

    plain = [p for p in _dispatch_points() if not p.tensor_parallel]
    return _dispatch_points() + tuple(
        DispatchPoint(layers=p.layers, fwd_s=p.fwd_s + (p.layers + 1) * unit_s / 3,
                      bwd_s=p.bwd_s + (p.layers + 1) * unit_s * 2 / 3, fsdp=True) for p in plain)


def test_fsdp_unit_time_is_fitted_and_priced_per_unit_and_microbatch(tmp_path):
    """The FSDP2 points' excess over the plain ones is ``fsdp_unit_s`` per unit (``fit_fsdp_unit``); the plain
    fit ignores them; a ZeRO-3 step on CPU ranks pays it per unit (3 layers and the root) and micro-batch, a
    ZeRO-0 (DDP) step not at all; a calibration file round-trips it."""
    from costmodel.analytic import llama_workload
    from costmodel.calibration import fit_dispatch
    from costmodel.step import ParallelConfig, estimate_step

    fit = fit_dispatch(_fsdp_points())
    assert fit.fsdp_unit_s == pytest.approx(5e-3)
    assert (fit.layer_fwd_s, fit.layer_bwd_s, fit.model_fwd_s, fit.model_bwd_s) == pytest.approx((1e-3, 2e-3, 3e-3, 1e-3))
    assert fit_dispatch(_dispatch_points()).fsdp_unit_s == 0.0
    base = _synthetic()
    cals = {}
    for name, pts in (("with", _fsdp_points()), ("without", _dispatch_points())):
        cal = build_calibration(device_name=base.device_name, accelerator=base.accelerator, date=base.date,
                                backend=base.backend, memory_gb=base.memory_gb, matmul=base.matmul,
                                membound=base.membound, collectives=base.collectives, dispatch=pts)
        cals[name] = save_calibration(cal, tmp_path / f"{name}.json")
        assert load_calibration(cals[name]) == cal
    w = llama_workload(layers=3, hidden=256, ffn_hidden=512, heads=4, kv_heads=4, vocab=1024, seq=64)
    for zero, extra in ((3, 4 * 2 * 5e-3), (2, 4 * 2 * 5e-3), (0, 0.0)):
        cfg = ParallelConfig(dp=2, microbatch=1, global_batch=4, zero_stage=zero)  # 2 micro-batches per rank
        t = {name: estimate_step(w, cfg, resolve_cluster("local", nodes=1, gpus_per_node=2, profile_path=path))
             for name, path in cals.items()}
        assert t["with"].step_time_s - t["without"].step_time_s == pytest.approx(extra, rel=1e-6, abs=1e-12)


def test_sequence_parallel_dispatch_has_its_own_fit():
    """Points measured under tensor + sequence parallelism fit their own per-layer and fixed times; a layer under
    sp prices them, one under tp alone the tensor-parallel ones, and a calibration without sp points falls back
    to the tensor-parallel fit."""
    from costmodel.calibration import DispatchPoint, fit_dispatch
    from costmodel.compute import dispatch_time_s
    from costmodel.profiles import make_cluster

    sp = tuple(DispatchPoint(layers=n, fwd_s=7e-3 + n * 5e-3, bwd_s=3e-3 + n * 8e-3, tensor_parallel=True,
                             sequence_parallel=True) for n in (1, 6))
    fit = fit_dispatch(_dispatch_points() + sp)
    assert (fit.sp_layer_fwd_s, fit.sp_layer_bwd_s, fit.sp_model_fwd_s, fit.sp_model_bwd_s) == pytest.approx(
        (5e-3, 8e-3, 7e-3, 3e-3))
    assert (fit.tp_layer_fwd_s, fit.tp_layer_bwd_s) == pytest.approx((4e-3, 6e-3))  # sp points kept out
    with_sp, without = _with_dispatch(), None
    base = _synthetic()
    with_sp = build_calibration(device_name=base.device_name, accelerator=base.accelerator, date=base.date,
                                backend=base.backend, memory_gb=base.memory_gb, matmul=base.matmul,
                                membound=base.membound, collectives=base.collectives, dispatch=_dispatch_points() + sp)
    without = _with_dispatch()
    cpu = make_cluster("local", 1, gpus_per_node=2, calibration=with_sp).gpu
    kw = dict(part="layer", device=cpu, tensor_parallel=True)
    assert dispatch_time_s(calibration=with_sp, sequence_parallel=True, **kw) == pytest.approx((5e-3, 8e-3))
    assert dispatch_time_s(calibration=with_sp, **kw) == pytest.approx((4e-3, 6e-3))
    assert dispatch_time_s(calibration=without, sequence_parallel=True, **kw) == pytest.approx((4e-3, 6e-3))
    assert dispatch_time_s(part="model", device=cpu, calibration=with_sp, tensor_parallel=True,
                           sequence_parallel=True) == pytest.approx((7e-3, 3e-3))
