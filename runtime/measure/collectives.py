"""Collectives among 2..N spawned ranks for ``autopar calibrate`` (``gloo`` on CPU, ``nccl`` with one GPU per rank
when CUDA has enough devices): each point is the slowest rank's mean time over a timed loop after warm-up, each
timed block after a short compute burst (collectives inside a training step run between kernels, and on a CPU
cost more there than back to back).

On gloo with an even N >= 4 the ops are also timed in the two halves' groups at once (every rank busy, as a
plan's tp / cp / dp sub-groups run side by side), send_recv included, as points of N / 2 ranks: their own fit
(``Calibration.collective_fit(op, ranks)``), where the plan measures no world of N / 2 by itself
(``halves_measured``: the quick plan that ``autopar validate --calibrate`` takes). The N-rank fit does not carry over by ring terms: 4 gloo ranks on
2 cores, two 2-rank groups at once took 10.7 ms for a 2 MB all-gather and 12.0 ms for a reduce-scatter where the
4-rank fit's ring terms priced 3.0 and 4.2 ms (and 17.4 / 13.9 ms on the 4-rank group, load 4-8)."""

from __future__ import annotations

import datetime as _dt
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from costmodel.calibration import COLLECTIVE_OPS, CollectivePoint
from costmodel.errors import ProfileError
from runtime.measure.spawn import run_ranks
from runtime.measure.sweep import CalibrationPlan
from runtime.measure.timing import sync


def _make_op(op: str, nbytes: int, rank: int, world: int, device: str, *, group: Any = None,
             members: tuple[int, ...] = ()) -> tuple[Callable[[], Any], int]:
    """A closure running one ``op`` on ``nbytes`` (NCCL convention) and the bytes it really moves; with a
    ``group`` (of global ranks ``members``, ``world`` of them) on that group, ``rank`` the global rank."""
    if group is not None:
        return _make_group_op(op, nbytes, rank, world, device, group=group, members=members)
    numel = max(world, nbytes // 4 // world * world)
    shard = numel // world
    full = torch.ones(numel, device=device)
    part = torch.ones(shard, device=device)
    if op == "all_reduce":
        fn = lambda: dist.all_reduce(full)  # noqa: E731
    elif op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn = lambda: gather(full, part)  # noqa: E731
    elif op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn = lambda: scatter(part, full)  # noqa: E731
    elif op == "all_to_all":
        out = torch.empty_like(full)
        fn = lambda: dist.all_to_all_single(out, full)  # noqa: E731
    elif op == "broadcast":
        fn = lambda: dist.broadcast(full, 0)  # noqa: E731
    elif op == "send_recv":  # ping-pong between ranks 0 and 1; one iteration = two one-way messages

        def fn() -> None:
            if rank == 0:
                dist.send(full, 1)
                dist.recv(full, 1)
            elif rank == 1:
                dist.recv(full, 0)
                dist.send(full, 0)

    else:
        raise ProfileError(f"unknown collective {op!r}; use one of {', '.join(COLLECTIVE_OPS)}")
    return fn, numel * 4


def _make_group_op(op: str, nbytes: int, rank: int, world: int, device: str, *, group: Any,
                   members: tuple[int, ...]) -> tuple[Callable[[], Any], int]:
    """``_make_op`` on a sub-group: the same ops with ``group=``; send_recv a ping-pong of its first two members."""
    numel = max(world, nbytes // 4 // world * world)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // world, device=device)
    if op == "all_reduce":
        return (lambda: dist.all_reduce(full, group=group)), numel * 4
    if op == "all_gather":
        return (lambda: dist.all_gather_into_tensor(full, part, group=group)), numel * 4
    if op == "reduce_scatter":
        return (lambda: dist.reduce_scatter_tensor(part, full, group=group)), numel * 4
    if op == "all_to_all":
        out = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(out, full, group=group)), numel * 4
    if op == "broadcast":
        return (lambda: dist.broadcast(full, members[0], group=group)), numel * 4
    if op == "send_recv":
        first, second = members[0], members[1]

        def fn() -> None:
            if rank == first:
                dist.send(full, second)
                dist.recv(full, second)
            elif rank == second:
                dist.recv(full, first)
                dist.send(full, first)
        return fn, numel * 4
    raise ProfileError(f"unknown collective {op!r}; use one of {', '.join(COLLECTIVE_OPS)}")


BURST_MATMULS = 6
"""Matmuls of (256, 256) @ (256, 256) in the compute burst before each timed CPU collective: ~2 ms on one core,
a decoder layer's worth of work between two collectives."""


def _burst(device: str) -> Callable[[], None]:
    a = torch.randn(256, 256, device=device)
    out = torch.empty_like(a)

    def run() -> None:
        for _ in range(BURST_MATMULS):
            torch.mm(a, a, out=out)

    return run


def _time_collective(fn: Callable[[], Any], *, device: str, iters: int, blocks: int,
                     burst: Callable[[], None] | None = None) -> float:
    """Best over ``blocks`` of the slowest rank's mean time per call (collective: every rank calls it).

    With a ``burst`` (CPU ranks): every call follows a burst of compute on every rank, as collectives do in a
    training step, and the time is that loop's minus the burst-only loop's: the collective as it costs between
    compute phases, where ranks sharing cores arrive apart and wait for descheduled peers (4 gloo ranks on 2
    cores: a 7 MB all-reduce took 15 ms back to back, ~30 ms more per DDP step than without it)."""
    def loop(call: bool) -> float:
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            if burst is not None:
                burst()
            if call:
                fn()
        sync(device)
        slowest = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest.item())

    fn()
    best = base = float("inf")
    for _ in range(blocks):
        best = min(best, loop(True))
        if burst is not None:
            base = min(base, loop(False))
    if burst is None:
        return best
    return max(best - base, 0.05 * best)  # noise can make the difference vanish: keep a floor


def halves_measured(plan: CalibrationPlan, *, backend: str, world: int) -> int:
    """The group size also measured in halves at ``world`` ranks (0: none): gloo, an even ``world`` >= 4, and no
    world size of ``world / 2`` in the plan (the full plan's own 2-rank runs, alone on the machine, keep theirs)."""
    half = world // 2
    ok = backend == "gloo" and world >= 4 and world % 2 == 0 and half not in plan.world_sizes
    return half if ok else 0


def _collective_rank(rank: int, world: int, backend: str, plan: CalibrationPlan, *,
                     progress: Callable[[Any], None]) -> list[CollectivePoint]:
    """One rank: time every (op, size); rank 0 returns the points (the slowest rank's time each) and reports each
    as it is measured."""
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = "cuda"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=_dt.timedelta(seconds=120))
    try:
        burst = _burst(device) if backend == "gloo" else None
        points = []
        # gloo on 2+ pairs: also every rank at once in the halves' groups, as a plan's tp / cp / dp groups run
        half = halves_measured(plan, backend=backend, world=world)
        groups = [tuple(range(i, i + half)) for i in range(0, world, half)] if half else []
        handles = [dist.new_group(list(g)) for g in groups]  # every rank makes every group
        sizes: list[tuple[int, Any, tuple[int, ...]]] = [(world, None, ())]
        if half:
            mine = next(i for i, g in enumerate(groups) if rank in g)
            sizes.append((half, handles[mine], groups[mine]))
        for n, group, members in sizes:
            for op in plan.ops:
                if op == "send_recv" and n != 2:
                    continue  # point-to-point is measured on a pair
                for nbytes in plan.collective_bytes:
                    fn, real_bytes = _make_op(op, nbytes, rank, n, device, group=group, members=members)
                    best = _time_collective(fn, device=device, iters=plan.collective_iters,
                                            blocks=plan.collective_blocks, burst=burst)
                    if op == "send_recv":
                        best /= 2.0
                    if rank == 0:
                        points.append(CollectivePoint(op=op, ranks=n, nbytes=float(real_bytes), time_s=best))
                        progress()
        return points
    finally:
        dist.destroy_process_group()


def measure_collectives(
    plan: CalibrationPlan, *, backend: str, world: int, progress: Callable[[], None], timeout_s: float = 300.0
) -> list[CollectivePoint]:
    """Spawn ``world`` ranks on this machine and time the plan's collectives among them."""
    results = run_ranks(_collective_rank, world_size=world, args=(backend, plan), timeout_s=timeout_s,
                        threads=plan.threads_per_rank, progress=lambda _: progress(), what="calibration collectives")
    return results[0]
