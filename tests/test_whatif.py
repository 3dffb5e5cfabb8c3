"""What-if sweeps: parsing, errors, parallel == serial == one cluster alone, cache, Ctrl-C, costs."""

import math

import pytest

from _plans import standin_plan
from costmodel.errors import ConfigError, ProfileError
from costmodel.profiles import get_node_type
from planner.whatif import (
    cluster_cases,
    make_table,
    outcome_row,
    parse_axis,
    parse_sweep,
    plan_case,
    price_per_hour,
    run_whatif,
)

SWEEP = ["gpu=a100-80gb,h100", "nodes=1,2", "inter-node-gbps=200,400", "gpus-per-node=4,8"]
# Columns that say how a row was obtained rather than what it is.
_HOW = ["plan_time_s", "cached"]


def _same(t1, t2):
    import pandas.testing as pdt

    pdt.assert_frame_equal(t1.drop(columns=_HOW), t2.drop(columns=_HOW))


def test_sweep_is_the_cross_product_with_single_node_cases_once():
    cases = parse_sweep(SWEEP)
    # 2 gpus x 2 gpus-per-node x (1 node once + 2 nodes x 2 NIC rates)
    assert len(cases) == 2 * 2 * (1 + 2)
    labels = [c.label for c in cases]
    assert len(set(labels)) == len(labels)
    c = next(c for c in cases if c.label == "h100 2x8 nvlink 400Gb")
    assert c.cluster.num_devices == 16 and c.cluster.nodes == 2
    assert c.cluster.gpu.name == "H100-SXM5-80GB"
    assert c.cluster.groups[0].node.nic.gbps_per_direction == pytest.approx(50.0)  # 400 Gb/s = 50 GB/s
    assert all(math.isnan(c.axes["inter-node-gbps"]) for c in cases if c.axes["nodes"] == 1)


@pytest.mark.parametrize(
    "token, match",
    [
        ("nodes=", "has no values"),
        ("nodes=,", "has no values"),
        ("gpus=h100", "unknown sweep axis 'gpus'; known axes: gpu, nodes"),
        ("nodes", "no '='"),
        ("nodes=two", "must be ints"),
        ("nodes=0,2", "must be positive"),
        ("intra=infiniband", "allowed nvlink, pcie"),
    ],
)
def test_bad_axis_is_a_config_error(token, match):
    with pytest.raises(ConfigError, match=match):
        parse_axis(token)


def test_sweep_errors():
    with pytest.raises(ConfigError, match="needs a gpu axis"):
        parse_sweep(["nodes=1,2"])
    with pytest.raises(ConfigError, match="given twice"):
        parse_sweep(["gpu=h100", "gpu=a100-80gb"])
    with pytest.raises(ProfileError, match=r"unknown accelerator 'tpu-v5'.*; known: .*H100-SXM5-80GB"):
        parse_sweep(["gpu=h100,tpu-v5"])
    with pytest.raises(ProfileError, match=r"unknown node type 'dgx-z100' \(did you mean .*\); known: .*dgx-h100"):
        cluster_cases(["dgx-h100", "dgx-z100"])


def test_cli_usage_errors(capsys):
    from cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["whatif", "--model", "gpt2", "--global-batch", "8", "--sweep", "gpu=h100", "nodes="])
    assert e.value.code == 2
    assert "sweep axis 'nodes' has no values" in capsys.readouterr().err
    rc = main(["whatif", "--model", "gpt2", "--global-batch", "8", "--sweep", "gpu=z9000"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown accelerator 'z9000'" in err and "A100-SXM4-80GB" in err


def test_parallel_sweep_equals_serial_equals_each_alone():
    cases = parse_sweep(SWEEP)
    par = run_whatif("m", cases, global_batch=64, tokens=1e12, jobs=2, plan_fn=standin_plan)
    ser = run_whatif("m", cases, global_batch=64, tokens=1e12, jobs=1, plan_fn=standin_plan)
    alone = make_table([
        outcome_row(c, plan_case(model="m", cluster=c.cluster, global_batch=64, plan_fn=standin_plan), tokens=1e12)
        for c in cases
    ])
    _same(par.table, ser.table)
    _same(par.table, alone)
    assert list(par.table["cluster"]) == [c.label for c in cases]
    assert not par.interrupted


def test_infeasible_rows_stay_with_needed_memory():
    cases = parse_sweep(["gpu=h100", "gpus-per-node=4,8"])
    t = run_whatif("m", cases, global_batch=64, plan_fn=standin_plan).table
    bad = t[t["cluster"] == "h100 1x4 nvlink"].iloc[0]
    assert bad["status"] == "infeasible"
    assert bad["memory_gb_needed"] == pytest.approx(160.0)  # the error's memory_gb_needed, 640 GB / 4 devices
    assert math.isnan(bad["step_time_s"])
    assert (t["status"] == "ok").sum() == 1


def test_costs_follow_the_node_price():
    cases = parse_sweep(["gpu=h100,h200", "nodes=2"])
    t = run_whatif("m", cases, global_batch=64, tokens=2e12, plan_fn=standin_plan).table.set_index("cluster")
    h100 = t.loc["h100 2x8 nvlink 400Gb"]
    price = 16 * get_node_type("dgx-h100").price_per_gpu_hour  # the profiled H100 node's price
    assert h100["usd_per_hour"] == pytest.approx(price)
    assert h100["usd_per_mtok"] == pytest.approx(price / 3600 * 1e6 / h100["tokens_per_s"])
    assert h100["train_days"] == pytest.approx(2e12 / h100["tokens_per_s"] / 86400)
    assert h100["train_cost_usd"] == pytest.approx(h100["train_days"] * 24 * price)
    if get_node_type("dgx-h200").price_per_gpu_hour is None:
        assert math.isnan(t.loc["h200 2x8 nvlink 400Gb", "usd_per_mtok"])
    assert price_per_hour(cases[0].cluster) == pytest.approx(price)


def test_cache_replans_nothing_the_second_time(tmp_path):
    calls = []

    def counting(model, cluster, **kw):
        calls.append(cluster.name)
        return standin_plan(model, cluster, **kw)

    cases = parse_sweep(["gpu=a100-80gb,h100", "gpus-per-node=4,8"])
    first = run_whatif("m", cases, global_batch=64, cache_dir=tmp_path, plan_fn=counting)
    n = len(calls)
    assert n == len(cases)
    again = run_whatif("m", cases, global_batch=64, cache_dir=tmp_path, plan_fn=counting)
    assert len(calls) == n and again.table["cached"].all()
    _same(first.table, again.table)
    other = run_whatif("m", cases, global_batch=128, cache_dir=tmp_path, plan_fn=counting)
    assert len(calls) == 2 * n and not other.table["cached"].any()  # another batch is another key


@pytest.mark.parametrize("jobs", [1, 2])
def test_ctrl_c_keeps_finished_rows(jobs):
    cases = parse_sweep(SWEEP)

    def stop_after_two(done, total, row):
        if done == 2:
            raise KeyboardInterrupt

    r = run_whatif("m", cases, global_batch=64, jobs=jobs, plan_fn=standin_plan, on_result=stop_after_two)
    assert r.interrupted
    assert len(r.table) == 2
    assert set(r.table["cluster"]) <= {c.label for c in cases}


def test_no_clusters_is_an_error():
    with pytest.raises(ConfigError, match="no clusters"):
        run_whatif("m", [], global_batch=8, plan_fn=standin_plan)


def _without_timings(plan):
    from dataclasses import replace

    return replace(plan, solver=replace(plan.solver, time_per_phase_s={}))


def test_with_the_planner_sweep_equals_planning_each_cluster_alone():
    from _plans import gpt_workload
    from planner import plan_model

    model = gpt_workload(layers=8, hidden=1024, heads=16, seq=1024)
    cases = parse_sweep(["gpu=a100-80gb,h100", "gpus-per-node=4,8"])
    swept = run_whatif(model, cases, global_batch=32, tokens=1e10, jobs=2)
    assert (swept.table["status"] == "ok").all()
    for case in cases:
        alone = plan_model(model, case.cluster, global_batch=32)
        assert _without_timings(swept.plans[case.label]) == _without_timings(alone)
        row = swept.table.set_index("cluster").loc[case.label]
        assert row["step_time_s"] == alone.prediction.step_time_s
        assert (row["tp"], row["pp"], row["dp"]) == (alone.degrees.tp, alone.degrees.pp, alone.degrees.dp)
        assert row["schedule"] == alone.schedule.name and row["bottleneck"] == alone.prediction.bottleneck
        assert row["memory_gb"] == alone.prediction.memory_gb_per_device


@pytest.mark.slow
def test_traced_spec_sweep_forks_from_a_warm_trace_and_equals_alone():
    from planner import plan_model

    spec = "gpt:layers=2,hidden=128,heads=4,vocab=512,seq=128"
    cases = parse_sweep(["gpu=h100", "gpus-per-node=2,4"])
    swept = run_whatif(spec, cases, global_batch=8, jobs=2)
    for case in cases:
        alone = plan_model(spec, case.cluster, global_batch=8)
        assert _without_timings(swept.plans[case.label]) == _without_timings(alone)
        assert swept.plans[case.label].shardings  # the traced blocks reached the workers
