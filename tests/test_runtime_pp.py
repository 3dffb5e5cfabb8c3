"""Pipeline parallelism (runtime/pipeline.py, through runtime.apply_plan), with per-stage recomputation.

Tiers: the cut (chunks chained in one process == the full model) is a unit test (recomputation's are in
tests/test_runtime_recompute.py); schedules run on 2 and 4 gloo ranks (one spawned run per world size, several
cases each) and are compared with the single-process model over 3 SGD steps: loss each step, every parameter's gradient each step (gathered from the
stage that holds it) and the parameters after the last step. Tolerances: fp32 CPU; the pipeline splits the
batch into micro-batches, so sums are re-associated: rtol=1e-5, atol=1e-6 (losses ~5, gradients ~1e-2).
The action order each rank ran is recorded and compared with ``costmodel.pipeline.rank_orders`` (the order
the cost model simulates), and the peak in-flight micro-batches with ``inflight_microbatches``; so are the layers
each stage recomputes (its first ``recompute_layers``) and their attention forward calls (2 per micro-batch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from costmodel.errors import ConfigError, PlanMismatchError
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
    module_fingerprint,
)

RTOL, ATOL = 1e-5, 1e-6
VOCAB, SEQ = 128, 16
STEPS = 3
LR = 0.1


# --- models and plans -------------------------------------------------------------------------------------


def tiny_model(family: str, *, layers: int = 4, tied: bool = False, seed: int = 0) -> torch.nn.Module:
    """A tiny transformers causal LM (hidden 64, vocab 128), deterministic for ``seed``, dropout off."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=tied)
    if family == "opt":
        from transformers import OPTConfig, OPTForCausalLM

        cfg = OPTConfig(**common, ffn_dim=256, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        activation_function="gelu", word_embed_proj_dim=64, layerdrop=0.0)
        return OPTForCausalLM(cfg)
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common, intermediate_size=128, num_key_value_heads=2))
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(**common, intermediate_size=128, num_key_value_heads=2, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=8)
        return MixtralForCausalLM(cfg)
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    raise ValueError(family)


def unit_fqns(model: torch.nn.Module) -> list[list[str]]:
    """Per unit the module FQNs a plan would list: [embedding modules], [layer 0], ..., [post modules]."""
    from runtime.model_adapters import adapter_for

    lay = adapter_for(model).layout
    return [list(lay.embed), *([x] for x in lay.layers), [*lay.post]]


def make_plan(model, *, cuts: list[tuple[int, int]], pp: int, schedule: str, n_mb: int, mb: int = 2,
              dp: int = 1, tp: int = 1, recompute: tuple | None = None,
              shardings: tuple[ModuleSharding, ...] = ()) -> Plan:
    """A hand-written plan: chunk i holds units [lo, hi) of ``unit_fqns(model)``; ``recompute[i]`` is chunk i's
    mode, or (mode, how many of its layers from the first: ``StagePlan.recompute_layers``)."""
    units = unit_fqns(model)
    d = ParallelDegrees(pp=pp, dp=dp, tp=tp)
    rec = [r if isinstance(r, tuple) else (r, -1) for r in recompute or ("none",) * len(cuts)]
    stages = tuple(
        StagePlan(index=i, pp_rank=i % pp, modules=tuple(f for u in units[lo:hi] for f in u), ranks=(),
                  recompute=rec[i][0], recompute_layers=rec[i][1])
        for i, (lo, hi) in enumerate(cuts)
    )
    return Plan(
        model=ModelInfo(name="tiny", fingerprint=module_fingerprint(model), params=1, flops_per_step=1.0,
                        num_layers=4, seq_len=SEQ),
        cluster=ClusterInfo(name="local", num_devices=d.world_size, nodes=1, gpus_per_node=d.world_size, gpu="cpu"),
        degrees=d, mesh=MeshSpec.from_degrees(d), stages=stages, shardings=shardings,
        schedule=ScheduleSpec(name=schedule, microbatch_size=mb, num_microbatches=n_mb,
                              virtual_stages=len(cuts) // pp),
        global_batch=mb * n_mb * dp,
        prediction=Prediction(step_time_s=1.0, tokens_per_s=1.0, model_tflops_per_gpu=1.0, hw_tflops_per_gpu=1.0,
                              mfu=0.1, memory_gb_per_device=1.0, fits=True),
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def batches(batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def reference_run(family: str, *, tied: bool, batch: int, recompute: str = "none") -> dict:
    """The single-process model: losses, per-step gradients and final parameters by FQN."""
    from runtime.checkpointing import apply_activation_checkpointing
    from runtime.model_adapters import adapter_for

    model = tiny_model(family, tied=tied)
    apply_activation_checkpointing(model, layer_fqns=adapter_for(model).layout.layers, mode=recompute)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"losses": [], "grads": []}
    for ids, tgt in batches(batch):
        opt.zero_grad()
        loss = lm_loss(model(ids).logits, tgt)
        loss.backward()
        out["losses"].append(loss.item())
        # a tied head weight once, under the embedding's name (as the pipeline's ranks name it)
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# --- unit: the cut -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["opt", "llama", "mixtral", "gpt2"])
def test_chunks_chained_equal_full_model(family):
    from runtime.pipeline import cut_model

    model = tiny_model(family, tied=family in ("opt", "gpt2")).eval()
    plan = make_plan(model, cuts=[(0, 2), (2, 4), (4, 5), (5, 7)], pp=2, schedule="interleaved-1f1b", n_mb=2)
    chunks = cut_model(model, plan=plan)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    x = ids
    for c in chunks:
        x = c(x)
    torch.testing.assert_close(x, model(ids).logits, rtol=0, atol=0)
    # the chunks hold the model's own modules under the model's own names
    names = {n for c in chunks for n, _ in c.named_parameters()}
    assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}  # tied head included
    layers_of_chunk1 = (unit_fqns(model)[2][0] + ".", unit_fqns(model)[3][0] + ".")  # units [2, 4)
    assert set(dict(chunks[1].named_parameters())) == {
        n for n, _ in model.named_parameters() if n.startswith(layers_of_chunk1)
    }


def test_embedding_and_head_added_when_plan_names_only_layers():
    from runtime.model_adapters import adapter_for
    from runtime.pipeline import cut_units

    model = tiny_model("llama")
    lay = adapter_for(model).layout
    stages = (
        StagePlan(index=0, pp_rank=0, modules=lay.layers[:2], ranks=()),
        StagePlan(index=1, pp_rank=1, modules=lay.layers[2:], ranks=()),
    )
    assert cut_units(lay, stages) == [(0, 3), (3, 7)]
    # the planner lists the rotary embedding in its embedding group: accepted, it goes to every chunk
    stages = (
        StagePlan(index=0, pp_rank=0, modules=("model.embed_tokens", "model.rotary_emb", *lay.layers[:1]), ranks=()),
        StagePlan(index=1, pp_rank=1, modules=(*lay.layers[1:], "model.norm", "lm_head"), ranks=()),
    )
    assert cut_units(lay, stages) == [(0, 2), (2, 7)]


@pytest.mark.parametrize(
    "modules, match",
    [
        ((("model.embed_tokens", "model.layers.0", "model.layers.2"), ("model.layers.1", "model.layers.3")),
         "not contiguous"),
        ((("model.embed_tokens", "model.layers.0"), ("model.layers.2", "model.layers.3")), "leaves out"),
        ((("model.embed_tokens", "model.layers.0.mlp"), ("model.layers.1",)), "whole layers"),
        ((("model.embed_tokens", "model.layers.0", "model.layers.1"), ("model.layers.1", "model.layers.2",
                                                                        "model.layers.3")), "overlaps"),
        ((("model.embed", "model.layers.0"), ("model.layers.1",)), "not a unit"),
    ],
)
def test_bad_cuts_are_refused_with_the_module_named(modules, match):
    from runtime.model_adapters import adapter_for
    from runtime.pipeline import cut_units

    lay = adapter_for(tiny_model("llama")).layout
    stages = tuple(StagePlan(index=i, pp_rank=i, modules=m, ranks=()) for i, m in enumerate(modules))
    with pytest.raises(PlanMismatchError, match=match):
        cut_units(lay, stages)


def test_unsupported_model_and_schedule_errors():
    from costmodel.errors import UnsupportedModelError
    from runtime.pipeline import cut_model, make_schedule

    plan = make_plan(tiny_model("llama"), cuts=[(0, 3), (3, 7)], pp=2, schedule="gpipe", n_mb=2)
    with pytest.raises(UnsupportedModelError, match="supported layouts"):
        cut_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), plan=plan)
    with pytest.raises(ConfigError, match="one chunk per rank"):
        make_schedule([object(), object()], name="1f1b", num_microbatches=4, loss_fn=lm_loss)
    with pytest.raises(ConfigError, match="unknown"):
        make_schedule([object()], name="zb-v", num_microbatches=4, loss_fn=lm_loss)


def test_stage_placement_and_inputs_are_checked():
    import dataclasses

    from runtime.pipeline import _check_stage_ranks, _input_ids

    plan = make_plan(tiny_model("llama"), cuts=[(0, 3), (3, 7)], pp=2, schedule="gpipe", n_mb=2)
    swapped = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, pp_rank=1 - s.pp_rank)
                                                     for s in plan.stages))
    with pytest.raises(PlanMismatchError, match="stage 0 is placed on pp rank 1"):
        _check_stage_ranks(swapped)
    ids = torch.zeros(2, 4, dtype=torch.long)
    assert _input_ids((ids,)) is ids and _input_ids({"input_ids": ids}) is ids
    with pytest.raises(ConfigError, match="token-id tensor"):
        _input_ids((ids, ids))


# --- distributed: schedules against the single-process model ----------------------------------------------

# name: (family, tied, schedule, cuts, n_mb, mb, recompute per chunk, pp, dp, tp)
CASES_2 = {
    "opt-gpipe-tied": ("opt", True, "gpipe", [(0, 3), (3, 7)], 2, 2, None, 2, 1, 1),
    "opt-1f1b-recompute": ("opt", True, "1f1b", [(0, 3), (3, 7)], 4, 1, ("full", "selective"), 2, 1, 1),
    "llama-interleaved-2x2": ("llama", False, "interleaved-1f1b", [(0, 2), (2, 3), (3, 4), (4, 7)], 4, 1,
                              ("selective", "none", "full", "none"), 2, 1, 1),
    "mixtral-zero-bubble": ("mixtral", False, "zero-bubble", [(0, 3), (3, 7)], 4, 1, None, 2, 1, 1),
    "llama-1f1b-recompute-first-layer": ("llama", False, "1f1b", [(0, 3), (3, 7)], 2, 2,
                                         (("full", 1), ("selective", 1)), 2, 1, 1),
    "llama-zero-bubble-2x2": ("llama", False, "zero-bubble", [(0, 2), (2, 3), (3, 4), (4, 7)], 4, 1, None,
                              2, 1, 1),
}
CASES_4 = {
    "llama-tp2xpp2-1f1b": ("llama", False, "1f1b", [(0, 3), (3, 7)], 2, 2, ("full", "none"), 2, 1, 2),
    # tied: the vocab-parallel embedding's gradient (Replicate) is resharded like the head's (Shard(0)) before the
    # tied all-reduce
    "opt-tp2xpp2-sp-gpipe-tied": ("opt", True, "gpipe", [(0, 3), (3, 7)], 2, 2, ("selective", "full"), 2, 1, 2),
    "opt-pp2xdp2-1f1b-tied": ("opt", True, "1f1b", [(0, 3), (3, 7)], 2, 1, None, 2, 2, 1),
    "gpt2-pp4-1f1b-tied": ("gpt2", True, "1f1b", [(0, 2), (2, 3), (3, 4), (4, 7)], 4, 1, None, 4, 1, 1),
}


def _case_plan(case) -> Plan:
    """tp > 1: the Megatron styles (vocab-parallel embedding and head too); OPT with tp also runs sequence
    parallel."""
    import dataclasses

    from runtime.manual_plan import megatron_shardings

    family, tied, schedule, cuts, n_mb, mb, rec, pp, dp, tp = case
    model = tiny_model(family, tied=tied)
    sp = tp > 1 and family == "opt"
    shardings = megatron_shardings(model, sequence_parallel=sp) if tp > 1 else ()
    plan = make_plan(model, cuts=cuts, pp=pp, schedule=schedule, n_mb=n_mb, mb=mb, dp=dp, tp=tp,
                     recompute=rec, shardings=shardings)
    return dataclasses.replace(plan, sequence_parallel=sp)


def _record_actions(runner) -> list:
    """Wrap each local stage so that every F / B / W it runs is appended to the returned list."""
    log: list = []
    for st in runner.stages:
        fwd, bwd, wgt = st.forward_one_chunk, st.backward_one_chunk, st.backward_weight_one_chunk

        def f(mb, *a, _fwd=fwd, _i=st.stage_index, **k):
            log.append((_i, "F", mb))
            return _fwd(mb, *a, **k)

        def b(mb, *a, _bwd=bwd, _i=st.stage_index, **k):
            log.append((_i, "B", mb))
            return _bwd(mb, *a, **k)

        def w(mb, *a, _wgt=wgt, _i=st.stage_index, **k):
            log.append((_i, "W", mb))
            return _wgt(mb, *a, **k)

        st.forward_one_chunk, st.backward_one_chunk, st.backward_weight_one_chunk = f, b, w
    return log


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run_case(case) -> dict:
    return _run_plan(case[0], case[1], _case_plan(case))


def _run_plan(family: str, tied: bool, plan: Plan) -> dict:
    """3 SGD steps of ``plan`` through runtime.apply_plan on this rank: losses, local gradients, parameters,
    actions."""
    from runtime import apply_plan
    from runtime.checkpointing import recompute_mode
    from runtime_cases import count_attention_calls

    pm = apply_plan(tiny_model(family, tied=tied), plan, loss_fn=lm_loss)
    runner = pm.pipeline
    actions = _record_actions(runner)
    layers = {f: c.get_submodule(f) for c in runner.modules for f in c.layer_fqns}
    calls = count_attention_calls(layers, family)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    local_b = plan.schedule.microbatch_size * plan.schedule.num_microbatches
    d = pm.mesh.get_local_rank("dp")
    out = {"losses": [], "grads": [], "pp_rank": runner.pp_rank, "tp_rank": pm.mesh.get_local_rank("tp"),
           "has_last": runner.has_last, "logits_sharded": runner.logits_mesh is not None}
    for step, (ids, tgt) in enumerate(batches(plan.global_batch)):
        actions.clear()
        calls.update(dict.fromkeys(calls, 0))
        opt.zero_grad()
        loss = pm.step(ids[d * local_b:(d + 1) * local_b], tgt[d * local_b:(d + 1) * local_b])
        out["losses"].append(loss.item())
        out["grads"].append({n: _full(p.grad).clone() for n, p in pm.named_parameters() if p.grad is not None})
        if step == 1:  # not the first: the stages' shape inference runs one more forward there
            out["attention_calls"] = dict(calls)
        opt.step()
    out["params"] = {n: _full(p.detach()).clone() for n, p in pm.named_parameters()}
    out["actions"] = list(actions)
    out["recompute"] = {f: recompute_mode(m) for f, m in layers.items()}
    return out


def _apply_plan_meta_zero3(dp: int) -> list[float]:
    """Through runtime.apply_plan: a meta-device model, pp=2 x dp ZeRO-3 (FSDP2 on each chunk), materialised
    per chunk; the losses of 3 steps (compared with the single-process model in the parent)."""
    from runtime import apply_plan
    from runtime.manual_plan import manual_plan

    with torch.device("meta"):
        model = tiny_model("llama")
    plan = manual_plan(model, pp=2, dp=dp, zero_stage=3, num_microbatches=2, microbatch_size=1, seq_len=SEQ)
    pm = apply_plan(model, plan, loss_fn=lm_loss, seed=0)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses = []
    for ids, tgt in batches(plan.global_batch):
        opt.zero_grad()
        losses.append(pm.step(ids, tgt).item())
        opt.step()
    return losses


def _pp_body(rank: int, world_size: int, names: list[str]) -> dict:
    cases = CASES_2 if world_size == 2 else CASES_4
    import time

    out = {}
    for name in names:
        t0 = time.perf_counter()
        out[name] = _run_case(cases[name])
        out[name]["time_s"] = time.perf_counter() - t0
    if world_size == 4:
        out["apply_plan_meta_zero3"] = _apply_plan_meta_zero3(dp=2)
        out["zero_bubble_fsdp_refused"] = _zero_bubble_fsdp_error()
    return out


def _zero_bubble_fsdp_error() -> str:
    from runtime import apply_plan
    from runtime.manual_plan import manual_plan

    with torch.device("meta"):
        model = tiny_model("llama")
    plan = manual_plan(model, pp=2, dp=2, zero_stage=3, num_microbatches=2, microbatch_size=1, seq_len=SEQ,
                       schedule="zero-bubble")
    try:
        apply_plan(model, plan, loss_fn=lm_loss, seed=0)
    except ConfigError as e:
        return str(e)
    return "not refused"


def _check_case(name: str, case, per_rank: list[dict]) -> None:
    _check_plan(name, case[0], case[1], _case_plan(case), per_rank)


def _recompute_wanted(plan: Plan, family: str) -> dict[str, str]:
    """Layer FQN -> the mode the plan asks for: a stage's first ``recompute_layers`` (-1: all) layers."""
    layers = unit_fqns(tiny_model(family))[1:-1]
    out = {}
    for st in plan.stages:
        mine = [u[0] for u in layers if u[0] in st.modules]
        k = len(mine) if st.recompute_layers == -1 else st.recompute_layers
        out.update({f: st.recompute if i < k else "none" for i, f in enumerate(mine)})
    return out


def _check_plan(name: str, family: str, tied: bool, plan: Plan, per_rank: list[dict]) -> None:
    from costmodel.pipeline import Action, inflight_microbatches, rank_orders

    schedule, n_mb, pp = plan.schedule.name, plan.schedule.num_microbatches, plan.degrees.pp
    ref = reference_run(family, tied=tied, batch=plan.global_batch)
    want = _recompute_wanted(plan, family)
    # under tp the last stage's head leaves the logits vocabulary-sharded and the loss runs loss-parallel (as
    # priced: planner.search.strategies' vocab_head and vocab_parallel loss), on gloo too
    for r, res in enumerate(per_rank):
        assert res["logits_sharded"] == (res["has_last"] and plan.degrees.tp > 1), f"{name} rank {r}"
    for r, res in enumerate(per_rank):  # each stage's first recompute_layers layers, and only those, recompute
        assert res["recompute"] == {f: want[f] for f in res["recompute"]}, f"{name} rank {r}: {res['recompute']}"
        calls = {f: n_mb * (2 if want[f] != "none" else 1) for f in res["recompute"]}
        assert res["attention_calls"] == calls, f"{name} rank {r}: attention forward calls {res['attention_calls']}"
    assert set(want) == {f for res in per_rank for f in res["recompute"]}
    for r, res in enumerate(per_rank):
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name} rank {r} losses: {m}")
    for step in range(STEPS):
        got = {n: g for res in per_rank for n, g in res["grads"][step].items()}
        assert set(got) == set(ref["grads"][step]), f"{name}: gradients missing {set(ref['grads'][step]) - set(got)}"
        torch.testing.assert_close(got, ref["grads"][step], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name} step {step} grads: {m}")
    params = {n: p for res in per_rank for n, p in res["params"].items()}
    torch.testing.assert_close(params, {n: ref["params"][n] for n in params}, rtol=RTOL, atol=ATOL)
    # the order each pp rank ran is the order the cost model simulates; in-flight peak matches its closed form
    v = plan.schedule.virtual_stages
    orders = rank_orders(schedule, pp=pp, num_microbatches=n_mb, virtual_stages=v)
    for res in per_rank:
        r = res["pp_rank"]
        ran = [Action(chunk=c, kind=k, microbatch=m) for c, k, m in res["actions"]]
        assert ran == list(orders[r]), f"{name} pp rank {r}: ran {res['actions']}, cost model {orders[r]}"
        held = peak = 0
        split = "W" in {a.kind for a in ran}
        for a in ran:
            held += a.kind == "F"
            held -= a.kind == ("W" if split else "B")
            peak = max(peak, held)
        assert peak / v == inflight_microbatches(schedule, pp=pp, stage=r, num_microbatches=n_mb,
                                                 virtual_stages=v), f"{name} pp rank {r}: in-flight {peak / v}"


@pytest.mark.distributed
def test_pipeline_schedules_2_ranks_match_single_process():
    from dist_utils import run_distributed

    names = list(CASES_2)
    results = run_distributed(_pp_body, world_size=2, args=(names,), timeout_s=240)
    print({n: round(results[0][n]["time_s"], 2) for n in names})
    for name in names:
        _check_case(name, CASES_2[name], [results[r][name] for r in range(2)])


@pytest.mark.distributed
def test_pipeline_tp_dp_pp4_4_ranks_match_single_process():
    from dist_utils import run_distributed

    names = list(CASES_4)
    results = run_distributed(_pp_body, world_size=4, args=(names,), timeout_s=300)
    print({n: round(results[0][n]["time_s"], 2) for n in names})
    for name in names:
        _check_case(name, CASES_4[name], [results[r][name] for r in range(4)])
    # apply_plan on a meta model: reference = the same model materialised with the same seed, one process
    from runtime.materialize import materialize

    with torch.device("meta"):
        ref = tiny_model("llama")
    materialize(ref, seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    want = []
    for ids, tgt in batches(4):
        opt.zero_grad()
        loss = lm_loss(ref(ids).logits, tgt)
        loss.backward()
        want.append(loss.item())
        opt.step()
    for r in range(4):
        torch.testing.assert_close(torch.tensor(results[r]["apply_plan_meta_zero3"]), torch.tensor(want),
                                   rtol=RTOL, atol=ATOL)
        assert "zero-bubble' with FSDP" in results[r]["zero_bubble_fsdp_refused"]


# --- unit: torch's multi-chunk schedule orders == the cost model's -----------------------------------------


def _torch_rank_orders(cls, *, pp: int, m: int, v: int):
    """The compute actions torch's schedule class lays out per rank (its private order builder, no stages needed;
    the distributed tests above record what actually ran for a few configurations)."""
    from costmodel.pipeline import Action
    from torch.distributed.pipelining import schedules as S

    kind = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B",
            S._ComputationType.BACKWARD_INPUT: "B", S._ComputationType.BACKWARD_WEIGHT: "W"}
    s = object.__new__(cls)
    s.pp_group_size, s.n_local_stages, s._n_microbatches = pp, v, m
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    return tuple(
        tuple(Action(chunk=a.stage_index, kind=kind[a.computation_type], microbatch=a.microbatch_index)
              for a in s._calculate_single_rank_operations(r) if a is not None)
        for r in range(pp)
    )


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble"])
def test_cost_model_orders_and_inflight_match_torch_multi_chunk_schedules(schedule):
    from costmodel.pipeline import inflight_microbatches, rank_orders
    from torch.distributed.pipelining import schedules as S

    cls = S.ScheduleInterleaved1F1B if schedule == "interleaved-1f1b" else S.ScheduleInterleavedZeroBubble
    checked = 0
    for pp in (2, 3, 4, 8):
        for v in (1, 2, 3):
            for m in (pp, 2 * pp, 3 * pp, 4 * pp):
                want = _torch_rank_orders(cls, pp=pp, m=m, v=v)
                assert rank_orders(schedule, pp=pp, num_microbatches=m, virtual_stages=v) == want, (pp, v, m)
                for r in range(pp):
                    held = peak = 0
                    for a in want[r]:
                        held += a.kind == "F"
                        held -= a.kind == ("W" if schedule == "zero-bubble" else "B")
                        peak = max(peak, held)
                    got = inflight_microbatches(schedule, pp=pp, stage=r, num_microbatches=m, virtual_stages=v)
                    assert got == peak / v, (pp, v, m, r)
                checked += 1
    assert checked == 48


def _planned_body(rank: int, world_size: int, plan_dict: dict) -> dict:
    plan = Plan.from_dict(plan_dict)
    return _run_plan("llama", False, plan)


@pytest.mark.distributed
@pytest.mark.slow
def test_planner_made_pipeline_plan_runs_and_matches_single_process():
    """A plan from planner.plan_model (interleaved 1F1B pinned) for the tiny Llama: its FQN cuts (with
    ``model.rotary_emb`` listed in the embedding group) run on 2 ranks with the single-process numbers."""
    from costmodel.profiles import resolve_cluster
    from dist_utils import run_distributed
    from planner.search.driver import plan_model

    spec = "llama:layers=4,hidden=64,ffn=128,heads=4,kv_heads=2,vocab=128,seq=16"
    cluster = resolve_cluster("local", nodes=1, gpus_per_node=2)
    plan = plan_model(spec, cluster, global_batch=4, fix="pp=2,tp=1,dp=1,schedule=interleaved-1f1b,virtual_stages=2")
    model = tiny_model("llama")
    assert plan.model.fingerprint == module_fingerprint(model)
    assert plan.degrees.pp == 2 and plan.schedule.virtual_stages == 2
    results = run_distributed(_planned_body, world_size=2, args=(plan.to_dict(),), timeout_s=300)
    _check_plan("planner-made", "llama", False, plan, results)
