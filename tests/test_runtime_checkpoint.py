"""Checkpoint / resume on gloo ranks: a killed run resumes with the same losses; a checkpoint saved on 4 ranks as
tp2 x pp2 resumes on 2 ranks as dp2 (resharded on load) with the losses of continuing on 4.

Spawned runs (process start dominates): B = 2 ranks dp2, 6 steps saving every 2, rank 1 calls ``os._exit`` at
step 5 (the run dies: RankError); D = 4 ranks tp2 x pp2, 4 steps, saving every 2; C = 2 ranks: resume B's directory
to step 6, run the same 6 steps uninterrupted in a fresh directory, then load D's step-2 checkpoint as dp2 and run
steps 2-3.
Tolerances: the fault resume runs the same plan with the same reduction order, so losses must be bitwise equal
(``torch.equal``); the reshard resume changes the plan (tp/pp -> dp): rtol=1e-4, atol=1e-5 (runtime_cases).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from dist_utils import RankError, run_distributed
from runtime_cases import ATOL, RTOL, batches, loss_fn, make_optimizer, opt_model

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # ~90 s on 2 loaded cores: three spawned runs

GLOBAL_BATCH = 2


def _plan(kind: str, model):
    from runtime.manual_plan import manual_plan

    if kind == "dp2":
        return manual_plan(model, dp=2, microbatch_size=1, num_microbatches=1)
    if kind == "tp2pp2":
        return manual_plan(model, tp=2, pp=2, microbatch_size=1, num_microbatches=2, schedule="1f1b")
    raise ValueError(kind)


def _train(rank: int, world: int, *, kind: str, ckpt_dir: str, total: int, every: int,
           kill_at: int | None = None) -> dict:
    from runtime.checkpoint import Checkpointer
    from runtime import apply_plan

    model = opt_model()
    pm = apply_plan(model, _plan(kind, model), loss_fn=loss_fn)
    opt = make_optimizer(pm.parameters())
    ckpt = Checkpointer(ckpt_dir, every_steps=every, async_save=True)
    start = ckpt.load_latest(pm, opt)
    data = batches(GLOBAL_BATCH, steps=total)
    losses = {}
    for step in range(start, total):
        if kill_at is not None and step == kill_at and rank == world - 1:
            os._exit(17)  # a rank dies mid-run, no cleanup
        losses[step] = pm.step(*data[step]).detach().clone()
        opt.step()
        opt.zero_grad()
        ckpt.maybe_save(pm, opt, step=step + 1)
    ckpt.wait()
    return {"start": start, "losses": losses}


def _body_b(rank: int, world: int, tmp: str) -> dict:
    return _train(rank, world, kind="dp2", ckpt_dir=f"{tmp}/b", total=6, every=2, kill_at=5)


def _body_d(rank: int, world: int, tmp: str) -> dict:
    return _train(rank, world, kind="tp2pp2", ckpt_dir=f"{tmp}/d", total=4, every=2)


def _body_c(rank: int, world: int, tmp: str) -> dict:
    resumed = _train(rank, world, kind="dp2", ckpt_dir=f"{tmp}/b", total=6, every=2)
    uninterrupted = _train(rank, world, kind="dp2", ckpt_dir=f"{tmp}/a", total=6, every=2)
    # D kept step_2 and step_4 (keep=2); drop step_4 so that the latest is step 2 and steps 2-3 can be compared
    if rank == 0:
        import shutil

        shutil.rmtree(f"{tmp}/d/step_00000004")
    torch.distributed.barrier()
    resharded = _train(rank, world, kind="dp2", ckpt_dir=f"{tmp}/d", total=4, every=100)
    return {"resumed": resumed, "resharded": resharded, "uninterrupted": uninterrupted}


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(RankError, match="exited with code 17|rank 1"):
            run_distributed(_body_b, world_size=2, args=(tmp,), timeout_s=180)
        complete_b = sorted(p.name for p in Path(tmp, "b").iterdir() if (p / "autopar.json").is_file())
        d = run_distributed(_body_d, world_size=4, args=(tmp,), timeout_s=240)
        c = run_distributed(_body_c, world_size=2, args=(tmp,), timeout_s=240)
        yield {"c": c, "d": d, "complete_b": complete_b}


def test_killed_run_resumes_with_identical_losses(runs):
    assert runs["complete_b"], "the killed run left no complete checkpoint"
    for rank in range(2):
        resumed = runs["c"][rank]["resumed"]
        assert resumed["start"] in (2, 4), resumed["start"]
        assert sorted(resumed["losses"]) == list(range(resumed["start"], 6))
        for step, loss in resumed["losses"].items():
            want = runs["c"][rank]["uninterrupted"]["losses"][step]
            assert torch.equal(loss, want), f"rank {rank} step {step}: resumed {loss} vs uninterrupted {want}"


def test_reshard_tp2pp2_on_4_to_dp2_on_2(runs):
    want = runs["d"][0]["losses"]
    for rank in range(2):
        got = runs["c"][rank]["resharded"]
        assert got["start"] == 2
        for step in (2, 3):
            torch.testing.assert_close(got["losses"][step], want[step], rtol=RTOL, atol=ATOL)


def test_uninterrupted_dp2_losses_agree_across_ranks(runs):
    for step in range(6):
        a = [runs["c"][r]["uninterrupted"]["losses"][step] for r in range(2)]
        assert torch.equal(a[0], a[1])
