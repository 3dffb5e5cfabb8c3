"""Plan file: JSON round trip, schema matches dataclasses, bad files rejected with clear errors."""

import json

import pytest

from costmodel.errors import PlanMismatchError
from planner.plan import (
    ClusterInfo,
    MeshSpec,
    ModelInfo,
    ModuleSharding,
    ParallelDegrees,
    Plan,
    Prediction,
    ScheduleSpec,
    StagePlan,
    _SCHEMA_PATH,
    check_plan_matches,
    load_plan,
    model_fingerprint,
    plan_json_schema,
    save_plan,
)


def _plan(**over):
    d = over.pop("degrees", ParallelDegrees(tp=2, pp=2, dp=1))
    kw = dict(
        model=ModelInfo(name="tiny", fingerprint="sha256:ab", params=10, flops_per_step=1e9, num_layers=2, seq_len=8),
        cluster=ClusterInfo(name="local", num_devices=4, nodes=1, gpus_per_node=4, gpu="cpu"),
        degrees=d,
        mesh=MeshSpec.from_degrees(d),
        stages=(
            StagePlan(index=0, pp_rank=0, modules=("embed", "layers.0"), ranks=(0, 1), recompute="full"),
            StagePlan(index=1, pp_rank=1, modules=("layers.1", "head"), ranks=(2, 3)),
        ),
        shardings=(ModuleSharding(fqn="layers.0.q", style="colwise"),),
        schedule=ScheduleSpec(name="1f1b", microbatch_size=2, num_microbatches=4),
        global_batch=8,
        prediction=Prediction(
            step_time_s=0.5, tokens_per_s=128.0, model_tflops_per_gpu=1.0, hw_tflops_per_gpu=1.3, mfu=0.4,
            memory_gb_per_device=3.0, fits=True, breakdown_s={"compute": 0.4, "bubble": 0.1},
        ),
    )
    kw.update(over)
    return Plan(**kw)


def test_round_trip_is_exact_and_canonical(tmp_path):
    p = _plan()
    save_plan(p, tmp_path / "p.json")
    q = load_plan(tmp_path / "p.json")
    assert q == p
    assert q.to_json() == p.to_json()


def test_committed_schema_matches_dataclasses():
    assert json.loads(_SCHEMA_PATH.read_text()) == plan_json_schema()


def test_bad_json_names_file_and_line(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('{"schema_version": 1,\n')
    with pytest.raises(PlanMismatchError, match=r"bad.json: not valid JSON \(line 2"):
        load_plan(f)


def test_schema_violation_names_field(tmp_path):
    d = _plan().to_dict()
    d["degrees"]["tp"] = "eight"
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanMismatchError, match="degrees/tp"):
        load_plan(f)


def test_wrong_version_says_replan():
    d = _plan().to_dict()
    d["schema_version"] = 99
    with pytest.raises(PlanMismatchError, match="schema_version=99"):
        Plan.from_dict(d)


def test_inconsistent_batch_rejected():
    d = _plan().to_dict()
    d["global_batch"] = 9
    with pytest.raises(PlanMismatchError, match="global_batch=9"):
        Plan.from_dict(d)


def test_fingerprint_and_world_size_checked():
    fp = model_fingerprint([("w", (2, 3), "torch.float32")])
    assert fp != model_fingerprint([("w", (3, 2), "torch.float32")])
    p = _plan(model=ModelInfo(name="tiny", fingerprint=fp, params=6, flops_per_step=1.0, num_layers=2, seq_len=8))
    check_plan_matches(p, fingerprint=fp, world_size=4)
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        check_plan_matches(p, fingerprint="sha256:other", world_size=4)
    with pytest.raises(PlanMismatchError, match="world size 4"):
        check_plan_matches(p, fingerprint=fp, world_size=2)
