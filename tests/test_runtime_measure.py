"""The measurement wing's process helper (runtime/measure/spawn.py): results by rank, progress as it happens, a
rank that raises or dies or hangs named in a typed error; and the dispatch timing's tensor-parallel fixture is
the runtime's own tensor parallelism."""

from __future__ import annotations

import os
import time

import pytest

from runtime.measure.spawn import RankError, RankTimeout, run_ranks


def _body(rank: int, world: int, mode: str, *, progress=None):
    import torch.distributed as dist

    if mode == "progress":
        for i in range(3):
            progress((rank, i))
    if mode == "raise" and rank == 1:
        raise ValueError("rank one says no")
    if mode == "die" and rank == 1:
        os._exit(17)
    if mode == "hang" and rank == 1:
        time.sleep(300)
    return {"rank": rank, "world": world, "group": dist.get_world_size() if dist.is_initialized() else None,
            "threads": os.environ["OMP_NUM_THREADS"]}


@pytest.mark.distributed
def test_run_ranks_results_progress_and_failures():
    seen = []
    got = run_ranks(_body, world_size=2, args=("progress",), backend="gloo", threads=1, progress=seen.append)
    assert got == [{"rank": r, "world": 2, "group": 2, "threads": "1"} for r in range(2)]
    assert sorted(seen) == [(r, i) for r in range(2) for i in range(3)]
    with pytest.raises(RankError, match=r"(?s)job x: 1 of 2 ranks failed.*rank 1.*rank one says no"):
        run_ranks(_body, world_size=2, args=("raise",), what="job x")
    with pytest.raises(RankError, match=r"(?s)rank 1.*exited with code 17"):
        run_ranks(_body, world_size=2, args=("die",))
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[(0, )?1\] did not finish within 30 s"):
        run_ranks(_body, world_size=2, args=("hang",), timeout_s=30)
    assert time.monotonic() - t0 < 60  # terminated, not waited for


def test_dispatch_fixture_is_the_runtime_tensor_parallelism():
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from runtime.measure.compute import _tensor_parallel_fixture
    from runtime_cases import llama_model

    model = llama_model(device="cpu")
    try:
        _tensor_parallel_fixture(model)
        sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
        ids = torch.randint(0, 100, (1, 8))
        assert model(ids).logits.shape == (1, 8, 128)
    finally:
        dist.destroy_process_group()
    assert "model.layers.0.self_attn.q_proj.weight" in sharded and "model.layers.1.mlp.down_proj.weight" in sharded
    assert "model.embed_tokens.weight" in sharded and "lm_head.weight" in sharded
    assert "model.norm.weight" not in sharded  # no sequence parallel
