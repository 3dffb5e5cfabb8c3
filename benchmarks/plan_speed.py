"""Planning speed: trace-to-plan wall time per phase for GPT-3 175B on 128 DGX-A100 nodes (global batch 1536),
the 1T Megatron model on 384 nodes (global batch 3072), Llama-3 405B on 2,048 DGX-H100 nodes (16,384 GPUs,
global batch 2048), and two models written with plain torch.nn (``tests/models``, built on meta by the
``module:function`` loader): the 8.6B-parameter residual MLP stack (16 blocks of width 8192, hidden 32768) on 2
DGX-A100 nodes (global batch 2048) and ViT-L/16 (24 layers, hidden 1024, 16 heads, mlp 4096, 224x224 images,
16x16 patches) on 4 DGX-A100 nodes (global batch 4096); and how it grows with layers and GPUs.

    python -m benchmarks.plan_speed [--skip-scaling] [--only GPT-3]

Targets on the 2-core development machine: <= 10 s, <= 30 s, <= 10 s, <= 30 s and <= 30 s. Each headline run
starts from an empty workload cache, so the trace is included; the one-off Python imports (torch, transformers,
the torch.export machinery and transformers' modeling code that the first trace would otherwise import) are
timed apart. Per case it prints the phases, the CPU time of the process (the wall time moves with the shared
machine's load), the search's share (everything but the trace), the plan, and what
the search proved.
"""

from __future__ import annotations

import argparse
import sys
import time

HEADLINE = (
    # (label, model spec, node type, nodes, global batch, target s)
    ("GPT-3 175B, 128 x dgx-a100-80gb", "gpt3-175b", "dgx-a100-80gb", 128, 1536, 10.0),
    ("Megatron 1T, 384 x dgx-a100-80gb", "megatron-1t", "dgx-a100-80gb", 384, 3072, 30.0),
    ("Llama-3 405B, 2048 x dgx-h100", "llama3-405b", "dgx-h100", 2048, 2048, 10.0),
    ("8.6B MLP (torch.nn), 2 x dgx-a100-80gb", "tests.models.mlp:mlp_8b", "dgx-a100-80gb", 2, 2048, 30.0),
    ("ViT-L/16 (torch.nn), 4 x dgx-a100-80gb", "tests.models.vit:vit_l16", "dgx-a100-80gb", 4, 4096, 30.0),
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


def time_plan(spec: str, *, nodes: int, global_batch: int, node: str = "dgx-a100-80gb"
              ) -> tuple[float, dict[str, float], object]:
    from costmodel.profiles import make_cluster
    from planner.search.driver import plan_model

    cluster = make_cluster(node, nodes)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = plan_model(spec, cluster, global_batch=global_batch)
    _LAST_CPU[0] = time.process_time() - c0
    return time.perf_counter() - t0, dict(plan.solver.time_per_phase_s), plan


_LAST_CPU = [0.0]
"""CPU seconds of the last ``time_plan`` (this process only; the machine is shared, so wall time varies with
its load more than CPU time does)."""


def _phases(ph: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.2f}" for k, v in ph.items())


def imports_s() -> float:
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import torch.export  # noqa: F401  (torch._dynamo and the fake-tensor machinery, ~40% of a first trace)
    import transformers  # noqa: F401
    import transformers.modeling_utils  # noqa: F401  (what the first Hugging Face model class imports)

    import planner.search.driver  # noqa: F401
    import planner.workload  # noqa: F401

    return time.perf_counter() - t0


def headline(only: str = "") -> bool:
    print(f"process start (import torch, torch.export, transformers and its modeling code, autopar): "
          f"{imports_s():.2f} s, not counted below")
    ok = True
    for label, spec, node, nodes, gb, target in HEADLINE:
        if only and only.lower() not in label.lower():
            continue
        _clear_caches()
        wall, ph, plan = time_plan(spec, nodes=nodes, global_batch=gb, node=node)
        d, s, st = plan.degrees, plan.schedule, plan.solver
        good = wall <= target
        ok &= good
        rest = wall - ph.get("trace", 0.0)
        print(f"{label}: {wall:.2f} s (target <= {target:.0f} s: {'ok' if good else 'MISSED'}); trace "
              f"{ph.get('trace', 0.0):.2f} s, the rest {rest:.2f} s ({100 * rest / wall:.0f}%)")
        print(f"   phases (s): {_phases(ph)}; CPU {_LAST_CPU[0]:.2f} s")
        recomputed = sum(max(0, x.recompute_layers) for x in plan.stages if x.recompute != "none")
        print(f"   plan: tp={d.tp} pp={d.pp} dp={d.dp} mb={s.microbatch_size} {s.name} v={s.virtual_stages}, "
              f"ZeRO-{plan.zero_stage}, recompute {plan.stages[0].recompute} on {recomputed} layers, "
              f"{plan.prediction.step_time_s:.3f} s/step at {plan.prediction.memory_gb_per_device:.1f} GB, "
              f"MFU {100 * plan.prediction.mfu:.1f}%")
        print(f"   search: {st.status}, bound {st.bound:.3f} s, gap {100 * st.gap:.1f}%, "
              f"{st.candidates_explored} structures explored; {st.proven}")
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
    ap.add_argument("--only", default="", metavar="TEXT", help="run the headline cases whose label contains TEXT")
    args = ap.parse_args(argv)
    ok = headline(args.only)
    if not args.skip_scaling:
        scaling()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
