"""Trace llama3-70b and llama3-405b at seq 8192 on this machine: wall time, peak RSS, exact totals.

    python -m benchmarks.trace_speed [--seq 8192] [--models llama3-70b,llama3-405b]

Each model runs in a fresh Python process, so its peak RSS and its cold-start costs are its own. Reported:
``import_s`` (torch + transformers + its Llama modules, paid once by any process that traces), ``build_s`` (the model
on meta), ``trace_s`` (torch.export of the reduced-depth model, OpGraph, expansion to the full depth),
``blocks_s`` (find_blocks + coarsen), and peak RSS. Targets: build + trace <= 10 s (70B) / 15 s (405B),
peak RSS <= 2 GB. Totals are checked against the full meta model (parameters) and against the analytic
Llama count (FLOPs), computed here independently of the tracer.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

TARGET_S = {"llama3-70b": 10.0, "llama3-405b": 15.0}
RSS_TARGET_GB = 2.0


def analytic_llama(*, l: int, h: int, ffn: int, heads: int, kv: int, V: int, s: int) -> dict[str, float]:
    """Forward FLOPs of one sequence and model FLOPs (fwd + bwd, dense attention, no recompute)."""
    hd = h // heads
    proj = 2 * s * h * (2 * h + 2 * kv * hd)  # q, o and the narrower k, v (GQA)
    mlp = 3 * 2 * s * h * ffn  # SwiGLU: gate, up, down
    attn = 4 * s * s * h  # QK^T and AV, dense
    fwd = l * (proj + mlp + attn) + 2 * s * h * V  # + LM head
    return {"flops_fwd": float(fwd), "model_flops": 3.0 * fwd}


def one(spec: str, seq: int) -> dict:
    t0 = time.perf_counter()
    import torch  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401  (transformers imports lazily)

    from planner.graph import coarsen, find_blocks
    from planner.models import build_model
    from planner.trace import trace

    t1 = time.perf_counter()
    bundle = build_model(spec, seq=seq)
    model = bundle.model
    full_params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16)
    t2 = time.perf_counter()
    graph = trace(model, bundle.example_inputs)
    t3 = time.perf_counter()
    blocks = find_blocks(graph)
    coarse = coarsen(graph)
    t4 = time.perf_counter()
    d = bundle.dims
    ref = analytic_llama(l=d.layers, h=d.hidden, ffn=d.ffn_hidden, heads=d.heads, kv=d.kv_heads, V=d.vocab, s=seq)
    return {
        "model": spec, "seq": seq, "import_s": t1 - t0, "build_s": t2 - t1, "trace_s": t3 - t2,
        "blocks_s": t4 - t3, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "params": graph.params, "params_full_model": full_params,
        "flops_fwd": graph.flops_fwd, "flops_fwd_analytic": ref["flops_fwd"],
        "model_flops": graph.model_flops, "model_flops_analytic": ref["model_flops"],
        "nodes": len(graph.nodes), "nodes_coarse": len(coarse.nodes), "blocks": len(blocks),
        "traced_layers": graph.traced_layers, "layers": len(graph.layer_fqns),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--models", default="llama3-70b,llama3-405b")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.seq)))
        return 0
    ok = True
    for spec in args.models.split(","):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.trace_speed", "--one", spec, "--seq", str(args.seq)],
                              capture_output=True, text=True)
        if proc.returncode:
            print(f"{spec}: failed\n{proc.stderr[-2000:]}")
            ok = False
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        wall = r["build_s"] + r["trace_s"]
        target = TARGET_S.get(spec, 15.0)
        params_ok = r["params"] == r["params_full_model"]
        flops_err = r["model_flops"] / r["model_flops_analytic"] - 1
        passed = wall <= target and r["peak_rss_gb"] <= RSS_TARGET_GB and params_ok and abs(flops_err) < 1e-9
        ok &= passed
        print(f"{spec} seq {r['seq']}: build+trace {wall:.2f} s, end to end {wall + r['import_s']:.2f} s (target {target:.0f} s; build {r['build_s']:.2f}, "
              f"trace {r['trace_s']:.2f}, blocks+coarsen {r['blocks_s']:.2f}; imports {r['import_s']:.2f} s), "
              f"peak RSS {r['peak_rss_gb']:.2f} GB (target {RSS_TARGET_GB:.0f})")
        print(f"  traced {r['traced_layers']} of {r['layers']} layers; {r['nodes']} ops ({r['nodes_coarse']} coarse), "
              f"{r['blocks']} blocks")
        print(f"  params {r['params']:,} vs full meta model {r['params_full_model']:,}: "
              f"{'equal' if params_ok else 'DIFFERENT'}")
        print(f"  model FLOPs {r['model_flops']:.6e} vs analytic {r['model_flops_analytic']:.6e} "
              f"(rel. error {flops_err:.1e}); forward {r['flops_fwd']:.6e} vs {r['flops_fwd_analytic']:.6e}")
        print(f"  {'PASS' if passed else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
