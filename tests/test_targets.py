"""Execution targets (profiles/targets/*.toml through costmodel.targets): refusals, memory modes, file checks."""

import pytest

from costmodel.errors import ProfileError
from costmodel.memory import model_state_bytes as planner_state_bytes
from costmodel.step_config import ParallelConfig
from costmodel.targets import TARGET_NAMES, load_target


def cfg(**kw) -> ParallelConfig:
    base = dict(tp=1, pp=1, dp=8, cp=1, ep=1, microbatch=1, global_batch=64, schedule="1f1b", virtual_stages=1,
                recompute="none", zero_stage=0)
    base.update(kw)
    return ParallelConfig(**base)


def test_every_target_loads_with_sources():
    for name in TARGET_NAMES:
        t = load_target(name)
        assert t.name == name and t.cannot_run and t.modes
        assert all(r.source and r.fix for r in t.cannot_run)
        assert all(m.source for m in t.modes)
        for zero in (0, 1, 2, 3):  # every ZeRO stage has a layout, with and without a pipeline
            for pp in (1, 4):
                assert t.memory_mode(cfg(zero_stage=zero, pp=pp, dp=2)).name


def test_deepspeed_refuses_zero2_and_zero3_with_pipelines():
    ds = load_target("deepspeed")
    for zero in (2, 3):
        (msg,) = ds.refusals(cfg(zero_stage=zero, pp=4, dp=2))
        assert f"ZeRO-{zero} with pipeline parallelism (pp=4)" in msg and "--fix zero=1" in msg
    assert ds.refusals(cfg(zero_stage=1, pp=4, dp=2)) == []
    assert ds.refusals(cfg(zero_stage=3, pp=1)) == []
    (msg,) = ds.refusals(cfg(pp=2, dp=4, schedule="interleaved-1f1b", virtual_stages=2))
    assert "interleaved-1f1b" in msg and "--fix schedule=1f1b,v=1" in msg
    (msg,) = ds.refusals(cfg(cp=2, dp=4))
    assert "cp=2" in msg and "Ulysses" in msg and "--fix cp=1" in msg


def test_megatron_refuses_what_its_fsdp2_path_asserts():
    meg = load_target("megatron")
    assert any("pipeline parallelism (pp=2)" in m for m in meg.refusals(cfg(zero_stage=3, pp=2, dp=4)))
    assert any("expert parallelism (ep=2)" in m for m in meg.refusals(cfg(zero_stage=3, ep=2), experts=8))
    assert any("tied input and output embeddings" in m for m in meg.refusals(cfg(zero_stage=3), tied_embeddings=True))
    assert meg.refusals(cfg(zero_stage=3)) == []
    assert meg.refusals(cfg(zero_stage=1, pp=2, dp=4), tied_embeddings=True) == []
    (msg,) = meg.refusals(cfg(pp=2, dp=4, schedule="zero-bubble", virtual_stages=2))
    assert "zero-bubble" in msg and "--fix schedule=interleaved-1f1b" in msg
    (msg,) = meg.refusals(cfg(pp=2, dp=4, schedule="gpipe"))
    assert "GPipe" in msg and "--fix schedule=1f1b" in msg


def test_torchtitan_refuses_models_and_schedules_it_has_not():
    tt = load_target("torchtitan")
    (msg,) = tt.refusals(cfg(), glu=False)
    assert "GPT-style" in msg and "export to megatron" in msg
    (msg,) = tt.refusals(cfg(ep=2), experts=8)
    assert "8 experts" in msg
    (msg,) = tt.refusals(cfg(pp=2, dp=4, schedule="zero-bubble", virtual_stages=1))
    assert "at least 2 stages per pipeline rank" in msg and "--fix v=2" in msg
    assert tt.refusals(cfg(pp=2, dp=4, schedule="zero-bubble", virtual_stages=2, zero_stage=3)) == []
    assert tt.refusals(cfg(tp=2, dp=4, cp=2, zero_stage=3)) == []


def test_autopar_refuses_what_its_runtime_raises():
    ap = load_target("autopar")
    (msg,) = ap.refusals(cfg(cp=2, pp=2, dp=2))
    assert "cp=2" in msg and "pp=2" in msg and "--fix pp=1" in msg
    (msg,) = ap.refusals(cfg(cp=2, ep=2, dp=4), experts=8)
    assert "ep=2" in msg and "--fix ep=1" in msg
    (msg,) = ap.refusals(cfg(pp=2, dp=4, schedule="zero-bubble", virtual_stages=2, zero_stage=3))
    assert "zero_stage=3, dp=4" in msg and "--fix zero=0" in msg
    assert ap.refusals(cfg(pp=2, dp=4, schedule="zero-bubble", virtual_stages=2, zero_stage=0)) == []
    (msg,) = ap.refusals(cfg(recompute="selective"), experts=8)
    assert "8 experts" in msg and "--fix recompute=full" in msg
    assert ap.refusals(cfg(recompute="selective")) == []
    (msg,) = ap.refusals(cfg(pp=2, dp=4, schedule="1f1b", virtual_stages=2))
    assert "virtual_stages=2" in msg


@pytest.mark.parametrize("target, zero, pp, formula, per_param_d8", [
    ("megatron", 0, 1, "18", 18.0),
    ("megatron", 2, 1, "6 + 12/d", 6 + 12 / 8),  # Megatron docs: bf16 params, fp32 grads, distributed optimizer
    ("megatron", 3, 1, "16/d", 2.0),
    ("deepspeed", 1, 1, "4 + 12/d", 4 + 12 / 8),  # ZeRO SC20: P_os
    ("deepspeed", 2, 1, "2 + 14/d", 2 + 14 / 8),  # P_os+g
    ("deepspeed", 3, 1, "16/d", 2.0),  # P_os+g+p
    ("deepspeed", 0, 4, "4 + 12/d", 4 + 12 / 8),  # BF16_Optimizer under PipelineEngine
    ("torchtitan", 3, 1, "16/d", 2.0),
    ("torchtitan", 2, 1, "2 + 16/d", 2 + 16 / 8),
    ("torchtitan", 3, 4, "6 + 16/d", 6 + 16 / 8),  # pipelining: unsharded bf16 params + fp32 accumulated grads
    ("autopar", 0, 1, "20", 20.0),  # fp32 DDP with its bucket copy of the gradients
    ("autopar", 1, 1, "4 + 16/d", 4 + 16 / 8),  # ZeRO-1 runs as ZeRO-2
    ("autopar", 3, 2, "8 + 16/d", 8 + 16 / 8),
])
def test_memory_layouts(target, zero, pp, formula, per_param_d8):
    t = load_target(target)
    mode = t.memory_mode(cfg(zero_stage=zero, pp=pp, dp=8))
    assert mode.formula() == formula
    terms = t.model_state_bytes(params=1e9, mode=mode.name, dp=8)
    assert set(terms) == {"weights", "gradients", "optimizer"}
    assert sum(terms.values()) == pytest.approx(1e9 * per_param_d8)


def test_deepspeed_layouts_are_the_zero_paper_the_planner_prices():
    ds = load_target("deepspeed")
    for zero in (0, 1, 2, 3):
        mode = ds.memory_mode(cfg(zero_stage=zero))
        ours = sum(ds.model_state_bytes(params=7e9, mode=mode.name, dp=16).values())
        planned = sum(planner_state_bytes(params=7e9, zero_stage=zero, dp=16).values())
        assert ours == pytest.approx(planned)


def test_model_state_bytes_checks_its_input():
    meg = load_target("megatron")
    with pytest.raises(ProfileError, match="no memory mode 'zero9'"):
        meg.model_state_bytes(params=1, mode="zero9", dp=1)
    with pytest.raises(ProfileError, match="dp=0"):
        meg.model_state_bytes(params=1, mode="ddp", dp=0)


def test_bad_target_files_name_the_key(tmp_path):
    good_mode = '[memory.m]\ndescription = "d"\nsource = "s"\nweights = { replicated = 2.0 }\n'
    head = 'name = "x"\nframework = "f"\nsource = "s"\n'
    rule = '[[cannot_run]]\nwhen = {{ {when} }}\nmessage = "{message}"\nfix = "f"\nsource = "s"\n'
    cases = {
        "fact": (rule.format(when="pipeline = 2", message="m"), "unknown fact 'pipeline'"),
        "compare": (rule.format(when='pp = "more than 1"', message="m"), "comparison"),
        "type": (rule.format(when="moe = 1", message="m"), "must be bool"),
        "brace": (rule.format(when="pp = 2", message="at {pipeline}"), "unknown fact"),
        "key": (rule.format(when="pp = 2", message="m") + 'why = "?"\n', "unknown key 'why'"),
        "bytes": ('[memory.n]\ndescription = "d"\nsource = "s"\nweights = { replicated = -2 }\n', "must be a number >= 0"),
    }
    for name, (body, error) in cases.items():
        (tmp_path / f"{name}.toml").write_text(head + body + good_mode)
        with pytest.raises(ProfileError, match=error):
            load_target(name, directory=tmp_path)
    with pytest.raises(ProfileError, match="known targets: .*bytes"):
        load_target("nope", directory=tmp_path)
    (tmp_path / "extra.toml").write_text(head + good_mode + '\n[kernels]\ngemm_efficiency = 0.7\n')
    assert load_target("extra", directory=tmp_path).modes[0].formula() == "2"  # other sections do not block
