"""``autopar estimate``: the cost of one fixed parallel configuration (step time, FLOP rates, memory, breakdown)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from cli.exit import EXIT_NO, EXIT_OK
from costmodel.errors import ConfigError

NAME = "estimate"
HELP = ("predict step time, throughput, MFU and memory of one given configuration (tp/pp/dp/cp/ep, schedule, ...); "
        "exits 1 when it does not fit in device memory")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model spec: a preset (gpt3-175b), inline dims, config.json, "
                   "or module.path:function")
    p.add_argument("--cluster", required=True, metavar="NAME|FILE", help="node type name, 'local' or a cluster .toml")
    p.add_argument("--nodes", type=int, default=None, help="with --cluster NAME: number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="override the node type's GPUs per node")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: devices / (tp*pp*cp))")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size, divides dp (default 1)")
    p.add_argument("--microbatch", type=int, default=None, help="sequences per micro-batch (default: chosen)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved / zero-bubble; default: chosen)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recomputation (default none)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism over tp")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage over dp (default 0)")
    p.add_argument("--attention", choices=("flash", "unfused"), default="flash",
                   help="fused (flash) attention, or scores materialised as in Megatron-LM 2021 (default flash)")
    p.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="reduce gradients after the backward instead of overlapping them with it")
    p.add_argument("--profile", default=None, metavar="CALIBRATION", help="calibration file from `autopar calibrate`")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")


def _config(args: argparse.Namespace, num_devices: int):
    from costmodel.step import ParallelConfig

    dp = args.dp
    if dp is None:
        rest = args.tp * args.pp * args.cp
        if rest < 1 or num_devices % rest:
            raise ConfigError(f"tp*pp*cp={rest} does not divide the cluster's {num_devices} devices; give --dp "
                              f"or degrees whose product divides {num_devices}")
        dp = num_devices // rest
    v = args.virtual_stages
    if v is None and args.schedule in ("gpipe", "1f1b"):
        v = 1
    return ParallelConfig(
        tp=args.tp, pp=args.pp, dp=dp, cp=args.cp, ep=args.ep, microbatch=args.microbatch,
        global_batch=args.global_batch, schedule=args.schedule, virtual_stages=v, recompute=args.recompute,
        sequence_parallel=args.sequence_parallel, zero_stage=args.zero, flash_attention=args.attention == "flash",
        overlap_grad_reduce=not args.no_overlap_grad_reduce,
    )


def to_dict(est, *, model: str, cluster) -> dict:
    """The --json object."""
    cfg = dataclasses.asdict(est.config)
    return {
        "model": model, "cluster": cluster.name, "devices": cluster.num_devices, "config": cfg,
        "chosen": dict(est.chosen), "num_microbatches": est.num_microbatches,
        "step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s,
        "model_tflops_per_gpu": est.model_tflops_per_gpu, "hw_tflops_per_gpu": est.hw_tflops_per_gpu,
        "mfu": est.mfu, "memory_gb_per_device": est.memory_gb_per_device, "memory_limit_gb": est.memory_limit_gb,
        "fits": est.fits, "breakdown": dict(est.breakdown_s), "memory_breakdown_gb": dict(est.memory_breakdown_gb),
        "dominant_memory_term": est.memory.dominant, "bottleneck": est.bottleneck,
        "stage_time_s": list(est.stage_time_s), "stage_memory_gb": list(est.stage_memory_gb),
        "stage_layers": list(est.stage_layers),
    }


def summary(est, *, model: str, cluster) -> str:
    cfg = est.config
    lines = [f"{model} on {cluster.name} ({cluster.num_devices} devices): {cfg.summary()}"]
    if est.chosen:
        lines.append("chosen: " + ", ".join(f"{k}={v}" for k, v in est.chosen.items()))
    lines.append(f"micro-batches per step: {est.num_microbatches}")
    lines.append(f"step time      {est.step_time_s:.4g} s   ({est.tokens_per_s:,.0f} tokens/s)")
    lines.append(f"TFLOP/s / GPU  model {est.model_tflops_per_gpu:.1f}, hardware (with recompute) "
                 f"{est.hw_tflops_per_gpu:.1f};  MFU {est.mfu:.1%}")
    fit = "fits" if est.fits else "DOES NOT FIT"
    lines.append(f"memory / GPU   {est.memory_gb_per_device:.2f} GB of {est.memory_limit_gb:.0f} GB: {fit} "
                 f"(largest term: {est.memory.dominant})")
    total = sum(est.breakdown_s.values()) or 1.0
    lines.append("where the step goes:")
    for k, v in sorted(est.breakdown_s.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:18s} {v:10.4g} s  {v / total:6.1%}")
    lines.append(f"bottleneck: {est.bottleneck}")
    lines.append("memory of the fullest device:")
    for k, v in sorted(est.memory_breakdown_gb.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:18s} {v:10.3f} GB")
    if len(est.stage_time_s) > 1:
        lines.append("per pipeline rank: " + ", ".join(
            f"{t * 1e3:.1f} ms/{m:.1f} GB" for t, m in zip(est.stage_time_s, est.stage_memory_gb)))
    if not est.fits:
        lines.append(f"does not fit: needs {est.memory_gb_per_device:.1f} GB per device, the device has "
                     f"{est.memory_limit_gb:.0f} GB; the largest term is {est.memory.dominant}: try more "
                     "recomputation, a higher ZeRO stage, a smaller micro-batch or more tp/pp")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from costmodel.profiles import resolve_cluster
    from costmodel.step import estimate_step
    from planner.workload import workload_from_model

    cluster = resolve_cluster(args.cluster, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                              profile_path=args.profile)
    workload, _ = workload_from_model(args.model, seq=args.seq)
    est = estimate_step(workload, _config(args, cluster.num_devices), cluster)
    if args.json:
        print(json.dumps(to_dict(est, model=args.model, cluster=cluster), indent=1))
    else:
        print(summary(est, model=args.model, cluster=cluster))
    if not est.fits:
        print(f"autopar estimate: the configuration needs {est.memory_gb_per_device:.1f} GB per device, more than "
              f"the {est.memory_limit_gb:.0f} GB it has", file=sys.stderr)
    return EXIT_OK if est.fits else EXIT_NO
