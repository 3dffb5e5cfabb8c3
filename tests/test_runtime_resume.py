"""Resume in training code: ``auto_wrap(..., checkpoint_dir=, checkpoint_every=)``, ``pm.resume(opt)``, ``pm.close()``.

One spawned run on 2 gloo ranks (dp2 ZeRO-2):
- run A trains 3 steps from scratch with checkpoint_every=2: ``resume`` returns 0; a save happens at the start of
  step 3 (state after 2 steps) and ``close`` saves step 3; only complete (marked) saves are on disk;
- an interrupted save is planted: ``step_00000009`` with DCP files but no ``autopar.json`` marker;
- run B (a fresh model with another init seed, same directory) resumes: ``resume`` returns 3 (the planted step 9
  is invisible), its parameters and optimizer momentum equal A's after 3 steps bitwise, and its step 4 loss equals
  that of A continuing (bitwise: same plan, same world size, same reduction order);
- refusals: ``resume`` without a checkpoint directory, a step before ``resume`` when one is set (ConfigError).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

import runtime_cases as rc
from dist_utils import run_distributed

pytestmark = pytest.mark.distributed

GLOBAL_BATCH = 4


def _wrap(ckpt: str | None, *, seed: int = 0, every: int = 2):
    from runtime import auto_wrap
    from runtime.manual_plan import manual_plan

    model = rc.opt_model()
    plan = manual_plan(model, dp=2, zero_stage=2, microbatch_size=2)
    kw = {"checkpoint_dir": ckpt, "checkpoint_every": every} if ckpt else {}
    return auto_wrap(model, None, loss_fn=rc.loss_fn, plan=plan, seed=seed, **kw)


def _momentum(pm, opt) -> dict:
    return {n: rc.full(opt.state[p]["momentum_buffer"]) for n, p in pm.named_parameters()}


def _body(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from costmodel.errors import ConfigError

    data = rc.batches(GLOBAL_BATCH, steps=4)
    out: dict = {}
    a = _wrap(f"{tmp}/ck")
    opt_a = rc.make_optimizer(a.parameters())
    out["a_start"] = a.resume(opt_a)
    for step in range(out["a_start"], 3):
        a.step(*data[step])
        opt_a.step()
        opt_a.zero_grad()
    a.close()
    out["a_params"] = {n: rc.full(p) for n, p in a.named_parameters()}
    out["a_momentum"] = _momentum(a, opt_a)
    out["dirs"] = sorted(p.name for p in Path(tmp, "ck").iterdir() if (p / "autopar.json").is_file())
    # an interrupted save of a later step: data and DCP metadata on disk, but never marked complete
    dcp.save(a.state_dict(), checkpoint_id=f"{tmp}/ck/step_00000009")
    dist.barrier()
    out["a_loss4"] = a.step(*data[3]).clone()

    b = _wrap(f"{tmp}/ck", seed=123)
    opt_b = rc.make_optimizer(b.parameters())
    out["b_start"] = b.resume(opt_b)
    out["b_steps_done"] = b.steps_done
    out["b_params"] = {n: rc.full(p) for n, p in b.named_parameters()}
    out["b_momentum"] = _momentum(b, opt_b)
    out["b_loss4"] = b.step(*data[3]).clone()
    b.close()

    plain = _wrap(None)
    try:
        plain.resume(rc.make_optimizer(plain.parameters()))
    except ConfigError as e:
        out["no_dir"] = str(e)
    c = _wrap(f"{tmp}/other")
    try:
        c.step(*data[0])
    except ConfigError as e:
        out["no_resume"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as tmp:
        yield run_distributed(_body, world_size=2, args=(tmp,), timeout_s=240)


def test_saves_every_n_and_at_close(results):
    assert results[0]["a_start"] == 0
    assert results[0]["dirs"] == ["step_00000002", "step_00000003"]


def test_resume_loads_latest_complete_checkpoint_bitwise(results):
    for r in results:
        assert r["b_start"] == 3 and r["b_steps_done"] == 3, "the unmarked step_00000009 must stay invisible"
        for n, want in r["a_params"].items():
            assert torch.equal(r["b_params"][n], want), n
            assert torch.equal(r["b_momentum"][n], r["a_momentum"][n]), n
        assert torch.equal(r["b_loss4"], r["a_loss4"])


def test_refusals_name_the_fix(results):
    assert "checkpoint_dir" in results[0]["no_dir"]
    assert "pm.resume(optimizer)" in results[0]["no_resume"]
