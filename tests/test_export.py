"""Export of plans to Megatron-LM flags, torchtitan TOML and DeepSpeed JSON; plan diff."""

import json
import re
import tomllib

import pytest

from _plans import make_plan
from costmodel.errors import ConfigError
from planner.diff import diff_plans, format_diff
from planner.export import export_plan, layers_per_stage


def _megatron_flags(text: str) -> dict[str, str | bool]:
    flags: dict[str, str | bool] = {}
    for m in re.finditer(r"(--[a-z0-9-]+)(?: ([^\s\\-][^\s\\]*))?", text):
        flags[m.group(1)] = m.group(2) if m.group(2) is not None else True
    return flags


@pytest.mark.parametrize(
    "kw",
    [
        dict(tp=2, pp=4, dp=2, zero_stage=1, recompute="selective"),
        dict(tp=8, pp=2, dp=1, virtual_stages=2, schedule="interleaved-1f1b", num_microbatches=4,
             recompute="full", sequence_parallel=True, microbatch=2),
        dict(tp=1, pp=1, dp=16, zero_stage=0, recompute="none", sequence_parallel=False, num_microbatches=2),
    ],
)
def test_megatron_flags_match_the_plan(kw):
    plan = make_plan(**kw)
    res = export_plan(plan, "megatron")
    f = _megatron_flags(res.text)
    d, s = plan.degrees, plan.schedule
    assert f["--tensor-model-parallel-size"] == str(d.tp)
    assert f["--pipeline-model-parallel-size"] == str(d.pp)
    assert f["--micro-batch-size"] == str(s.microbatch_size)
    assert f["--global-batch-size"] == str(plan.global_batch)
    assert f["--num-layers"] == str(sum(layers_per_stage(plan)))
    assert f["--seq-length"] == str(plan.model.seq_len)
    assert ("--sequence-parallel" in f) == plan.sequence_parallel
    # Megatron derives dp = world / (tp * pp * cp): the flags must give the plan's dp on its world size
    cp = int(f.get("--context-parallel-size", 1))
    assert plan.cluster.num_devices // (d.tp * d.pp * cp) == d.dp
    if s.virtual_stages > 1:
        assert int(f["--num-layers-per-virtual-pipeline-stage"]) * d.pp * s.virtual_stages == plan.model.num_layers
    else:
        assert "--num-layers-per-virtual-pipeline-stage" not in f
    rec = plan.stages[0].recompute
    assert f.get("--recompute-granularity", "none") == rec
    assert ("--use-distributed-optimizer" in f) == (plan.zero_stage in (1, 2))


def test_megatron_uneven_cuts_and_what_it_cannot_express():
    plan = make_plan(tp=2, pp=4, dp=2, cuts=(3, 5, 5, 3))
    f = _megatron_flags(export_plan(plan, "megatron").text)
    assert f["--decoder-first-pipeline-num-layers"] == "3" and f["--decoder-last-pipeline-num-layers"] == "3"
    odd = make_plan(tp=2, pp=4, dp=2, cuts=(3, 4, 6, 3))
    res = export_plan(odd, "megatron")
    assert any("uneven stage cuts [3, 4, 6, 3]" in n for n in res.unsupported)
    zb = export_plan(make_plan(schedule="zero-bubble"), "megatron")
    assert any("zero-bubble" in n for n in zb.unsupported)


def test_torchtitan_toml_parses_and_matches():
    plan = make_plan(tp=4, pp=2, dp=2, virtual_stages=2, schedule="interleaved-1f1b", zero_stage=3,
                     recompute="selective", cuts=(5, 3, 4, 4))
    res = export_plan(plan, "torchtitan")
    cfg = tomllib.loads(res.text)
    par = cfg["parallelism"]
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"]) == (4, 2)
    assert par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"] == 2
    assert par["data_parallel_shard_degree"] == 2  # ZeRO-3 = FSDP
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert par["pipeline_parallel_split_points"] == ["layers.5", "layers.8", "layers.12"]
    assert cfg["activation_checkpoint"]["mode"] == "selective"
    assert cfg["training"]["global_batch_size"] == plan.global_batch
    assert cfg["training"]["local_batch_size"] * 2 == plan.global_batch


def test_deepspeed_json_and_unsupported():
    plan = make_plan(tp=2, pp=4, dp=2, zero_stage=2)
    res = export_plan(plan, "deepspeed")
    cfg = json.loads(res.text)
    assert cfg["zero_optimization"]["stage"] == 2
    s = plan.schedule
    assert cfg["train_batch_size"] == s.microbatch_size * s.num_microbatches * plan.degrees.dp
    assert cfg["gradient_accumulation_steps"] == s.num_microbatches
    assert cfg["tensor_parallel"]["autotp_size"] == 2
    assert any("pp=4" in n for n in res.unsupported)


def test_unknown_target():
    with pytest.raises(ConfigError, match="megatron, torchtitan, deepspeed"):
        export_plan(make_plan(), "jax")


def test_diff_lists_changes_and_effect():
    a = make_plan(step_time_s=2.0)
    b = make_plan(tp=4, pp=2, step_time_s=1.5)
    d = diff_plans(a, b)
    fields = {c.field for c in d.changes}
    assert {"degrees", "layers_per_stage"} <= fields and "schedule" not in fields
    step = d.effects[0]
    assert step.metric == "step_time" and step.ratio == pytest.approx(0.75)
    assert "25.0% faster" in d.summary()
    assert "degrees" in format_diff(d)
    assert diff_plans(a, a).identical


def test_export_and_diff_commands(tmp_path, capsys):
    from cli.main import main
    from planner.plan import save_plan

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save_plan(make_plan(schedule="zero-bubble"), a)
    save_plan(make_plan(tp=4, pp=2, step_time_s=1.0), b)
    assert main(["export", str(a), "--to", "megatron"]) == 0
    out, err = capsys.readouterr()
    assert "--tensor-model-parallel-size 2" in out and "not expressible in megatron: schedule zero-bubble" in err
    assert main(["export", str(a), "--to", "deepspeed", "--out", str(tmp_path / "ds.json")]) == 0
    assert json.loads((tmp_path / "ds.json").read_text())["zero_optimization"]["stage"] == 1
    capsys.readouterr()
    assert main(["diff", str(a), str(b)]) == 1  # the plans differ, as diff(1) exits
    out = capsys.readouterr().out
    assert "tp=2 cp=1 pp=4" in out and "50.0% faster" in out
    (tmp_path / "bad.json").write_text("{")
    assert main(["export", str(tmp_path / "bad.json"), "--to", "megatron"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
