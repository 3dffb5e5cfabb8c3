"""Planning speed: trace-to-plan wall time per phase for GPT-3 175B on 128 DGX-A100 nodes (global batch 1536)
and for the 1T Megatron model on 384 nodes (global batch 3072), and how it grows with layers and GPUs.

    python -m benchmarks.plan_speed [--skip-scaling]

Targets on the 2-core development machine: <= 10 s and <= 30 s. Each headline run starts from an empty
workload cache, so the trace is included; the one-off Python imports (torch, transformers) are timed apart.
"""

from __future__ import annotations

import argparse
import sys
import time

HEADLINE = (
    # (label, model spec, nodes, global batch, target s)
    ("GPT-3 175B, 128 x dgx-a100-80gb", "gpt3-175b", 128, 1536, 10.0),
    ("Megatron 1T, 384 x dgx-a100-80gb", "megatron-1t", 384, 3072, 30.0),
)


def _clear_caches() -> None:
    from planner import workload as wl_mod

    for name in ("clear_cache", "cache_clear"):
        fn = getattr(wl_mod, name, None)
        if callable(fn):
            fn()
            return
    fn = getattr(getattr(wl_mod, "workload_from_model", None), "cache_clear", None)
    if callable(fn):
        fn()


def time_plan(spec: str, *, nodes: int, global_batch: int) -> tuple[float, dict[str, float], object]:
    from costmodel.profiles import make_cluster
    from planner.search.driver import plan_model

    cluster = make_cluster("dgx-a100-80gb", nodes)
    t0 = time.perf_counter()
    plan = plan_model(spec, cluster, global_batch=global_batch)
    return time.perf_counter() - t0, dict(plan.solver.time_per_phase_s), plan


def _phases(ph: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.2f}" for k, v in ph.items())


def imports_s() -> float:
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import planner.search.driver  # noqa: F401
    import planner.workload  # noqa: F401

    return time.perf_counter() - t0


def headline() -> bool:
    print(f"process start (import torch, transformers, autopar): {imports_s():.2f} s, not counted below")
    ok = True
    for label, spec, nodes, gb, target in HEADLINE:
        _clear_caches()
        wall, ph, plan = time_plan(spec, nodes=nodes, global_batch=gb)
        d, s = plan.degrees, plan.schedule
        good = wall <= target
        ok &= good
        print(f"{label}: {wall:.2f} s (target <= {target:.0f} s: {'ok' if good else 'MISSED'})")
        print(f"   phases (s): {_phases(ph)}")
        print(f"   plan: tp={d.tp} pp={d.pp} dp={d.dp} mb={s.microbatch_size} {s.name} v={s.virtual_stages}, "
              f"{plan.prediction.step_time_s:.3f} s/step, MFU {100 * plan.prediction.mfu:.1f}%, "
              f"{plan.solver.candidates_explored} structures, status {plan.solver.status}")
    return ok


def scaling() -> None:
    print("\ngrowth with layers (hidden 12288, 96 heads, 64 nodes, global batch 1024; search only, trace cached):")
    base = None
    for layers in (24, 48, 96, 192):
        spec = f"gpt:layers={layers},hidden=12288,heads=96,vocab=51200,seq=2048"
        time_plan(spec, nodes=64, global_batch=1024)  # warm the trace cache
        wall, ph, _ = time_plan(spec, nodes=64, global_batch=1024)
        base = base or wall / layers
        print(f"  layers={layers:>4}: {wall:6.2f} s  (per layer {wall / layers / base:4.2f} x the first row's)   "
              f"{_phases(ph)}")
    print("\ngrowth with GPUs (GPT-3 175B, global batch 1536; search only, trace cached):")
    base = None
    for nodes in (16, 32, 64, 128, 256):
        time_plan("gpt3-175b", nodes=nodes, global_batch=1536)
        wall, ph, _ = time_plan("gpt3-175b", nodes=nodes, global_batch=1536)
        gpus = nodes * 8
        base = base or wall / gpus
        print(f"  gpus={gpus:>5}: {wall:6.2f} s  (per GPU {wall / gpus / base:4.2f} x the first row's)   "
              f"{_phases(ph)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-scaling", action="store_true")
    args = ap.parse_args(argv)
    ok = headline()
    if not args.skip_scaling:
        scaling()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
