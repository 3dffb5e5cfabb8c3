"""Timers for measurements on a shared machine: best (alone) or median (in step with other processes) of timed
blocks; ``DistBarrier`` keeps the ranks of a job in step."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

CONCURRENT_WINDOW_S = 0.1
"""Shortest timed window per block when processes measure together."""


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], Any], *, device: str, min_time_s: float, blocks: int = 7, barrier: Any = None) -> float:
    """Seconds per call: best of ``blocks`` timed loops, each long enough to reach ``min_time_s / blocks``.

    The best (not the mean) because on a shared machine other processes only ever slow a loop down; many
    short loops catch the moments this process had a core to itself. With a ``barrier`` (``concurrent`` ranks
    measuring together) every block starts when all processes do and runs for the same wall time, and the
    median block counts: each process's rate while all of them compete, with whatever else the machine runs
    at the time (as the median training step ``autopar validate`` compares against)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    if barrier is not None:
        # windows well above the scheduler's time slice (~4 ms), so each process's share averages out
        window, per_call = max(min_time_s / blocks, 3 * once, CONCURRENT_WINDOW_S), []
        for _ in range(blocks):
            barrier.wait()
            t0, calls = time.perf_counter(), 0
            while time.perf_counter() - t0 < window:
                fn()
                calls += 1
            sync(device)
            per_call.append((time.perf_counter() - t0) / calls)
        return sorted(per_call)[len(per_call) // 2]
    reps = max(1, int(min_time_s / blocks / once))
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def time_interleaved(fns: list[Callable[[], Any]], *, min_time_s: float, blocks: int = 7,
                     barrier: Any = None) -> list[float]:
    """Seconds per call of each of ``fns``, called in turn within the same timed blocks (so a difference of two
    of them is not a difference of two moments' load) from the fastest block; with a ``barrier`` the blocks
    start when every process's do and the block of median total time counts (see ``time_call``)."""
    for fn in fns:
        fn()
    window = max(min_time_s / blocks, CONCURRENT_WINDOW_S if barrier is not None else 0.0)
    per_block: list[list[float]] = []
    for _ in range(blocks):
        if barrier is not None:
            barrier.wait()
        spent, calls = [0.0] * len(fns), 0
        t_end = time.perf_counter() + window
        while calls == 0 or time.perf_counter() < t_end:
            for i, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn()
                spent[i] += time.perf_counter() - t0
            calls += 1
        per_block.append([t / calls for t in spent])
    per_block.sort(key=sum)
    return per_block[len(per_block) // 2] if barrier is not None else per_block[0]


class DistBarrier:
    """``wait()`` as ``torch.distributed.barrier()``: the compute sweep in step across a job's ranks."""

    def wait(self) -> None:
        dist.barrier()


def load_average() -> float:
    """1-minute load average (other processes competing for the cores), NaN where unknown."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return float("nan")
