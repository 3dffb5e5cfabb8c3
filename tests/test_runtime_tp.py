"""Tensor / sequence parallel (and TP x DP) on gloo ranks against the single-process model.

One spawned run per world size does the checks of all runtime test files (tests/runtime_spawn.py). Each check trains
``runtime_cases.STEPS`` optimizer steps (SGD with momentum); loss, gathered gradients and final parameters must match the reference
(rtol=1e-4, atol=1e-5, see tests/runtime_cases.py).
"""

from __future__ import annotations

import pytest
import torch

import runtime_cases as rc
from runtime_spawn import parts_all_ranks

pytestmark = pytest.mark.distributed

# (check name, model, plan keyword arguments); global batch = microbatch_size * num_microbatches * dp
TP2_CASES = [
    ("opt tp2", "opt", dict(tp=2, microbatch_size=2, num_microbatches=2)),
    ("opt tp2 sp", "opt", dict(tp=2, sequence_parallel=True, microbatch_size=4)),
    ("llama tp2 sp", "llama", dict(tp=2, sequence_parallel=True, microbatch_size=2, num_microbatches=2)),
    ("llama tp2 recompute full (pp=1)", "llama", dict(tp=2, recompute="full", microbatch_size=4)),
    ("mixtral tp2 (attention)", "mixtral", dict(tp=2, microbatch_size=4)),
    ("opt tied embeddings tp2 sp", "opt_tied", dict(tp=2, sequence_parallel=True, microbatch_size=4)),
    (
        "opt tp2 sp, replicated embedding and head",
        "opt",
        dict(tp=2, sequence_parallel=True, microbatch_size=4, replicate=("model.decoder.embed_tokens", "lm_head")),
    ),
]
TP2_DP2_CASES = [
    ("opt tp2 x dp2 zero3 sp", "opt", dict(tp=2, dp=2, zero_stage=3, sequence_parallel=True, microbatch_size=2)),
    ("llama tp2 x dp2 zero0", "llama", dict(tp=2, dp=2, zero_stage=0, microbatch_size=1, num_microbatches=2)),
]


def _global_batch(kw: dict) -> int:
    return kw.get("microbatch_size", 1) * kw.get("num_microbatches", 1) * kw.get("dp", 1)


def _run_cases(cases: list) -> dict:
    import time

    from planner.plan import ModuleSharding
    from runtime import apply_plan
    from runtime.manual_plan import manual_plan, megatron_shardings

    out = {}
    for name, model_name, kw in cases:
        kw = dict(kw)
        replicated = kw.pop("replicate", ())
        t0 = time.perf_counter()
        model = rc.MODELS[model_name]()
        shardings = None
        if replicated:  # the planner's choice for small vocabularies: some modules left whole
            shardings = tuple(
                ModuleSharding(fqn=m.fqn, style="replicate") if m.fqn in replicated else m
                for m in megatron_shardings(model, sequence_parallel=kw.get("sequence_parallel", False))
            )
        pm = apply_plan(model, manual_plan(model, shardings=shardings, **kw), loss_fn=rc.loss_fn)
        t1 = time.perf_counter()
        out[name] = rc.parallel_run(pm, _global_batch(kw))
        out[name]["time_s"] = (t1 - t0, time.perf_counter() - t1)
    return out


def _tp2_body(rank: int, world_size: int, tmp: str) -> dict:
    from torch.distributed.tensor import DTensor

    from costmodel.errors import ConfigError
    from runtime.manual_plan import manual_plan
    from runtime.materialize import local_numel, materialize
    from runtime.mesh import build_mesh
    from runtime.tensor_parallel import apply_tensor_parallel, loss_parallel_works
    from runtime import ParallelModel

    out = {"runs": _run_cases(TP2_CASES)}
    # gathered-logits fallback (what runs where loss-parallel is unavailable)
    model = rc.opt_model()
    plan = manual_plan(model, tp=2, microbatch_size=4)
    mesh = build_mesh(plan, device_type="cpu")
    out["loss_parallel_works"] = loss_parallel_works(mesh["tp"])
    apply_tensor_parallel(model, plan=plan, mesh=mesh, loss_parallel_ok=False)
    materialize(model, seed=0)
    out["runs"]["opt tp2 gathered logits"] = rc.parallel_run(
        ParallelModel(module=model, plan=plan, mesh=mesh, loss_fn=rc.loss_fn), 4
    )
    # meta model -> only local shards: every parameter's local shape
    model = rc.opt_model()
    apply_tensor_parallel(model, plan=plan, mesh=mesh)
    materialize(model, seed=0)
    out["local_shapes"] = {
        n: (tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape), tuple(p.shape))
        for n, p in model.named_parameters()
    }
    out["local_numel"] = local_numel(model)
    # Mixtral experts are replicated: under sequence parallel their gradients would be partial -> refused
    model = rc.mixtral_model()
    try:
        apply_tensor_parallel(model, plan=manual_plan(model, tp=2, sequence_parallel=True), mesh=mesh)
        out["mixtral_sp_error"] = None
    except ConfigError as e:
        out["mixtral_sp_error"] = str(e)
    return out


def _tp2_dp2_body(rank: int, world_size: int, tmp: str) -> dict:
    return {"runs": _run_cases(TP2_DP2_CASES)}


def _check_runs(results: list, cases: list) -> None:
    refs = {}
    for name, model_name, kw in cases:
        key = (model_name, _global_batch(kw))
        if key not in refs:
            refs[key] = rc.reference_run(model_name, key[1])
        for rank, res in enumerate(results):
            rc.compare(res["runs"][name], refs[key], what=f"{name} rank {rank}")


def test_tensor_parallel_two_ranks():
    results = parts_all_ranks(2, "test_runtime_tp:_tp2_body")
    _check_runs(results, TP2_CASES + [("opt tp2 gathered logits", "opt", dict(microbatch_size=4))])
    r0 = results[0]
    assert r0["loss_parallel_works"] is True  # gloo / CPU, torch 2.13
    shapes = r0["local_shapes"]
    assert shapes["model.decoder.layers.0.self_attn.q_proj.weight"] == ((32, 64), (64, 64))
    assert shapes["model.decoder.layers.0.self_attn.out_proj.weight"] == ((64, 32), (64, 64))
    assert shapes["model.decoder.layers.0.fc1.bias"] == ((128,), (256,))
    assert shapes["model.decoder.embed_tokens.weight"] == ((64, 64), (128, 64))
    assert shapes["lm_head.weight"] == ((64, 64), (128, 64))
    assert shapes["model.decoder.layers.0.final_layer_norm.weight"] == ((64,), (64,))
    full_numel = sum(torch.Size(s[1]).numel() for s in shapes.values())
    assert r0["local_numel"] == sum(torch.Size(s[0]).numel() for s in shapes.values()) < 0.6 * full_numel
    assert r0["mixtral_sp_error"] is not None and "mlp.gate" in r0["mixtral_sp_error"]


def test_tensor_x_data_parallel_four_ranks():
    results = parts_all_ranks(4, "test_runtime_tp:_tp2_dp2_body")
    _check_runs(results, TP2_DP2_CASES)
