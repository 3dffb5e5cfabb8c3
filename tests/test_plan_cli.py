"""`autopar plan` / `autopar explain`: summary, plan file, explain's tables, typed errors on bad input."""

import json

import pytest

from cli.main import main
from cli.commands.explain import explain
from cli.commands.plan import summary
from planner.plan import (
    Alternative, ClusterInfo, MeshSpec, ModelInfo, ParallelDegrees, Plan, Prediction, ScheduleSpec, SolverStats,
    StagePlan, save_plan,
)


def _hand_plan():
    d = ParallelDegrees(tp=2, pp=2, dp=1)
    return Plan(
        model=ModelInfo(name="tiny", fingerprint="sha256:ab", params=10**9, flops_per_step=1e15, num_layers=2,
                        seq_len=8),
        cluster=ClusterInfo(name="1xlocal", num_devices=4, nodes=1, gpus_per_node=4, gpu="cpu"),
        degrees=d, mesh=MeshSpec.from_degrees(d),
        stages=(StagePlan(index=0, pp_rank=0, modules=("embedding", "layers.0"), ranks=(0, 1), recompute="full",
                          gpu="cpu", predicted_time_s=0.012, predicted_memory_gb=3.5),
                StagePlan(index=1, pp_rank=1, modules=("layers.1", "head"), ranks=(2, 3), recompute="full",
                          gpu="cpu", predicted_time_s=0.011, predicted_memory_gb=2.5)),
        schedule=ScheduleSpec(name="1f1b", microbatch_size=2, num_microbatches=4),
        global_batch=8,
        prediction=Prediction(step_time_s=0.5, tokens_per_s=128.0, model_tflops_per_gpu=1.0, hw_tflops_per_gpu=1.3,
                              mfu=0.4, memory_gb_per_device=3.5, fits=True,
                              breakdown_s={"compute": 0.4, "bubble": 0.075, "comm_nvlink": 0.025},
                              memory_breakdown_gb={"weights": 1.0, "activations": 2.5}, bottleneck="compute"),
        solver=SolverStats(status="optimal", objective=0.5, bound=0.5, candidates_explored=7),
        alternatives=(Alternative(summary="tp=4 pp=1 dp=1 mb=2 m=4 1f1b", step_time_s=0.6, memory_gb_per_device=5.0,
                                  fits=True),),
    )


def test_explain_shows_stages_time_and_alternatives(tmp_path, capsys):
    f = tmp_path / "p.json"
    save_plan(_hand_plan(), f)
    assert main(["explain", str(f)]) == 0
    out = capsys.readouterr().out
    assert "embedding, layers.0" in out and "0-1" in out and "12.00" in out  # modules, ranks, ms per micro-batch
    assert "compute" in out and "80.0%" in out  # 0.4 of 0.5 s
    assert "+20.0%" in out and "tp=4 pp=1" in out  # the alternative, 0.6 s vs 0.5 s
    assert "bottleneck: compute" in out


def test_summary_has_degrees_schedule_throughput_memory():
    text = summary(_hand_plan())
    for piece in ("tp=2 pp=2 dp=1", "1f1b", "micro-batch 2 x 4", "0.5 s", "tokens/s 128", "MFU 40.0%",
                  "3.5 GB per device", "bottleneck  compute", "optimal"):
        assert piece in text, piece


def test_explain_bad_file_is_a_typed_error(tmp_path, capsys):
    f = tmp_path / "bad.json"
    f.write_text("{")
    assert main(["explain", str(f)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


TINY = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32"


def test_plan_writes_a_valid_plan_and_summary(tmp_path, capsys):
    from planner.plan import load_plan

    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", TINY, "--cluster", "dgx-a100-80gb", "--gpus-per-node", "4", "--global-batch", "8",
               "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    plan = load_plan(out)  # schema-validated
    assert plan.cluster.num_devices == 4 and plan.degrees.world_size == 4
    assert plan.solver.status == "optimal" and plan.solver.candidates_explored > 0
    assert set(plan.solver.time_per_phase_s) >= {"trace", "enumerate", "explore", "cuts", "intra_op"}
    mods = [m for s in plan.stages for m in s.modules]
    assert mods[0].endswith("embed_tokens") and "lm_head" in mods  # real FQNs, the groups expanded
    assert "step time" in cap.out and "tokens/s" in cap.out and f"wrote {out}" in cap.out
    assert "autopar plan: explored" in cap.err  # progress on stderr


def test_plan_json_fix_and_reproducible_output(capsys):
    args = ["plan", "--model", TINY, "--cluster", "dgx-a100-80gb", "--gpus-per-node", "4", "--global-batch", "8",
            "--fix", "tp=2,pp=2,mb=1", "--json", "--reproducible"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    second = capsys.readouterr().out
    assert first == second  # byte-identical
    d = json.loads(first)
    assert (d["degrees"]["tp"], d["degrees"]["pp"], d["schedule"]["microbatch_size"]) == (2, 2, 1)
    assert d["solver"]["time_per_phase_s"] == {}


def test_plan_bad_batch_names_nearest_valid_values(capsys):
    rc = main(["plan", "--model", TINY, "--cluster", "dgx-a100-80gb", "--gpus-per-node", "4", "--global-batch", "7",
               "--fix", "tp=1,pp=1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "global_batch=7" in err and "nearest valid global batches: [8, 4]" in err


def test_plan_model_that_fits_nowhere_says_what_it_needs():
    from costmodel.errors import InfeasiblePlanError
    from costmodel.profiles import make_cluster
    from costmodel.analytic import gpt_workload
    from planner.plan import ModelInfo
    from planner.search.driver import plan_model

    wl = gpt_workload(layers=8, hidden=16384, heads=128, name="too-big")  # 26B parameters on 2 x 80 GB
    info = ModelInfo(name="too-big", fingerprint="", params=wl.params, flops_per_step=0.0, num_layers=8,
                     seq_len=2048)
    with pytest.raises(InfeasiblePlanError) as e:
        plan_model((wl, info), make_cluster("dgx-a100-80gb", 1, gpus_per_node=2), global_batch=8)
    msg = str(e.value)
    assert "GB per device" in msg and "ZeRO-3" in msg and "devices" in msg
