"""Run a function on N gloo ranks (CPU) in spawned processes and collect what each rank returns.

API (shared by every distributed test)::

    from dist_utils import run_distributed

    def _body(rank: int, world_size: int, x: int) -> dict:   # module level: it must pickle by name
        import torch.distributed as dist
        ...                                                  # the process group is already initialised
        return {"rank": rank, "loss": 1.0}                   # anything picklable (tensors included)

    results = run_distributed(_body, world_size=4, args=(3,), timeout_s=120)
    results[0]["loss"]                                       # results[r] is what rank r returned

- ``run_distributed(fn, *, world_size, args=(), kwargs=None, timeout_s=120.0, backend="gloo",
  init_process_group=True, env=None) -> list``: starts ``world_size`` processes with the ``spawn`` start method,
  each with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set (a free TCP port on 127.0.0.1, as
  ``torchrun`` would), OMP_NUM_THREADS=1 and ``torch.set_num_threads(1)``. With ``init_process_group=True`` the
  default process group is created (gloo, env://) before ``fn(rank, world_size, *args, **kwargs)`` runs and
  destroyed afterwards (in ``finally``); with ``False`` the function does it itself (e.g. through
  ``runtime.init_distributed()``). ``env`` adds environment variables for the children.
- The return values come back pickled (tensors are copied, not shared), ordered by rank.
- If any rank raises, ``RankError`` is raised in the parent with every failing rank's traceback; ranks still
  blocked in a collective are terminated after a short grace period. If the ranks do not all finish within
  ``timeout_s``, all are terminated and ``TimeoutError`` names the ranks that had not reported.
- Process start (importing torch) is the expensive part (~2-3 s per rank on 2 cores): group several checks into one
  spawned run per world size.
- ``free_port() -> int``: a TCP port that was free a moment ago (a start that loses the port race is retried once).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

_GRACE_S = 5.0


class RankError(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    env: dict[str, str],
    backend: str,
    init_pg: bool,
    out: Any,
) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init_pg:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            if init_pg and dist.is_initialized():
                dist.destroy_process_group()
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        out.put((rank, "err", traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks; return results by rank.

    The free port can be taken by another process between choosing and binding it: that start is retried once.
    """
    call = dict(
        world_size=world_size, args=args, kwargs=kwargs, timeout_s=timeout_s, backend=backend,
        init_process_group=init_process_group, env=env,
    )
    try:
        return _run_once(fn, **call)
    except RankError as e:
        if "address already in use" not in str(e).lower() and "eaddrinuse" not in str(e).lower():
            raise
        return _run_once(fn, **call)


def _run_once(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple,
    kwargs: dict | None,
    timeout_s: float,
    backend: str,
    init_process_group: bool,
    env: dict[str, str] | None,
) -> list[Any]:
    """One start of ``run_distributed`` (which owns the defaults and passes every argument)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, fn, args, kwargs or {}, child_env, backend, init_process_group, out),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + _GRACE_S)
            if now >= deadline:
                break
            try:
                rank, kind, payload = out.get(timeout=min(0.5, max(deadline - now, 0.01)))
            except queue.Empty:
                _note_dead(procs, results, errors)
                continue
            if kind == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=2.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RankError(f"{len(errors)} of {world_size} ranks failed:\n{msg}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s (all ranks terminated)")
    return [results[r] for r in range(world_size)]


def _note_dead(procs: list, results: dict, errors: dict) -> None:
    """A rank that exited without reporting (killed, segfault) counts as failed."""
    for r, p in enumerate(procs):
        if r not in results and r not in errors and p.exitcode not in (None, 0):
            errors[r] = f"process exited with code {p.exitcode} without reporting a result"
