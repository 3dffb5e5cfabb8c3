"""Exports: Megatron-LM flags checked against its argument parser's names, torchtitan 0.3.0 jobs loaded by its
ConfigManager, DeepSpeed configs loaded by DeepSpeedConfig; refusals and memory checks per target; plan diff."""

import importlib.util
import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from _plans import make_plan
from costmodel.errors import ConfigError, InfeasiblePlanError
from costmodel.targets import load_target
from planner.diff import diff_plans, format_diff
from planner.export import export_plan
from planner.export_check import check_memory, layers_per_stage, layer_params, rank_params
from planner.export_writers import deepspeed_config, megatron_args, torchtitan_settings
from planner.models import build_model, model_dims

LLAMA = "llama:layers=16,hidden=2048,ffn=5632,heads=16,kv_heads=4,vocab=32000,seq=4096"
MIXTRAL = "mixtral:layers=16,hidden=1024,ffn=2816,heads=16,kv_heads=4,vocab=32000,seq=4096,experts=8,topk=2"
GPT = "gpt:layers=16,hidden=2048,heads=16,vocab=51200,seq=4096"
FLAGS = Path(__file__).parent / "data" / "megatron_arguments_flags.txt"


def plan_for(spec: str, **kw):
    """make_plan's plan for the model ``spec`` (its name and parameter count), and the model's dims."""
    dims = model_dims(spec)
    plan = make_plan(layers=dims.layers, **kw)
    params = sum(p.numel() for p in build_model(spec).model.parameters())
    return replace(plan, model=replace(plan.model, name=spec, params=params, seq_len=dims.seq)), dims


def flag_values(args: list[str]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else "--"
            out[a] = True if nxt.startswith("--") else nxt
    return out


# --- Megatron-LM ------------------------------------------------------------------------------------------


MEGATRON_CASES = [
    (LLAMA, dict(tp=2, pp=4, dp=2, zero_stage=1, recompute="selective")),
    (LLAMA, dict(tp=4, pp=2, dp=2, virtual_stages=2, schedule="interleaved-1f1b", recompute="full", cuts=(3, 5, 4, 4))),
    (LLAMA, dict(tp=2, pp=1, dp=8, cp=1, zero_stage=3, recompute="none", sequence_parallel=False, num_microbatches=2)),
    (MIXTRAL, dict(tp=2, pp=2, dp=4, ep=4, zero_stage=1, recompute="full")),
    (GPT, dict(tp=8, pp=2, dp=1, zero_stage=0, recompute="full", num_microbatches=4)),
]


@pytest.mark.parametrize("spec, kw", MEGATRON_CASES)
def test_megatron_flags_exist_in_megatron_and_match_the_plan(spec, kw):
    plan, dims = plan_for(spec, memory_gb=20.0, **kw)
    known = {line for line in FLAGS.read_text().split() if line.startswith("--")}
    args, _ = megatron_args(plan, dims)
    unknown = [a for a in args if a.startswith("--") and a not in known]
    assert not unknown, f"not Megatron-LM arguments.py flags: {unknown}"
    f = flag_values(args)
    d, s = plan.degrees, plan.schedule
    assert (f["--tensor-model-parallel-size"], f["--pipeline-model-parallel-size"]) == (str(d.tp), str(d.pp))
    assert f["--micro-batch-size"] == str(s.microbatch_size) and f["--global-batch-size"] == str(plan.global_batch)
    # Megatron derives dp = world / (tp * pp * cp) and the micro-batch count = global / (micro * dp)
    assert plan.cluster.num_devices // (d.tp * d.pp * int(f.get("--context-parallel-size", 1))) == d.dp
    assert plan.global_batch // (s.microbatch_size * d.dp) == s.num_microbatches
    assert (f["--num-layers"], f["--hidden-size"], f["--ffn-hidden-size"]) == (
        str(dims.layers), str(dims.hidden), str(dims.ffn_hidden))
    assert f["--num-attention-heads"] == str(dims.heads) and f["--vocab-size"] == str(dims.vocab)
    assert ("--swiglu" in f) == ("--normalization" in f) == dims.glu
    assert ("--untie-embeddings-and-output-weights" in f) == (not dims.tied_embeddings)
    assert f.get("--num-query-groups", str(dims.heads)) == str(dims.kv_heads)
    assert f.get("--num-experts", "0") == str(dims.experts)
    assert f.get("--expert-model-parallel-size", "1") == str(d.ep)
    assert ("--sequence-parallel" in f) == plan.sequence_parallel
    assert f.get("--recompute-granularity", "none") == plan.stages[0].recompute
    assert ("--use-distributed-optimizer" in f) == (plan.zero_stage in (1, 2))
    assert ("--use-torch-fsdp2" in f) == (plan.zero_stage == 3)
    assert ("--overlap-grad-reduce" in f) == (d.dp * d.cp > 1 and plan.zero_stage < 3)


def test_megatron_options_the_plan_was_priced_with_become_flags():
    """A plan priced for ``megatron:cuda-graphs:moe-a2a-overlap:fused-grouped-mlp:fp8-attention`` exports the
    flags of each option (every one a Megatron-LM argument) and a note for fp8 attention, which has none."""
    plan, dims = plan_for(MIXTRAL, memory_gb=20.0, tp=2, pp=2, dp=4, ep=4, zero_stage=1, recompute="full")
    known = {line for line in FLAGS.read_text().split() if line.startswith("--")}
    base, base_notes = megatron_args(replace(plan, target="megatron"), dims)
    spec = "megatron:cuda-graphs:moe-a2a-overlap:fused-grouped-mlp:fp8-attention"
    args, notes = megatron_args(replace(plan, target=spec), dims)
    added = [a for a in args if a not in base]
    assert set(base) <= set(args)
    f = flag_values(args)
    assert f["--cuda-graph-impl"] == "local" and f["--cuda-graph-scope"] == "full_iteration"
    assert {"--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--use-transformer-engine-op-fuser"} <= set(args)
    assert f["--moe-mlp-glu-interleave-size"] == "32"
    assert added and not [a for a in added if a.startswith("--") and a not in known]
    assert [n for n in notes if "fp8-attention" in n and "no flag" in n]
    assert not [n for n in base_notes if "option" in n]


def test_megatron_uneven_cuts_become_a_pipeline_layout():
    plan, dims = plan_for(LLAMA, tp=2, pp=4, dp=2, virtual_stages=2, schedule="interleaved-1f1b",
                          cuts=(3, 1, 2, 2, 2, 2, 2, 2), memory_gb=20.0)
    f = flag_values(megatron_args(plan, dims)[0])
    layout = f["--pipeline-model-parallel-layout"]
    assert layout.startswith("E") and layout.endswith("L")
    assert [int(p.strip("EL").split("*")[1]) for p in layout.split("|")] == [3, 1, 2, 2, 2, 2, 2, 2]
    assert "--num-virtual-stages-per-pipeline-rank" not in f  # one of the three, never two
    even, dims = plan_for(LLAMA, tp=2, pp=4, dp=2, virtual_stages=2, schedule="interleaved-1f1b", memory_gb=20.0)
    f = flag_values(megatron_args(even, dims)[0])
    assert f["--num-virtual-stages-per-pipeline-rank"] == "2" and "--pipeline-model-parallel-layout" not in f


def test_megatron_per_chunk_recompute_counts():
    plan, dims = plan_for(LLAMA, tp=2, pp=2, dp=4, recompute="full", memory_gb=20.0)
    f = flag_values(megatron_args(plan, dims)[0])
    assert (f["--recompute-method"], f["--recompute-num-layers"]) == ("uniform", "1")
    stages = tuple(replace(st, recompute="full" if st.index == 0 else "none") for st in plan.stages)
    args, notes = megatron_args(replace(plan, stages=stages), dims)
    f = flag_values(args)
    assert (f["--recompute-method"], f["--recompute-num-layers"]) == ("block", "8")
    assert any("recomputed layers per chunk [8, 0]" in n for n in notes)


def test_megatron_script_and_zero2_memory_refusal():
    # Llama 3 8B, dp 16, ZeRO-2 at 72.5 GB of 80 planned: Megatron's distributed optimizer keeps fp32 main
    # gradients and bf16 weights unsharded (6 + 12/d bytes per parameter), 31 GB more: refused
    plan, dims = plan_for("llama3-8b", tp=1, pp=1, dp=16, zero_stage=2, recompute="none", sequence_parallel=False,
                          num_microbatches=4, memory_gb=72.5)
    with pytest.raises(InfeasiblePlanError, match=r"needs 10[0-9]\.\d GB of 85\.1 GB.*6 \+ 12/d.*--fix zero=3") as e:
        export_plan(plan, "megatron", dims=dims)
    assert e.value.memory_gb_needed > 100
    forced = export_plan(plan, "megatron", dims=dims, force=True)
    assert forced.refusals and forced.memory.worst.status == "exceeds"
    # the same plan fits torchtitan's FSDP2 layout (2 + 16/d)
    titan = export_plan(plan, "torchtitan", dims=dims)
    assert titan.memory.mode == "fsdp_no_reshard" and titan.memory.worst.status in ("fits", "close")
    ok = export_plan(replace(plan, zero_stage=3), "megatron", dims=dims)
    assert ok.text.startswith("#!/bin/bash") and "torchrun --nnodes 2 --nproc-per-node 8" in ok.text
    assert "--use-torch-fsdp2" in ok.text and "memory under megatron's layout (torch_fsdp2: 16/d" in ok.text


def test_megatron_refuses_fsdp2_with_pipelines_and_tied_embeddings():
    plan, dims = plan_for(GPT, tp=2, pp=4, dp=2, zero_stage=3, memory_gb=20.0)
    with pytest.raises(ConfigError) as e:
        export_plan(plan, "megatron", dims=dims)
    assert "pipeline parallelism (pp=4)" in str(e.value) and "tied input and output embeddings" in str(e.value)
    zb, dims = plan_for(LLAMA, pp=2, tp=2, dp=4, virtual_stages=2, schedule="zero-bubble", memory_gb=20.0)
    with pytest.raises(ConfigError, match="no zero-bubble pipeline schedule"):
        export_plan(zb, "megatron", dims=dims)


# --- memory check --------------------------------------------------------------------------------------------


def test_rank_params_add_up_to_the_model():
    for spec in (LLAMA, MIXTRAL, GPT):
        plan, dims = plan_for(spec, tp=2, pp=2, dp=2, ep=2 if "mixtral" in spec else 1)
        per_rank = rank_params(plan, dims)
        d = plan.degrees
        unsharded = sum(dense * d.tp + expert * d.ep for dense, expert in per_rank)
        tied_copy = dims.vocab * dims.hidden if dims.tied_embeddings else 0
        assert unsharded == pytest.approx(plan.model.params + tied_copy, rel=1e-6)
        dense_l, expert_l = layer_params(dims)  # the closed form against the built model's first layer
        model = build_model(spec).model
        layer = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))[0]
        assert dense_l + expert_l == pytest.approx(sum(p.numel() for p in layer.parameters()), rel=1e-6)


def test_memory_check_swaps_only_model_states():
    plan, dims = plan_for(LLAMA, tp=2, pp=2, dp=4, zero_stage=1, memory_gb=40.0)
    for target in ("deepspeed", "megatron"):
        mem = check_memory(plan, load_target(target), dims)
        for r in mem.ranks:
            other = r.planned_bytes - r.planned_states_bytes
            assert r.target_bytes == pytest.approx(other + r.target_states_bytes)
    ds = check_memory(plan, load_target("deepspeed"), dims)  # DeepSpeed ZeRO-1 is the planner's ZeRO-1 (SC20)
    assert all(r.target_states_bytes == pytest.approx(r.planned_states_bytes) for r in ds.ranks)


def test_close_to_capacity_warns():
    plan, dims = plan_for(LLAMA, tp=2, pp=1, dp=8, zero_stage=1, memory_gb=82.5, num_microbatches=2)
    res = export_plan(plan, "deepspeed", dims=dims)
    assert res.warnings and "close" in res.warnings[0] and "of 85.1 GB" in res.warnings[0]


# --- torchtitan 0.3.0 -------------------------------------------------------------------------------------


TITAN_CASES = [
    ("llama3-8b", dict(tp=1, pp=1, dp=16, zero_stage=2, recompute="none", sequence_parallel=False,
                       num_microbatches=4, memory_gb=60.0)),
    (LLAMA, dict(tp=2, pp=4, dp=2, virtual_stages=2, schedule="interleaved-1f1b", zero_stage=3, recompute="full",
                 cuts=(3, 1, 2, 2, 2, 2, 2, 2), memory_gb=20.0)),
    (LLAMA, dict(tp=2, pp=2, dp=4, zero_stage=0, recompute="selective", memory_gb=20.0)),
]


def test_torchtitan_settings_batch_and_cuts():
    plan, dims = plan_for(LLAMA, tp=2, pp=4, dp=2, zero_stage=1, cuts=(3, 5, 4, 4), memory_gb=20.0)
    sections, ac, notes = torchtitan_settings(plan)
    tr, par = sections["training"], sections["parallelism"]
    s = plan.schedule
    assert tr["local_batch_size"] == s.microbatch_size * s.num_microbatches  # split by the pipeline
    assert par["pipeline_parallel_microbatch_size"] == s.microbatch_size
    assert [sum(m.startswith("layers.") for m in part) for part in par["module_fqns_per_model_part"]] == [3, 5, 4, 4]
    assert par["fsdp_reshard_after_forward"] == "never" and any("ZeRO-1 runs as FSDP2" in n for n in notes)
    flat, _ = plan_for(LLAMA, tp=2, pp=1, dp=8, num_microbatches=4, memory_gb=20.0)
    assert torchtitan_settings(flat)[0]["training"]["local_batch_size"] == flat.schedule.microbatch_size


def test_torchtitan_refuses_gpt_and_mixtral():
    for spec in (GPT, MIXTRAL):
        plan, dims = plan_for(spec, tp=2, pp=1, dp=8, memory_gb=20.0, ep=2 if "mixtral" in spec else 1)
        with pytest.raises(ConfigError, match="torchtitan 0.3.0 has no"):
            export_plan(plan, "torchtitan", dims=dims)


@pytest.mark.parametrize("spec, kw", TITAN_CASES)
def test_torchtitan_config_manager_loads_the_export(spec, kw, tmp_path, monkeypatch):
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    plan, dims = plan_for(spec, **kw)
    res = export_plan(plan, "torchtitan", dims=dims)
    name = f"autopar_job_{abs(hash((spec, tuple(sorted(kw.items()))))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(res.text)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = ConfigManager().parse_args(["--module", name, "--config", "autopar_job"])
    d, s = plan.degrees, plan.schedule
    dims_t = ParallelDims.from_config(cfg.parallelism, world_size=d.world_size)
    assert (dims_t.tp, dims_t.pp, dims_t.cp, dims_t.dp_replicate * dims_t.dp_shard) == (d.tp, d.pp, d.cp, d.dp)
    # torchtitan/trainer.py: accumulation = global / (local * dp); pipeline micro-batches = local / pp micro-batch
    accumulation = cfg.training.global_batch_size // (cfg.training.local_batch_size * d.dp)
    pp_micro = cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size if d.pp > 1 else 1
    assert accumulation * pp_micro == s.num_microbatches
    assert (cfg.training.local_batch_size if d.pp == 1 else cfg.parallelism.pipeline_parallel_microbatch_size) == \
        s.microbatch_size
    model = cfg.model_spec.model
    assert (len(model.layers), model.dim, model.vocab_size) == (dims.layers, dims.hidden, dims.vocab)
    assert model.layers[0].feed_forward.w1.out_features == dims.ffn_hidden
    ac = {"none": type(None), "full": "FullAC", "selective": "SelectiveAC"}[plan.stages[0].recompute]
    assert (type(cfg.activation_checkpoint) is ac) if ac is type(None) else \
        type(cfg.activation_checkpoint).__qualname__.startswith(ac)
    if d.pp > 1:
        parts = cfg.parallelism.module_fqns_per_model_part
        assert [sum(m.startswith("layers.") for m in p) for p in parts] == layers_per_stage(plan)


# --- DeepSpeed ------------------------------------------------------------------------------------------------

# DeepSpeedConfig asks deepspeed.comm for the global rank and takes the data-parallel size from the mpu that
# deepspeed.initialize builds from the pipeline / tp topology. The check stands in rank 0 (deepspeed.comm's CPU
# backend JIT-compiles a shared-memory op to initialize) and an mpu of the plan's dp; the config checks are real.
_DS_CHECK = textwrap.dedent("""
    import json, sys
    import deepspeed.runtime.config as ds_config
    ds_config.dist.get_rank = lambda group=None: 0
    out = []
    for case in json.load(open(sys.argv[1])):
        class Mpu:
            def get_data_parallel_world_size(self, dp=case["dp"]):
                return dp
        try:
            c = ds_config.DeepSpeedConfig(case["config"], mpu=Mpu())
            out.append({"ok": True, "stage": c.zero_optimization_stage, "gas": c.gradient_accumulation_steps,
                        "world": c.world_size, "bf16": c.bfloat16_config.enabled})
        except Exception as e:
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    print(json.dumps(out))
""")


def test_deepspeed_config_passes_deepspeeds_checks(tmp_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install -e .[exports])")
    cases, plans = [], []
    for zero, pp in [(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (1, 2)]:
        plan, _ = plan_for(LLAMA, tp=2, pp=pp, dp=8 // pp, zero_stage=zero, num_microbatches=4, memory_gb=20.0)
        cfg, _ = deepspeed_config(plan)
        cases.append({"config": cfg, "dp": plan.degrees.dp})
        plans.append(plan)
    bad = dict(cases[0], config=dict(cases[0]["config"], train_batch_size=plans[0].global_batch + 1))
    (tmp_path / "cases.json").write_text(json.dumps([*cases, bad]))
    run = subprocess.run([sys.executable, "-c", _DS_CHECK, str(tmp_path / "cases.json")], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for plan, r in zip(plans, results):
        assert r["ok"], r
        assert (r["stage"], r["gas"], r["world"], r["bf16"]) == (
            plan.zero_stage, plan.schedule.num_microbatches, plan.degrees.dp, True)
    assert not results[-1]["ok"] and "train_batch_size is not equal" in results[-1]["error"]  # the check can fail


def test_deepspeed_refuses_zero2_with_pipelines():
    plan, dims = plan_for(LLAMA, tp=2, pp=4, dp=2, zero_stage=2, memory_gb=20.0)
    with pytest.raises(ConfigError, match=r"ZeRO-2 with pipeline parallelism \(pp=4\).*--fix zero=1"):
        export_plan(plan, "deepspeed", dims=dims)
    res = export_plan(replace(plan, zero_stage=1), "deepspeed", dims=dims)
    zero = json.loads(res.text)["zero_optimization"]
    assert zero == {"stage": 1, "overlap_comm": False, "contiguous_gradients": True}  # PipelineEngine: no overlap
    assert any("PipelineModule(layers=..., num_stages=4)" in n for n in res.notes)


# --- entry and command line -------------------------------------------------------------------------------------


def test_unknown_target_and_unknown_shape():
    with pytest.raises(ConfigError, match="megatron, torchtitan, deepspeed"):
        export_plan(make_plan(), "jax")
    with pytest.raises(ConfigError, match="--model SPEC"):
        export_plan(replace(make_plan(), model=replace(make_plan().model, name="mymodels.gpt:build")), "megatron")


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


def test_export_command(tmp_path, capsys):
    from cli.main import main
    from planner.plan import save_plan

    plan, _ = plan_for(LLAMA, tp=2, pp=4, dp=2, zero_stage=2, memory_gb=20.0)
    path = tmp_path / "p.json"
    save_plan(plan, path)
    assert main(["export", str(path), "--to", "megatron"]) == 0
    out, err = capsys.readouterr()
    assert "--tensor-model-parallel-size 2" in out and "memory under megatron's layout" in err
    assert "differs in megatron: ZeRO-2 runs as Megatron's distributed optimizer" in err
    assert main(["export", str(path), "--to", "deepspeed"]) != 0  # ZeRO-2 with pp=4
    err = capsys.readouterr().err
    assert "ZeRO-2 with pipeline parallelism (pp=4)" in err and "--fix zero=1" in err
    assert main(["export", str(path), "--to", "deepspeed", "--force", "--out", str(tmp_path / "ds.json")]) == 0
    assert json.loads((tmp_path / "ds.json").read_text())["zero_optimization"]["stage"] == 2
    assert "refused" in capsys.readouterr().err
    user = tmp_path / "u.json"
    save_plan(replace(plan, model=replace(plan.model, name="mymodels.gpt:build")), user)
    assert main(["export", str(user), "--to", "torchtitan"]) != 0
    assert "--model SPEC" in capsys.readouterr().err
    assert main(["export", str(user), "--to", "torchtitan", "--model", LLAMA, "--out", str(tmp_path / "j.py")]) == 0
    assert "def autopar_job():" in (tmp_path / "j.py").read_text()
