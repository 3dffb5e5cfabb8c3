"""Execution targets (profiles/targets/*.toml through costmodel.targets): refusals, memory modes, file checks."""

from dataclasses import replace

import pytest

from costmodel.errors import ProfileError
from costmodel.memory import model_state_bytes as planner_state_bytes
from costmodel.step_config import ParallelConfig
from costmodel.targets import TARGET_NAMES, TARGETS_DIR, load_target


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
    ("autopar", 1, 1, "6 + 12/d", 6 + 12 / 8),  # CUDA: bf16 gathered params, fp32 accumulated grads
    ("autopar", 2, 2, "2 + 16/d", 2 + 16 / 8),  # CUDA: reduce-scatter every micro-batch, also pipelined
    ("autopar", 3, 2, "16/d", 16 / 8),
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
    text = (TARGETS_DIR / "autopar.toml").read_text()
    consts = text[text.index("\n[kernels]\n"):text.index("\n[[cannot_run]]")] + "\n"  # valid constant tables
    for name, (body, error) in cases.items():
        (tmp_path / f"{name}.toml").write_text(head + body + good_mode + consts)
        with pytest.raises(ProfileError, match=error):
            load_target(name, directory=tmp_path)
    with pytest.raises(ProfileError, match="known targets: .*bytes"):
        load_target("nope", directory=tmp_path)
    (tmp_path / "ok.toml").write_text(head + good_mode + consts)
    assert load_target("ok", directory=tmp_path).modes[0].formula() == "2"
    bad = {
        "nokernels": (consts.replace("[kernels]", "[kernel]"), "unknown key 'kernel'"),
        "unknownconst": (consts.replace("[kernels]\n", "[kernels]\ngemm_efficiency = { value = 0.7, source = 's' }\n"),
                         "unknown key 'gemm_efficiency'"),
        "nosource": (consts.replace("sustained_compute = { value = 0.85, source",
                                    "sustained_compute = { value = 0.85, why"), "unknown key 'why'"),
        "missing": (consts.replace("overlap_slowdown = {", "#overlap_slowdown = {"),
                    "overlap.overlap_slowdown] missing"),
        "type": (consts.replace("zero3_flat_nic = { value = true", "zero3_flat_nic = { value = 1"), "must be bool"),
        "precision": (consts + '[precision.fp6]\ngemm_dtype = "fp8"\nsource = "s"\n', "unknown precision 'fp6'"),
        "gemm": (consts + '[precision.fp8]\ngemm_dtype = "int8"\nsource = "s"\n', "gemm_dtype = 'int8'"),
        "nobf16": (consts.replace("[precision.bf16]", "[precision.fp8]"), r"at least \[precision.bf16\]"),
        "option": (consts + '[options.o]\ndescription = "d"\nsource = "s"\nconstants = { speed = 2 }\n',
                   "unknown constant 'speed'"),
    }
    for name, (body, error) in bad.items():
        (tmp_path / f"{name}.toml").write_text(head + good_mode + body)
        with pytest.raises(ProfileError, match=error):
            load_target(name, directory=tmp_path)
    with pytest.raises(ProfileError, match="has no option 'x'; options: none"):
        load_target("ok:x", directory=tmp_path)


# --- constants: every target prices with its own file, the same way everywhere ---------------------------------


def test_every_constant_and_precision_has_a_source():
    from costmodel.step_config import StepConstants

    fields = set(StepConstants.__dataclass_fields__) - {"precisions"}
    for name in TARGET_NAMES:
        t = load_target(name)
        assert {k for k, _ in t.sources if not k.startswith("precision.")} == fields
        assert all(src.strip() for _, src in t.sources)
        assert "bf16" in t.precisions and {f"precision.{p}" for p in t.precisions} <= dict(t.sources).keys()
    # the targets differ where their frameworks do
    ap, meg, ds = (load_target(n).constants for n in ("autopar", "megatron", "deepspeed"))
    assert not ap.tp_fused_input_projections and meg.tp_fused_input_projections
    assert ap.zero3_collectives_per_layer == 1 and ds.zero3_collectives_per_layer == 6
    assert meg.tp_comm_exposed < 1.0 == ap.tp_comm_exposed
    assert ap.precisions == (ap.precision("bf16"),) and meg.precision("fp8").param_gather_bytes == 1.0


def test_options_override_named_constants_only():
    base, sc21 = load_target("megatron"), load_target("megatron:sc21")
    assert sc21.spec == "megatron:sc21" and base.spec == "megatron"
    changed = {k for k in base.constants.__dataclass_fields__
               if getattr(base.constants, k) != getattr(sc21.constants, k)}
    assert changed == {k for k, _ in sc21.options[0].constants if getattr(base.constants, k) != dict(
        sc21.options[0].constants)[k]}
    assert sc21.constants.tp_comm_exposed == 1.0 and sc21.constants.sustained_compute == 0.85
    with pytest.raises(ProfileError, match="no option 'x'; options: sc21, cuda-graphs, moe-a2a-overlap"):
        load_target("megatron:x")


def test_precisions_need_the_tensor_cores():
    from costmodel.errors import ConfigError
    from costmodel.profiles import make_cluster

    meg = load_target("megatron")
    assert meg.precisions_on(make_cluster("dgx-a100-80gb", 1)) == ("bf16",)
    assert meg.precisions_on(make_cluster("dgx-h100", 1)) == ("bf16", "fp8", "fp8-cs")
    assert set(meg.precisions_on(make_cluster("dgx-b200", 1))) == set(meg.precisions)
    with pytest.raises(ConfigError, match="needs fp4 tensor cores, which H100-SXM5-80GB lack"):
        meg.check_precision("nvfp4", make_cluster("dgx-h100", 1))
    with pytest.raises(ConfigError, match="has no fp8 training; it trains with bf16"):
        load_target("autopar").check_precision("fp8", make_cluster("dgx-h100", 1))
    assert any("--precision bf16" in m for m in load_target("deepspeed").refusals(cfg(precision="fp8")))


def test_plan_estimate_and_fidelity_price_a_case_identically():
    """The torchtitan H200 row of the development set: the fidelity row, ``estimate_step`` with the target and
    ``plan_model`` pinned to the row's configuration give one step time."""
    from benchmarks.devset import load_devset
    from benchmarks.devset_runs import dev_run, price_devset
    from costmodel.profiles import make_cluster
    from costmodel.step import estimate_step
    from planner.search.driver import plan_model
    from planner.workload import workload_from_model

    cases = load_devset()
    case = next(c for c in cases if c.id == "torchtitan-h200-L46")
    (row,) = price_devset([case])
    run = dev_run(case, cases)
    cluster = make_cluster(run.node, run.nodes, gpus_per_node=run.gpus_per_node)
    w, _ = workload_from_model(run.spec, seq=case.seq_len)
    est = estimate_step(w, run.config, cluster, target=load_target("torchtitan"))
    assert row["step_time_s"] == pytest.approx(est.step_time_s, rel=1e-12)
    c = run.config
    plan = plan_model(run.spec, cluster, global_batch=c.global_batch, seq=case.seq_len, target="torchtitan",
                      precision=c.precision, fix=f"tp={c.tp},pp={c.pp},dp={c.dp},mb={c.microbatch},"
                                                 f"recompute={c.recompute},zero={c.zero_stage},sp=false")
    assert (plan.target, plan.precision) == ("torchtitan", "fp8-cs")
    assert plan.prediction.step_time_s == pytest.approx(est.step_time_s, rel=1e-9)
    other = estimate_step(w, run.config, cluster, target=load_target("megatron"))  # another target, another figure
    assert abs(other.step_time_s / est.step_time_s - 1) > 0.01


def test_gpt_layout_rows_are_priced_with_tensor_parallel_projections():
    """NeMo's GPT3-20B (a GPT-2-layout config, tp=2) is built as the gpt3-175b preset is, with nn.Linear
    projections that tp and sequence parallelism shard as Megatron does: GPT2LMHeadModel's Conv1D has no
    tensor-parallel strategy, and the row was priced replicated over tp without sequence parallelism (-45%)."""
    from benchmarks.devset import load_devset
    from benchmarks.devset_runs import dev_run, price_devset
    from planner.models import model_dims

    cases = load_devset()
    case = next(c for c in cases if c.id == "nemo-L15")
    run = dev_run(case, cases)
    assert run.spec.startswith("gpt:") and run.config.tp == 2
    key = lambda d: (d.layers, d.hidden, d.heads, d.ffn_hidden, d.vocab, d.seq, d.tied_embeddings)  # noqa: E731
    assert key(model_dims(run.spec)) == key(model_dims(str(case.model_config), seq=case.seq_len))
    (row,) = price_devset([case])
    assert " sp " in f" {row['config']} " and "no sequence parallelism" not in row["assumption"], row
    assert abs(row["error"]) < 0.12, row  # published 5,851 tokens/s/GPU


def test_the_search_never_proposes_what_the_target_refuses():
    from costmodel.analytic import llama_workload
    from costmodel.profiles import make_cluster
    from planner.export_check import config_of
    from planner.plan import ModelInfo
    from planner.search.driver import plan_model, search

    wl = llama_workload(layers=8, hidden=1024, ffn_hidden=2816, heads=16, kv_heads=4, vocab=32000, seq=2048)
    cl = make_cluster("dgx-a100-80gb", 2)
    free = search(workload=wl, cluster=cl, global_batch=64)
    piped = search(workload=wl, cluster=cl, global_batch=64, refuse=lambda c: ["pipelines only"] if c.pp == 1 else [])
    assert free.best.structure.pp == 1  # the unrestricted search takes no pipeline here, the refusing one must
    assert piped.best.structure.pp > 1 and all(a.structure.pp > 1 for a in piped.alternatives)
    assert piped.best.step_time_s >= free.best.step_time_s
    info = ModelInfo(name=wl.name, fingerprint="sha256:t", params=wl.params, flops_per_step=0.0, num_layers=8,
                     seq_len=2048)
    for name, fix in (("deepspeed", "zero=3"), ("megatron", "schedule=zero-bubble"), ("torchtitan", "v=1")):
        t = load_target(name)
        try:
            plan = plan_model((wl, info), cl, global_batch=64, target=name, fix=fix)
        except Exception as e:  # everything the fix leaves is refused: the planner says so
            assert "accepted no configuration" in str(e) or "fits in no configuration" in str(e), (name, e)
            continue
        assert plan.target == name
        assert t.refusals(config_of(plan), glu=True) == [], (name, config_of(plan).summary())


# --- precision: GEMM rates, casts, memory and the gather, by hand -----------------------------------------------


def test_fp8_gemm_time_by_hand():
    """One (m, n, k) linear on an H100 under Megatron's constants: bf16 runs at the bf16 peak times the shape's
    efficiency over sustained_compute; fp8 at the fp8 peak, plus the cast of its (m, k) input at the elementwise
    memory rate (forward) or of its (m, n) output gradient (backward)."""
    from costmodel.compute import DEFAULT_COMPUTE_EFFICIENCY as eff, matmul_efficiency
    from costmodel.profiles import make_cluster
    from planner.search.block_plan import CostOptions, cluster_cost_context
    from planner.search.strategies import LayerOp, MeshShape, candidates

    cluster = make_cluster("dgx-h100", 1)
    gpu = cluster.groups[0].node.gpu
    k = load_target("megatron").constants
    m, n, kk = 8192, 4096, 4096
    op = LayerOp(name="fc", kind="linear", inputs=("input",), modules=("fc",), flops_fwd=2.0 * m * n * kk,
                 flops_bwd=4.0 * m * n * kk, bytes_fwd=0.0, out_bytes=2.0 * m * n, params=n * kk,
                 shard_dims=(n, kk), op_class="matmul", mnk=(m, n, kk))
    mesh = MeshShape(tp=1)
    s = next(c for c in candidates(op, mesh) if c.work_fraction == 1.0)
    times = {}
    for p in ("bf16", "fp8"):
        prec = k.precision(p)
        opts = CostOptions(sustained_compute=k.sustained_compute, gemm_dtype=prec.gemm_dtype,
                           cast_bytes=prec.cast_bytes_per_element)
        ctx = cluster_cost_context(cluster, mesh=mesh, sustained_compute=k.sustained_compute, cost=opts)
        times[p] = (ctx.op_time_s(op, s, op.flops_fwd, 0.0), ctx.op_time_s(op, s, op.flops_bwd, 0.0))
    mem_rate = gpu.hbm_gbps * 1e9 * eff.mem_elementwise
    for flops, cast_elems, i in ((op.flops_fwd, m * kk, 0), (op.flops_bwd, m * n, 1)):
        rate = {d: gpu.tflops(d) * 1e12 * matmul_efficiency(m, n, kk, gpu, dtype=d) for d in ("bf16", "fp8")}
        bf16 = flops / rate["bf16"] / k.sustained_compute
        fp8 = flops / rate["fp8"] / k.sustained_compute
        cast = k.precision("fp8").cast_bytes_per_element * cast_elems / mem_rate
        assert times["bf16"][i] == pytest.approx(bf16, rel=1e-12)
        assert times["fp8"][i] == pytest.approx(fp8 + cast, rel=1e-12)
    assert times["fp8"][0] < 0.75 * times["bf16"][0]  # fp8 pays off on a GEMM this size, casts included


def test_precision_moves_weight_memory_and_the_parameter_gather_by_hand():
    """Megatron's distributed optimizer (6 + 12/d bytes per parameter) plus the precision's weight copies
    (nvfp4: 1.125 bytes per parameter, replicated); the parameter all-gather moves 2 bytes per parameter in bf16,
    1 with fp8 parameters; gradients are reduced in fp32 (4) either way."""
    from costmodel.analytic import llama_workload
    from costmodel.profiles import make_cluster
    from costmodel.step import dp_bytes, dp_collectives, estimate_step

    meg = load_target("megatron")
    w = llama_workload(layers=4, hidden=1024, ffn_hidden=2816, heads=16, kv_heads=4, vocab=32000, seq=1024)
    cluster = make_cluster("dgx-b200", 1)
    base = dict(tp=1, pp=1, dp=8, microbatch=1, global_batch=8, zero_stage=1)
    weights = {p: estimate_step(w, ParallelConfig(**base, precision=p), cluster, target=meg).memory_breakdown_gb[
        "weights"] for p in ("bf16", "nvfp4")}
    assert weights["bf16"] == pytest.approx(w.params * (2 + 4 / 8) / 1e9, rel=1e-9)
    assert weights["nvfp4"] - weights["bf16"] == pytest.approx(w.params * 1.125 / 1e9, rel=1e-9)
    assert dp_bytes(w, ParallelConfig(**base), meg.constants) == (4.0, 2.0)
    assert dp_bytes(w, ParallelConfig(**base, precision="fp8"), meg.constants) == (4.0, 1.0)
    got = {op: nbytes for _, op, nbytes, _ in dp_collectives(params=1e9, expert_params=0.0, bytes_per_param=4.0,
                                                             gather_bytes_per_param=1.0, m=1, k=meg.constants,
                                                             zero_stage=1, recompute="none", layers=4)}
    assert got == {"reduce_scatter": 4e9, "all_gather": 1e9}


# --- the command line ---------------------------------------------------------------------------------------

TINY = "llama:layers=2,hidden=256,ffn=512,heads=4,kv_heads=2,vocab=1000,seq=256"


def test_plan_cli_records_target_and_precision(tmp_path, capsys):
    from cli.main import main
    from planner.plan import load_plan

    out = tmp_path / "p.json"
    rc = main(["plan", "--model", TINY, "--cluster", "dgx-h100", "--global-batch", "16", "--target", "megatron",
               "--precision", "fp8", "--fix", "tp=2,pp=1,sp=true", "--out", str(out)])
    assert rc == 0
    assert "target      megatron, precision fp8" in capsys.readouterr().out
    plan = load_plan(out)
    assert (plan.target, plan.precision) == ("megatron", "fp8")
    from planner.export import export_plan

    flags = export_plan(plan, "megatron").text.split()
    for flag, value in (("--fp8-format", "hybrid"), ("--fp8-recipe", "delayed")):
        assert flags[flags.index(flag) + 1] == value
    assert {"--bf16", "--fp8-param-gather", "--tp-comm-overlap", "--sequence-parallel"} <= set(flags)
    with pytest.raises(Exception, match="re-plan with --target torchtitan"):
        export_plan(plan, "torchtitan")
    rc = main(["plan", "--model", TINY, "--cluster", "dgx-a100-80gb", "--global-batch", "16", "--target",
               "megatron", "--precision", "fp8"])
    assert rc != 0 and "needs fp8 tensor cores, which A100-SXM4-80GB lack" in capsys.readouterr().err


def test_estimate_cli_prices_for_the_target(capsys):
    import json

    from cli.main import main

    args = ["estimate", "--model", TINY, "--cluster", "dgx-h100", "--tp", "2", "--global-batch", "16",
            "--microbatch", "1", "--zero", "3", "--pp", "2", "--json"]
    assert main(args + ["--target", "deepspeed"]) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert d["target"] == "deepspeed" and any("ZeRO-3 with pipeline parallelism" in r for r in d["refusals"])
    assert "deepspeed cannot run this configuration" in captured.err
    assert main(args + ["--target", "megatron", "--precision", "fp8-cs"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["config"]["precision"] == "fp8-cs" and m["step_time_s"] != d["step_time_s"]


# --- options a framework's recipe turns on, and the hardware they run on ------------------------------------


def test_recipe_settings_price_the_row_with_the_targets_options():
    """A Megatron-Bridge row whose recipe (benchmarks/data/megatron_bridge_recipes.json) runs full-iteration
    CUDA graphs, the MoE all-to-all overlap, the fused grouped MLP and fp8 attention is priced for
    ``megatron:cuda-graphs:moe-a2a-overlap:fused-grouped-mlp:fp8-attention``, exactly as ``estimate_step`` prices
    it with that target; the same model's H100 row, whose recipe runs none of them, for plain ``megatron``."""
    from benchmarks.devset import load_devset, load_recipes
    from benchmarks.devset_runs import dev_run, price_devset, recipe_options
    from costmodel.profiles import make_cluster
    from costmodel.step import estimate_step
    from planner.workload import workload_from_model

    cases, recipes = load_devset(), load_recipes()
    by_id = {c.id: c for c in cases}
    gb200, h100 = by_id["mbridge-archive-L130"], by_id["mbridge-archive-L132"]
    assert (gb200.release, gb200.system, gb200.model) == ("26.06", "gb200-nvl72", "qwen3-30b-a3b")
    run = dev_run(gb200, cases, recipes)
    assert run.options == ("cuda-graphs", "moe-a2a-overlap", "fused-grouped-mlp", "fp8-attention")
    assert dev_run(h100, cases, recipes).options == ()
    (row,) = price_devset([gb200])
    assert row["options"] == list(run.options) and "recipe: cuda-graphs" in row["assumption"]
    cluster = make_cluster(run.node, run.nodes, gpus_per_node=run.gpus_per_node)
    w, _ = workload_from_model(run.spec, seq=gb200.seq_len)
    with_options = estimate_step(w, run.config, cluster, target=load_target(run.target_spec))
    plain = estimate_step(w, run.config, cluster, target=load_target("megatron"))
    assert row["step_time_s"] == pytest.approx(with_options.step_time_s, rel=1e-12)
    assert with_options.step_time_s < 0.9 * plain.step_time_s
    # the mapping itself: a local full-iteration graph counts, TE-scoped graphs do not; fp8 attention needs fp8
    assert recipe_options({"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]}, "mxfp8") == (
        "cuda-graphs",)
    assert recipe_options({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["attn"]}, "mxfp8") == ()
    assert recipe_options({"fp8_dot_product_attention": True}, "bf16") == ()
    assert recipe_options(None, "bf16") == ()


def test_expert_all_to_all_overlap_and_fp8_attention_in_the_cost_context():
    """``ep_comm_exposed`` scales the expert-parallel all-to-alls and nothing else; ``fp8_attention`` prices
    fused attention at the fp8 rate (twice bf16 on an H100), only under an fp8 precision."""
    from costmodel.profiles import make_cluster
    from planner.search.op_cost import CostOptions, cluster_cost_context
    from planner.search.strategies import Collective, LayerOp, MeshShape

    cluster = make_cluster("dgx-h100", 1)
    mesh = MeshShape(tp=2, ep=4)
    full = cluster_cost_context(cluster, mesh=mesh, cost=CostOptions())
    half = cluster_cost_context(cluster, mesh=mesh, cost=CostOptions(ep_comm_exposed=0.5))
    a2a = Collective(kind="all_to_all", nbytes=64e6, axis="ep")
    tp_ar = Collective(kind="all_reduce", nbytes=64e6, axis="tp")
    assert half.collective(a2a)[1] == pytest.approx(0.5 * full.collective(a2a)[1]) and full.collective(a2a)[1] > 0
    assert half.collective(tp_ar) == full.collective(tp_ar)
    attn = LayerOp(name="attn", kind="attention", op_class="attention")
    t = {(dt, fa): cluster_cost_context(cluster, mesh=mesh, cost=CostOptions(gemm_dtype=dt, fp8_attention=fa))
         .op_time_s(attn, None, 1e15, 0.0) for dt in ("bf16", "fp8") for fa in (False, True)}
    assert t[("fp8", True)] == pytest.approx(0.5 * t[("fp8", False)], rel=1e-3)  # 1978.9 against 989.4 TFLOP/s
    assert t[("bf16", True)] == t[("bf16", False)] == t[("fp8", False)]


def test_blackwell_ultra_runs_fused_attention_faster_at_the_same_peaks():
    """GB300 and GB200 list the same dense peaks; Blackwell Ultra's doubled SFU throughput makes fused attention
    ``attention_speedup`` (1.5) times as fast, and nothing else."""
    from costmodel.compute import compute_rate_flops
    from costmodel.profiles import get_node_type

    gb200, gb300 = get_node_type("gb200-nvl72").gpu, get_node_type("gb300-nvl72").gpu
    assert gb200.peak_tflops["bf16"] == gb300.peak_tflops["bf16"] and gb200.attention_speedup == 1.0
    rate = lambda gpu, op: compute_rate_flops(op_class=op, device=gpu, dtype="bf16")  # noqa: E731
    assert rate(gb300, "attention") == pytest.approx(1.5 * rate(gb200, "attention"))
    assert rate(gb300, "matmul") == rate(gb200, "matmul")


def test_options_add_what_their_framework_cannot_run_with_them():
    """``moe-a2a-overlap`` refuses ep=1 and full recomputation (Megatron-LM's validate_args asserts both),
    ``fp8-attention`` a bf16 plan; the base target refuses none of them, and a search for a dense model with
    the overlap on names the refusal instead of finding nothing."""
    from costmodel.errors import InfeasiblePlanError
    from costmodel.profiles import make_cluster
    from planner.search.driver import plan_model

    base, on = load_target("megatron"), load_target("megatron:moe-a2a-overlap:fp8-attention")
    assert len(on.cannot_run) == len(base.cannot_run) + 3
    moe = cfg(tp=1, pp=1, dp=8, ep=4, precision="mxfp8")
    assert on.refusals(moe) == [] == base.refusals(moe)
    for bad, text in ((replace(moe, ep=1), "needs expert parallelism; this plan has ep=1"),
                      (replace(moe, recompute="full"), "cannot run with full recomputation"),
                      (replace(moe, precision="bf16"), "needs an fp8 precision; this plan trains in bf16")):
        assert [r for r in on.refusals(bad) if text in r] and not base.refusals(bad)
    dense = "llama:layers=2,hidden=256,ffn=512,heads=4,kv_heads=4,vocab=1024,seq=128"
    most_often = "refused what the search proposed, most often: --overlap-moe-expert-parallel-comm .* ep=1"
    with pytest.raises(InfeasiblePlanError, match=most_often):
        plan_model(dense, make_cluster("dgx-b200", 1), global_batch=16, target="megatron:moe-a2a-overlap",
                   record_timings=False)
