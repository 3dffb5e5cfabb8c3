"""Run a function on N gloo ranks (CPU) in spawned processes and collect what each rank returns.

API (shared by every distributed test)::

    from dist_utils import run_distributed

    def _body(rank: int, world_size: int, x: int) -> dict:   # module level: it must pickle by name
        import torch.distributed as dist
        ...                                                  # the process group is already initialised
        return {"rank": rank, "loss": 1.0}                   # anything picklable (tensors included)

    results = run_distributed(_body, world_size=4, args=(3,), timeout_s=120)
    results[0]["loss"]                                       # results[r] is what rank r returned

``run_distributed(fn, *, world_size, args=(), kwargs=None, timeout_s=120.0, backend="gloo",
init_process_group=True, env=None) -> list`` is ``runtime.measure.spawn.run_ranks`` with one intra-op thread per
rank: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set as ``torchrun`` would; with
``init_process_group=True`` the default process group (``backend``, env://) exists while ``fn`` runs, with
``False`` the function makes it (e.g. through ``runtime.init_distributed()``); ``env`` adds environment variables.
A rank that raises or dies raises ``RankError`` with every failing rank's traceback; ranks that do not finish in
``timeout_s`` are terminated (``RankTimeout``, a ``TimeoutError``). Process start (importing torch) is the expensive
part (~2-3 s per rank on 2 cores): group several checks into one spawned run per world size.
"""

from __future__ import annotations

from typing import Any, Callable

from runtime.measure.spawn import RankError, RankTimeout, run_ranks

__all__ = ["RankError", "RankTimeout", "run_distributed"]


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
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks; their results by rank."""
    return run_ranks(fn, world_size=world_size, args=args, kwargs=kwargs, timeout_s=timeout_s,
                     backend=backend if init_process_group else None, threads=1, env=env,
                     what=f"{getattr(fn, '__name__', 'fn')} on {world_size} ranks")
