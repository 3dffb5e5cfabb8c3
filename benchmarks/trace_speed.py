"""Trace models on this machine: wall time, peak RSS, exact totals.

    python -m benchmarks.trace_speed [--seq 8192] [--models llama3-70b,llama3-405b,mlp-8b,vit-l16] [--plan]

Models: llama3-70b and llama3-405b at ``--seq`` (transformers, from their configs), and two hand-written
``module:function`` models: ``mlp-8b`` (``tests.models.mlp:mlp_8b``, a residual MLP of 8.6B parameters) and
``vit-l16`` (``tests.models.vit:vit_l16``, ViT-L/16 on 224x224 images built from ``nn.TransformerEncoderLayer``).
Each model runs in a fresh Python process, so its peak RSS and its cold-start costs are its own. Reported:
``import_s`` (torch, torch.export and, for the Llamas, transformers: paid once by any process that traces),
``build_s`` (the model on meta), ``trace_s`` (torch.export of the reduced-depth model, OpGraph, expansion to the
full depth), ``blocks_s`` (find_blocks + coarsen), and peak RSS. Targets: build + trace <= 10 s (70B) / 15 s
(405B) / 30 s (the hand-written models), peak RSS <= 2 GB. Totals are checked against the full meta model
(parameters) and against analytic FLOP counts computed here independently of the tracer. ``--plan`` also runs
``python -m cli.main plan --model M --cluster dgx-a100-80gb --nodes 1 --global-batch 64`` for the hand-written
models and prints its wall time and the search line (phases).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

TARGET_S = {"llama3-70b": 10.0, "llama3-405b": 15.0, "mlp-8b": 30.0, "vit-l16": 30.0}
RSS_TARGET_GB = 2.0
USER_MODELS = {"mlp-8b": "tests.models.mlp:mlp_8b", "vit-l16": "tests.models.vit:vit_l16"}
PLAN_ARGS = ["--cluster", "dgx-a100-80gb", "--nodes", "1", "--global-batch", "64"]


def analytic_llama(*, l: int, h: int, ffn: int, heads: int, kv: int, V: int, s: int) -> dict[str, float]:
    """Forward FLOPs of one sequence and model FLOPs (fwd + bwd, dense attention, no recompute)."""
    hd = h // heads
    proj = 2 * s * h * (2 * h + 2 * kv * hd)  # q, o and the narrower k, v (GQA)
    mlp = 3 * 2 * s * h * ffn  # SwiGLU: gate, up, down
    attn = 4 * s * s * h  # QK^T and AV, dense
    fwd = l * (proj + mlp + attn) + 2 * s * h * V  # + LM head
    return {"flops_fwd": float(fwd), "model_flops": 3.0 * fwd}


def analytic_mlp_8b() -> dict[str, float]:
    """One sample: input projection 1024 -> 8192, 16 blocks 8192 -> 32768 -> 8192, classifier 8192 -> 1000.
    The input projection reads the raw features (no input gradient): its backward is the weight gradient only."""
    first = 2 * 1024 * 8192
    fwd = first + 16 * 2 * (2 * 8192 * 32768) + 2 * 8192 * 1000
    return {"flops_fwd": float(fwd), "model_flops": 3.0 * fwd - first}


def analytic_vit_l16() -> dict[str, float]:
    """One 224x224 image: 16x16 patch conv (196 patches, no input gradient), 24 layers over 197 tokens (packed
    q/k/v 1024 -> 3072, out 1024 -> 1024, MLP 1024 -> 4096 -> 1024, attention 4 s^2 h), head on the class token."""
    s, h, f, l = 197, 1024, 4096, 24
    patch = 2 * 196 * h * 3 * 16 * 16
    layer = 2 * s * h * 3 * h + 2 * s * h * h + 2 * 2 * s * h * f + 4 * s * s * h
    fwd = patch + l * layer + 2 * h * 1000
    return {"flops_fwd": float(fwd), "model_flops": 3.0 * fwd - patch}


def one(name: str, seq: int) -> dict:
    t0 = time.perf_counter()
    import torch
    import torch.export._trace  # noqa: F401  (imported on the first export, with torch._dynamo: seconds)

    from planner.graph import coarsen, find_blocks
    from planner.models import build_model
    from planner.trace import cast_floating, trace

    if name not in USER_MODELS:
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401  (transformers imports lazily)
    t1 = time.perf_counter()
    spec = USER_MODELS.get(name, name)
    bundle = build_model(spec, seq=None if name in USER_MODELS else seq)
    model = bundle.model
    full_params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16)
    inputs = cast_floating(bundle.example_inputs, torch.bfloat16)
    t2 = time.perf_counter()
    graph = trace(model, inputs)
    t3 = time.perf_counter()
    blocks = find_blocks(graph)
    coarse = coarsen(graph)
    t4 = time.perf_counter()
    d = bundle.dims
    if name == "mlp-8b":
        ref = analytic_mlp_8b()
    elif name == "vit-l16":
        ref = analytic_vit_l16()
    else:
        ref = analytic_llama(l=d.layers, h=d.hidden, ffn=d.ffn_hidden, heads=d.heads, kv=d.kv_heads, V=d.vocab,
                             s=seq)
    return {
        "model": spec, "seq": seq if name not in USER_MODELS else None, "import_s": t1 - t0, "build_s": t2 - t1,
        "trace_s": t3 - t2, "blocks_s": t4 - t3,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "params": graph.params, "params_full_model": full_params,
        "flops_fwd": graph.flops_fwd, "flops_fwd_analytic": ref["flops_fwd"],
        "model_flops": graph.model_flops, "model_flops_analytic": ref["model_flops"],
        "nodes": len(graph.nodes), "nodes_coarse": len(coarse.nodes), "blocks": len(blocks),
        "traced_layers": graph.traced_layers, "layers": len(graph.layer_fqns),
    }


def plan(name: str) -> str:
    """Wall time and the search line of ``cli.main plan`` for a hand-written model, in a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "cli.main", "plan", "--model", USER_MODELS[name], *PLAN_ARGS],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        return f"  plan: FAILED (rc {proc.returncode}) after {wall:.1f} s: {proc.stderr.strip()[-600:]}"
    search = next((ln for ln in proc.stdout.splitlines() if ln.startswith("search")), "")
    step = next((ln for ln in proc.stdout.splitlines() if ln.startswith("step time")), "")
    return f"  plan: {wall:.1f} s wall (target {TARGET_S[name]:.0f} s)\n    {step}\n    {search}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--models", default="llama3-70b,llama3-405b,mlp-8b,vit-l16")
    ap.add_argument("--plan", action="store_true", help="also time autopar plan on the hand-written models")
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
        label = f"{spec} seq {r['seq']}" if r["seq"] else f"{spec} ({r['model']})"
        print(f"{label}: build+trace {wall:.2f} s, end to end {wall + r['import_s']:.2f} s (target {target:.0f} s; build {r['build_s']:.2f}, "
              f"trace {r['trace_s']:.2f}, blocks+coarsen {r['blocks_s']:.2f}; imports {r['import_s']:.2f} s), "
              f"peak RSS {r['peak_rss_gb']:.2f} GB (target {RSS_TARGET_GB:.0f})")
        print(f"  traced {r['traced_layers']} of {r['layers']} layers; {r['nodes']} ops ({r['nodes_coarse']} coarse), "
              f"{r['blocks']} blocks")
        print(f"  params {r['params']:,} vs full meta model {r['params_full_model']:,}: "
              f"{'equal' if params_ok else 'DIFFERENT'}")
        print(f"  model FLOPs {r['model_flops']:.6e} vs analytic {r['model_flops_analytic']:.6e} "
              f"(rel. error {flops_err:.1e}); forward {r['flops_fwd']:.6e} vs {r['flops_fwd_analytic']:.6e}")
        if args.plan and spec in USER_MODELS:
            print(plan(spec))
        print(f"  {'PASS' if passed else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
