"""Data parallel per ZeRO stage (FSDP2 for ZeRO 3 / 2, DDP for ZeRO 0) on 2 gloo ranks vs the single process; with
ZeRO-3 also full recomputation of the first of the two layers only (``StagePlan.recompute_layers=1``).

Loss, gathered gradients and final parameters over ``runtime_cases.STEPS`` optimizer steps (rtol=1e-4,
atol=1e-5); the global batch is given to ``step`` on every rank, each rank trains on its half.
"""

from __future__ import annotations

import pytest

import runtime_cases as rc
from runtime_spawn import parts_all_ranks

pytestmark = pytest.mark.distributed

DP2_CASES = [
    ("opt dp2 zero3 (FSDP2)", "opt", dict(dp=2, zero_stage=3, microbatch_size=2, num_microbatches=2)),
    ("llama dp2 zero0 (DDP)", "llama", dict(dp=2, zero_stage=0, microbatch_size=1, num_microbatches=2)),
    ("llama dp2 zero2 (FSDP2 no reshard)", "llama", dict(dp=2, zero_stage=2, microbatch_size=2)),
    ("llama dp2 zero3 recompute full, first layer only", "llama",
     dict(dp=2, zero_stage=3, microbatch_size=2, recompute="full", recompute_layers=1)),
]


def _dp2_body(rank: int, world_size: int, tmp: str) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from runtime import apply_plan
    from runtime.checkpointing import recompute_mode, transformer_layers
    from runtime.manual_plan import manual_plan
    from runtime.materialize import local_numel

    out: dict = {"runs": {}, "kinds": {}, "local_numel": {}, "recompute": {}}
    for name, model_name, kw in DP2_CASES:
        model = rc.MODELS[model_name]()
        pm = apply_plan(model, manual_plan(model, **kw), loss_fn=rc.loss_fn)
        out["recompute"][name] = [recompute_mode(model.get_submodule(f)) for f in transformer_layers(model)]
        out["kinds"][name] = (isinstance(pm.module, DistributedDataParallel), isinstance(pm.module, FSDPModule))
        out["local_numel"][name] = local_numel(pm.module)
        out["runs"][name] = rc.parallel_run(pm, kw["microbatch_size"] * kw.get("num_microbatches", 1) * 2)
    return out


def test_data_parallel_two_ranks():
    results = parts_all_ranks(2, "test_runtime_dp:_dp2_body")
    for name, model_name, kw in DP2_CASES:
        ref = rc.reference_run(model_name, kw["microbatch_size"] * kw.get("num_microbatches", 1) * 2)
        for rank, res in enumerate(results):
            rc.compare(res["runs"][name], ref, what=f"{name} rank {rank}")
    r0 = results[0]
    assert r0["recompute"]["llama dp2 zero3 recompute full, first layer only"] == ["full", "none"]
    assert r0["recompute"]["llama dp2 zero2 (FSDP2 no reshard)"] == ["none", "none"]
    assert r0["kinds"]["llama dp2 zero0 (DDP)"] == (True, False)
    assert r0["kinds"]["opt dp2 zero3 (FSDP2)"] == (False, True)
    # FSDP2 keeps half of every parameter per rank (dim-0 chunks), DDP the whole model
    full = {n: rc.MODELS[m]() for n, m, _ in DP2_CASES}
    full_numel = {n: sum(p.numel() for p in m.parameters()) for n, m in full.items()}
    assert r0["local_numel"]["llama dp2 zero0 (DDP)"] == full_numel["llama dp2 zero0 (DDP)"]
    for name in ("opt dp2 zero3 (FSDP2)", "llama dp2 zero2 (FSDP2 no reshard)",
                 "llama dp2 zero3 recompute full, first layer only"):
        assert sum(res["local_numel"][name] for res in results) == full_numel[name]
        assert r0["local_numel"][name] < 0.6 * full_numel[name]


def _bucketed_body(rank: int, world_size: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import runtime.data_parallel as rdp
    from runtime.measure.comm_trace import CollectiveRecorder

    rdp.FIRST_BUCKET_BYTES, rdp.BUCKET_BYTES = 64, 256  # buckets that cut through the tensors
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(shape, generator=gen) for shape in ((7, 5), (3,), (40,), (2, 2, 9), (1,))]
    before = [g.clone() for g in grads]
    rec = CollectiveRecorder()
    with rec:
        rdp._all_reduce_bucketed(grads, mesh)
    numel = sum(g.numel() for g in grads)
    return {"before": before, "after": grads, "calls": [e[0] for e in rec.events],
            "buckets": rdp.gradient_buckets(numel, 4)}


def test_gradients_averaged_by_hand_in_buckets():
    """ZeRO-0 averaging by hand (pipeline, expert parallel): one all-reduce per bucket of the flat gradients, buckets
    that split tensors, each gradient the mean over the ranks afterwards."""
    import torch

    from dist_utils import run_distributed

    out = run_distributed(_bucketed_body, world_size=2, timeout_s=120)
    numel = 7 * 5 + 3 + 40 + 2 * 2 * 9 + 1  # 115 fp32: a 16-element bucket, then 64 each
    assert out[0]["buckets"] == [(0, 16), (16, 80), (80, 115)]
    assert out[0]["calls"] == ["all_reduce"] * 3 and sum(b - a for a, b in out[0]["buckets"]) == numel
    for i in range(5):
        mean = (out[0]["before"][i] + out[1]["before"][i]) / 2
        for r in range(2):
            torch.testing.assert_close(out[r]["after"][i], mean)
