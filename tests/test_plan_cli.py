"""`autopar plan` / `autopar explain`: summary, plan file, explain's tables, typed errors on bad input."""

import json

import pytest

from planner.cli import main
from planner.commands.explain import explain
from planner.commands.plan import summary
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
    assert main(["explain", str(f)]) == 1
    assert "not valid JSON" in capsys.readouterr().err
