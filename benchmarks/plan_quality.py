"""Plan quality: on every Megatron-LM SC21 case (Tables 1 and 2), the planner's plan vs the published configuration.

Both are priced by the same cost model (``costmodel.step.estimate_step``): the published tp/pp/dp, micro-batch,
schedule and full recomputation as ``autopar estimate`` would price them, and the plan ``autopar plan`` finds
for the same model, cluster and global batch. A case passes when the plan predicts at least the published
configuration's throughput and fits in memory.

    python -m benchmarks.plan_quality [--cases ID,ID] [--time-limit S] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

_DATA = Path(__file__).with_name("data") / "megatron_sc21.json"


def load_cases(path: Path = _DATA) -> list:
    """Every case of Tables 1 and 2, with its published configuration as ``benchmarks.fidelity`` reads it."""
    from benchmarks.fidelity import load_cases as fidelity_cases

    return fidelity_cases(path)


def model_spec(case) -> str:
    d = case.dims
    return f"gpt:layers={d['layers']},hidden={d['hidden']},heads={d['heads']},vocab=51200,seq=2048,ffn={4 * d['hidden']}"


def published_config(case):
    """The published degrees, micro-batch, schedule, recomputation and ZeRO stage, priced with the kernels and
    overlap the planner assumes (flash attention, gradient reduction overlapped), as ``autopar estimate`` does."""
    return dataclasses.replace(case.config, flash_attention=True, overlap_grad_reduce=True)


def _summary(cfg) -> str:
    out = f"tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} mb={cfg.microbatch} {cfg.schedule}"
    out += f" v={cfg.virtual_stages}" if cfg.virtual_stages > 1 else ""
    return out + (f" z{cfg.zero_stage}" if cfg.zero_stage else "")


def run_case(case, *, time_limit_s: float | None = None) -> dict:
    from costmodel.profiles import make_cluster
    from costmodel.step import estimate_step
    from planner.search.driver import plan_model
    from planner.workload import workload_from_model

    spec = model_spec(case)
    cluster = make_cluster("dgx-a100-80gb", case.gpus // 8)
    workload, _ = workload_from_model(spec, batch=1, seq=2048)
    cfg = published_config(case)
    pub = estimate_step(workload, cfg, cluster)
    t0 = time.perf_counter()
    plan = plan_model(spec, cluster, global_batch=cfg.global_batch, time_limit_s=time_limit_s)
    wall = time.perf_counter() - t0
    d, s, pr = plan.degrees, plan.schedule, plan.prediction
    return {
        "id": case.id,
        "gpus": cluster.num_devices,
        "published": _summary(cfg),
        "published_step_s": pub.step_time_s,
        "published_tokens_per_s": pub.tokens_per_s,
        "published_fits": bool(pub.fits),
        "published_memory_gb": pub.memory_gb_per_device,
        "measured_tflops_per_gpu": case.measured_tflops,
        "published_hw_tflops_pred": pub.hw_tflops_per_gpu,
        "plan": f"tp={d.tp} pp={d.pp} dp={d.dp}" + (f" cp={d.cp}" if d.cp > 1 else "")
                + f" mb={s.microbatch_size} {s.name}" + (f" v={s.virtual_stages}" if s.virtual_stages > 1 else "")
                + f" rc={plan.stages[0].recompute} z{plan.zero_stage}" + (" sp" if plan.sequence_parallel else ""),
        "plan_step_s": pr.step_time_s,
        "plan_tokens_per_s": pr.tokens_per_s,
        "plan_fits": bool(pr.fits),
        "plan_memory_gb": pr.memory_gb_per_device,
        "speedup": pub.step_time_s / pr.step_time_s,
        "status": plan.solver.status,
        "plan_wall_s": wall,
        "ok": bool(pr.fits and pr.tokens_per_s >= pub.tokens_per_s * (1 - 1e-9)),
    }


def format_table(rows: list[dict]) -> str:
    head = (f"{'case':<34} {'gpus':>5}  {'published config':<42} {'pub s':>8} {'fits':>4}  "
            f"{'planner config':<60} {'plan s':>8} {'fits':>4} {'speedup':>7} {'ok':>3} {'wall s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['id']:<34} {r['gpus']:>5}  {r['published']:<42} {r['published_step_s']:>8.3f} "
            f"{'yes' if r['published_fits'] else 'NO':>4}  {r['plan']:<60} {r['plan_step_s']:>8.3f} "
            f"{'yes' if r['plan_fits'] else 'NO':>4} {r['speedup']:>6.2f}x {'ok' if r['ok'] else 'NO':>3} "
            f"{r['plan_wall_s']:>6.1f}")
    n_ok = sum(r["ok"] for r in rows)
    lines.append(f"{n_ok}/{len(rows)} cases: the plan fits and predicts at least the published throughput")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help="comma-separated case ids (default: all)")
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cases = load_cases()
    if args.cases:
        want = set(args.cases.split(","))
        cases = [c for c in cases if c.id in want]
    rows = []
    for c in cases:
        rows.append(run_case(c, time_limit_s=args.time_limit))
        print(f"  {c.id}: {rows[-1]['plan']} {rows[-1]['speedup']:.2f}x", file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
