"""Run a function on N local processes, one per rank as ``torchrun`` would start them, and collect the results.

``run_ranks(fn, *, world_size, ...)`` starts ``world_size`` processes with the ``spawn`` start method, each with
RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (a free port on 127.0.0.1) and ``threads`` intra-op
threads (OMP_NUM_THREADS at process start and ``torch.set_num_threads``), calls ``fn(rank, world_size, *args,
**kwargs)`` in each (module level: it is pickled by name) and returns what each returned, by rank. With
``backend`` the default process group is created before ``fn`` and destroyed after it; without, ``fn`` makes its
own (``runtime.init_distributed()`` reads the same variables). With ``progress`` each rank's ``fn`` also gets a
``progress(payload=None)`` keyword argument whose calls reach ``progress(payload)`` in the parent as they happen.

A rank that raises or dies makes the call raise ``RankError`` with every failing rank's traceback (ranks still
blocked in a collective are terminated after ``GRACE_S``); ranks that do not finish within ``timeout_s`` are
terminated and ``RankTimeout`` names them. Every process is joined or terminated on the way out. A start that
loses the race for the free port is retried once.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from costmodel.errors import AutoparError
from runtime.failures import FAILURE_GRACE_S

GRACE_S = FAILURE_GRACE_S + 10.0
"""How long the other ranks get to report once one has failed: longer than a survivor's own wait for its peers to
check in (``runtime.failures.FAILURE_GRACE_S``) plus noticing its collective failed, so the survivor's error naming
the dead rank and the step arrives before it is terminated (at 5 s each, a loaded machine lost that race)."""


class RankError(AutoparError):
    """One or more ranks raised or died; the message holds each failing rank's traceback."""


class RankTimeout(RankError, TimeoutError):
    """Ranks did not finish within the time limit (all were terminated)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
    backend: str | None = None,
    threads: int = 1,
    env: dict[str, str] | None = None,
    progress: Callable[[Any], None] | None = None,
    what: str = "ranks",
) -> list[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks; their results by rank (see the
    module docstring). ``what`` names the job in error messages."""
    call = dict(world_size=world_size, args=args, kwargs=kwargs or {}, timeout_s=timeout_s, backend=backend,
                threads=threads, env=env or {}, progress=progress, what=what)
    try:
        return _run_once(fn, **call)
    except RankError as e:
        text = str(e).lower()
        if isinstance(e, RankTimeout) or ("address already in use" not in text and "eaddrinuse" not in text):
            raise
        return _run_once(fn, **call)


def _child(rank: int, world_size: int, fn: Callable[..., Any], args: tuple, kwargs: dict, env: dict[str, str],
           backend: str | None, threads: int, with_progress: bool, out: Any) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    try:
        torch.set_num_threads(threads)
        if with_progress:
            kwargs = {**kwargs, "progress": lambda payload=None: out.put((rank, "progress", payload))}
        if backend is not None:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            if backend is not None and dist.is_initialized():
                dist.destroy_process_group()
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        out.put((rank, "err", traceback.format_exc()))


@contextlib.contextmanager
def _omp_threads(threads: int) -> Iterator[None]:
    """OMP_NUM_THREADS for the children (read when they import torch, before ``_child`` runs), restored after."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def _run_once(fn: Callable[..., Any], *, world_size: int, args: tuple, kwargs: dict, timeout_s: float,
              backend: str | None, threads: int, env: dict[str, str], progress: Callable[[Any], None] | None,
              what: str) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": str(threads), **env}
    procs = [ctx.Process(target=_child, daemon=False, args=(
        r, world_size, fn, args, kwargs, child_env, backend, threads, progress is not None, out))
        for r in range(world_size)]
    try:
        with _omp_threads(threads):
            for p in procs:
                p.start()
        results, errors = _collect(out, procs, timeout_s=timeout_s, progress=progress)
    finally:
        _teardown(procs)
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RankError(f"{what}: {len(errors)} of {world_size} ranks failed:\n{msg}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise RankTimeout(f"{what}: ranks {missing} did not finish within {timeout_s:.0f} s (all ranks terminated)")
    return [results[r] for r in range(world_size)]


def _collect(out: Any, procs: list, *, timeout_s: float,
             progress: Callable[[Any], None] | None) -> tuple[dict[int, Any], dict[int, str]]:
    """Poll the ranks' queue until each has reported, the deadline passes, or ``GRACE_S`` after a failure."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < len(procs):
        now = time.monotonic()
        if errors:
            deadline = min(deadline, now + GRACE_S)
        if now >= deadline:
            break
        try:
            rank, kind, payload = out.get(timeout=min(0.5, max(deadline - now, 0.01)))
        except queue.Empty:
            for r, p in enumerate(procs):  # a rank that exited without reporting (killed, segfault) failed
                if r not in results and r not in errors and p.exitcode not in (None, 0):
                    errors[r] = f"process exited with code {p.exitcode} without reporting a result"
            continue
        if kind == "progress":
            if progress is not None:
                progress(payload)
        elif kind == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
    return results, errors


def _teardown(procs: list) -> None:
    for p in procs:
        if p.pid is not None:
            p.join(timeout=2.0)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
