"""Turn a collective that failed because another rank died or hung into an error naming that rank and the step.

A dead peer makes gloo / NCCL raise at once ("Connection closed by peer"); a hung one makes the others' next
collective time out after the process group's timeout (``runtime.mesh.init_distributed``, bounded). Either way
the survivors only see their own collective fail. ``diagnose`` then checks in on the job's key-value store (the
c10d store: torchrun's agent hosts it, so it outlives any worker; under a plain spawn rank 0 hosts it) under
``autopar/failed/<restart>/<step>/<rank>`` and waits ``FAILURE_GRACE_S`` for the others: a rank that never checks
in is the one that died or hangs. (``dist.monitored_barrier`` names a hung rank too, but runs over the process
group's connections, which a dead rank has already closed.)
"""

from __future__ import annotations

import logging
import os
import time

import torch.distributed as dist

from costmodel.errors import RankFailureError

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 5.0
"""How long a rank whose collective failed waits for the others to check in before naming the missing ones."""

_COMM_SIGNS = ("connection closed", "connection reset", "timed out", "timeout", "nccl", "gloo", "broken pipe",
               "peer", "socket")


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a failed collective (a backend error or gloo / NCCL transport message)."""
    if isinstance(exc, getattr(dist, "DistBackendError", ())):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(s in text for s in _COMM_SIGNS)


def diagnose(exc: BaseException, *, step: int, grace_s: float = FAILURE_GRACE_S) -> RankFailureError | None:
    """Check in as failed at ``step`` (counted from 1) and name the ranks that do not within ``grace_s``; None
    when every rank checks in (then no peer is missing and the original error stands)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"autopar/failed/{restart}/{step}/"
    first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(prefix + str(rank), "1")
        deadline = time.monotonic() + grace_s
        missing = list(range(world))
        while True:
            missing = [r for r in missing if not store.check([prefix + str(r)])]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    except Exception as store_exc:  # noqa: BLE001 - the store itself is gone: say so, with what failed first
        return RankFailureError(
            f"rank {rank} of {world}: a collective failed in step {step} ({first_line}); the job's store is "
            f"unreachable too ({type(store_exc).__name__}), so the rank hosting it (rank 0 outside torchrun) "
            "most likely died"
        )
    if not missing:
        return None
    what = "rank" if len(missing) == 1 else "ranks"
    names = ", ".join(map(str, missing))
    return RankFailureError(
        f"{what} {names} of {world} stopped in step {step}: died or hung (did not report within {grace_s:.0f} s "
        f"after rank {rank}'s collective failed: {first_line}). Check {what} {names}'s log; a checkpointed run "
        "resumes from its last complete checkpoint when relaunched (torchrun --max-restarts N does it)"
    )
