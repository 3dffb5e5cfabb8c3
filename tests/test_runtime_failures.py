"""Failures say what happened: on 2 gloo ranks (dp2, DDP) rank 1 dies (``os._exit``) or hangs (sleeps) at the start
of step 2; rank 0's ``pm.step`` raises ``RankFailureError`` naming rank 1 and step 2, within a bounded time (the
process group's timeout, 4 s here, plus ``runtime.failures.FAILURE_GRACE_S``), instead of waiting forever.
Plus the pure checks: which exceptions count as a failed collective.
"""

from __future__ import annotations

import re
import time

import pytest

import runtime_cases as rc
from dist_utils import RankError, run_distributed

pytestmark = pytest.mark.distributed

TIMEOUT_S = 4.0


def _body(rank: int, world: int, mode: str) -> dict:
    import os

    from costmodel.errors import RankFailureError
    from runtime import apply_plan, init_distributed
    from runtime.manual_plan import manual_plan

    init_distributed(timeout_s=TIMEOUT_S)
    model = rc.opt_model()
    pm = apply_plan(model, manual_plan(model, dp=2, microbatch_size=1), loss_fn=rc.loss_fn)
    opt = rc.make_optimizer(pm.parameters())
    data = rc.batches(2, steps=3)
    for step in range(3):
        if step == 1 and rank == 1:
            if mode == "die":
                os._exit(17)
            time.sleep(60)  # hangs; the test harness terminates it
        t0 = time.monotonic()
        try:
            pm.step(*data[step])
        except RankFailureError as e:
            raise RankFailureError(f"{e} [noticed after {time.monotonic() - t0:.1f} s]") from None
        opt.step()
        opt.zero_grad()
    return {}


@pytest.mark.parametrize("mode", ["die", pytest.param("hang", marks=pytest.mark.slow)])  # hang: + the 4 s timeout
def test_dead_or_hung_rank_is_named_with_the_step(mode):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_distributed(_body, world_size=2, args=(mode,), init_process_group=False, timeout_s=120)
    elapsed = time.monotonic() - t0
    text = str(info.value)
    assert "RankFailureError: rank 1 of 2 stopped in step 2: died or hung" in text, text[-3000:]
    noticed = float(re.search(r"\[noticed after ([0-9.]+) s\]", text).group(1))
    from runtime.failures import FAILURE_GRACE_S

    bound = (TIMEOUT_S if mode == "hang" else 0.0) + FAILURE_GRACE_S + 5.0
    assert noticed <= bound, f"rank 0 took {noticed} s to name the failure (bound {bound} s)"
    assert elapsed < 90


def test_which_errors_count_as_failed_collectives():
    from runtime.failures import is_comm_failure

    assert is_comm_failure(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert is_comm_failure(RuntimeError("Timed out waiting 4000ms for send operation to complete"))
    assert not is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x4)"))
    assert not is_comm_failure(ValueError("timed out"))
