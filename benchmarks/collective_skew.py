"""Collectives inside a ZeRO-3 step vs the same collectives alone, on local gloo ranks sharing this machine's cores.

    python -m benchmarks.collective_skew [--ranks 4] [--steps 10] [--model SPEC]

Why: ``autopar validate --calibrate`` prices ZeRO-2 / ZeRO-3 steps 10-27% under what they measure here, while its
collectives are the ones the step issues (``tests/test_priced_collectives.py``) and are timed by the calibration
after a barrier, every rank idle. This prints, per rank and as the median over ranks:

1. in-step: FSDP2's all-gathers and reduce-scatters of a dp=ranks ZeRO-3 plan (``runtime.manual_plan``, micro-batch
   2, the small Llama of the README's validate table), each made synchronous and timed from its call to its end
   (FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single``; both are wrapped while the steps run);
2. alone: the same op and message size after a barrier, as the calibration times it;
3. after compute: the all-gather right after a burst of 256 x 256 x 512 matmuls on every rank (0 / 10 / 40 ms
   nominal, from the matmul's time with every rank multiplying at once), the burst's measured time beside it.

The wrapping changes the step (no all-gather runs behind compute), so the step time printed is that of the
wrapped step. Nothing here feeds the cost model: it measures what the calibration leaves out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections import defaultdict
from typing import Any, Iterator

import torch
import torch.distributed as dist

DEFAULT_MODEL = "llama:layers=2,hidden=256,ffn=512,heads=4,kv_heads=4,vocab=1024,seq=64"
WRAPPED = ("all_gather_single", "reduce_scatter_single")
BURSTS_MS = (0, 10, 40)


class _Done:
    """The Work of a collective already run synchronously."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def _timed_collectives(log: dict[str, list[tuple[float, float]]]) -> Iterator[None]:
    """While inside: ``dist.all_gather_single`` / ``reduce_scatter_single`` run synchronously and append
    (seconds, MB of the larger tensor) to ``log[name]``."""
    originals = {name: getattr(dist, name) for name in WRAPPED}

    def wrap(name: str):
        def timed(*args: Any, **kwargs: Any) -> _Done:
            kwargs["async_op"] = False
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            mb = max(t.numel() * t.element_size() for t in tensors) / 1e6
            t0 = time.perf_counter()
            originals[name](*args, **kwargs)
            log[name].append((time.perf_counter() - t0, mb))
            return _Done()
        return timed

    for name in WRAPPED:
        setattr(dist, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _alone_ms(op: str, mb: float, world: int, reps: int = 10) -> float:
    n = max(world, int(mb * 1e6 / 4) // world * world)
    full, shard = torch.randn(n), torch.empty(n // world)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        if op == "all_gather_single":
            dist.all_gather_single(full, shard)
        else:
            dist.reduce_scatter_single(shard, full)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _after_compute(world: int, mb: float, reps: int = 10) -> dict[int, tuple[float, float]]:
    """{nominal burst ms: (measured burst ms, all-gather ms after it)} (medians)."""
    a, b = torch.randn(256, 256), torch.randn(256, 512)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(50):
        a @ b
    per_s = (time.perf_counter() - t0) / 50
    n = max(world, int(mb * 1e6 / 4) // world * world)
    full, shard = torch.randn(n), torch.empty(n // world)
    out = {}
    for ms in BURSTS_MS:
        count = int(ms / 1e3 / per_s)
        burst, gather = [], []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(count):
                a @ b
            t1 = time.perf_counter()
            dist.all_gather_single(full, shard)
            burst.append(t1 - t0)
            gather.append(time.perf_counter() - t1)
        out[ms] = (1e3 * statistics.median(burst), 1e3 * statistics.median(gather))
    return out


def _rank(rank: int, world: int, spec: str, steps: int) -> dict:
    from cli.commands.validate import build_model_for
    from planner.models import model_dims
    from runtime import apply_plan, init_distributed
    from runtime.manual_plan import manual_plan
    from runtime.measure.validate import lm_loss

    init_distributed(backend="gloo")
    try:
        seq = model_dims(spec).seq
        batch = 2 * world
        model = build_model_for(spec, batch, seq)
        plan = manual_plan(model, dp=world, zero_stage=3, microbatch_size=2, num_microbatches=1, seq_len=seq)
        pm = apply_plan(model, plan, loss_fn=lm_loss, seed=0)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(1234)
        log: dict[str, list[tuple[float, float]]] = defaultdict(list)
        step_s = []
        with _timed_collectives(log):
            for i in range(3 + steps):
                if i == 3:
                    log.clear()
                ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
                dist.barrier()
                t0 = time.perf_counter()
                pm.step(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
                opt.step()
                opt.zero_grad(set_to_none=True)
                step_s.append(time.perf_counter() - t0)
        ops = {}
        for op, calls in log.items():
            mb = statistics.median(m for _, m in calls)
            ops[op] = {"calls": len(calls) / steps, "mb": mb,
                       "in_step_ms": 1e3 * statistics.median(t for t, _ in calls), "alone_ms": _alone_ms(op, mb, world)}
        big = max(m for calls in log.values() for _, m in calls)
        return {"step_ms": 1e3 * statistics.median(step_s[3:]), "ops": ops, "after": _after_compute(world, big)}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args(argv)
    from runtime.measure.spawn import run_ranks

    print(f"{args.ranks} gloo ranks on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"dp{args.ranks} ZeRO-3, {args.model}")
    got = run_ranks(_rank, world_size=args.ranks, args=(args.model, args.steps), threads=1, timeout_s=600,
                    what="collective_skew")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"wrapped step: {med([g['step_ms'] for g in got]):.1f} ms (median over ranks)")
    print(f"{'op':<24} {'calls/step':>10} {'MB':>6} {'in step ms':>11} {'alone ms':>9} {'ratio':>6}   per rank in step")
    for op in sorted(got[0]["ops"]):
        rows = [g["ops"][op] for g in got]
        inside, alone = med([r["in_step_ms"] for r in rows]), med([r["alone_ms"] for r in rows])
        per = " ".join(f"{r['in_step_ms']:.1f}" for r in rows)
        print(f"{op:<24} {rows[0]['calls']:>10.1f} {rows[0]['mb']:>6.2f} {inside:>11.1f} {alone:>9.1f} "
              f"{inside / alone:>5.2f}x   {per}")
    print("all-gather after a compute burst on every rank (nominal burst: measured burst, all-gather; medians over ranks):")
    for ms in BURSTS_MS:
        burst = med([g["after"][ms][0] for g in got])
        gather = med([g["after"][ms][1] for g in got])
        print(f"  {ms:>3} ms: burst {burst:6.1f} ms, all-gather {gather:6.1f} ms")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
