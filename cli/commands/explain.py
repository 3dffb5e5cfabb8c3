"""``autopar explain plan.json``: the stage table, where the time goes, and the alternatives the search rejected."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

NAME = "explain"
HELP = "explain a plan file: stages, per-stage time and memory, time breakdown, next-best alternatives"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", type=Path, help="a plan JSON written by `autopar plan --out`")
    p.add_argument("--gantt", type=Path, default=None, metavar="PNG",
                   help="also draw the pipeline schedule (per stage and micro-batch) and memory per stage")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (stages, time and memory breakdowns with shares, alternatives)")


def run(args: argparse.Namespace) -> int:
    from planner.plan import load_plan

    plan = load_plan(args.plan)
    print(json.dumps(to_dict(plan), indent=1) if args.json else explain(plan))
    if args.gantt:
        from planner.plots import plot_gantt

        print(f"wrote {plot_gantt(plan, args.gantt)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def to_dict(plan) -> dict:
    """The --json object: what ``explain`` prints, as numbers (shares of the step time in 0..1)."""
    pr, st = plan.prediction, plan.solver
    total = sum(pr.breakdown_s.values())
    return {
        "model": plan.model.name, "cluster": plan.cluster.name, "devices": plan.cluster.num_devices,
        "gpu": plan.cluster.gpu, "degrees": dataclasses.asdict(plan.degrees), "zero_stage": plan.zero_stage,
        "sequence_parallel": plan.sequence_parallel, "schedule": dataclasses.asdict(plan.schedule),
        "step_time_s": pr.step_time_s, "tokens_per_s": pr.tokens_per_s, "mfu": pr.mfu,
        "memory_gb_per_device": pr.memory_gb_per_device, "fits": pr.fits, "bottleneck": pr.bottleneck,
        "stages": [{"chunk": s.index, "pp_rank": s.pp_rank, "ranks": list(s.ranks), "gpu": s.gpu,
                    "recompute": s.recompute, "time_per_microbatch_s": s.predicted_time_s,
                    "memory_gb": s.predicted_memory_gb, "modules": list(s.modules)} for s in plan.stages],
        "breakdown": [{"term": k, "time_s": v, "share": v / total if total > 0 else 0.0}
                      for k, v in sorted(pr.breakdown_s.items(), key=lambda kv: (-kv[1], kv[0]))],
        "memory_breakdown_gb": dict(pr.memory_breakdown_gb),
        "alternatives": [{**dataclasses.asdict(a), "slower": a.step_time_s / pr.step_time_s - 1
                          if pr.step_time_s > 0 else None} for a in plan.alternatives],
        "search": {"status": st.status, "structures_explored": st.candidates_explored, "objective_s": st.objective,
                   "bound_s": st.bound, "gap": st.gap},
    }


def _ranks(ranks) -> str:
    if not ranks:
        return "-"
    if list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))


def _modules(mods) -> str:
    if not mods:
        return "-"
    if len(mods) <= 2:
        return ", ".join(mods)
    return f"{mods[0]} .. {mods[-1]} ({len(mods)} modules)"


def stage_table(plan) -> list[str]:
    rows = [("chunk", "pp rank", "ranks", "gpu", "recompute", "time/mb (ms)", "memory (GB)", "modules")]
    for s in plan.stages:
        rows.append((str(s.index), str(s.pp_rank), _ranks(s.ranks), s.gpu or "-", s.recompute,
                     f"{1e3 * s.predicted_time_s:.2f}", f"{s.predicted_memory_gb:.1f}", _modules(s.modules)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]


def time_breakdown(plan) -> list[str]:
    pr = plan.prediction
    total = sum(pr.breakdown_s.values())
    out = []
    for k, v in sorted(pr.breakdown_s.items(), key=lambda kv: (-kv[1], kv[0])):
        share = v / total if total > 0 else 0.0
        out.append(f"  {k:<22} {v:10.4f} s  {100 * share:5.1f}%  {'#' * int(round(40 * share))}")
    out.append(f"  {'step':<22} {pr.step_time_s:10.4f} s   (bottleneck: {pr.bottleneck or 'n/a'})")
    return out


def alternatives(plan) -> list[str]:
    best = plan.prediction.step_time_s
    if not plan.alternatives:
        return ["  (none recorded: the configuration was fixed or nothing else was valid)"]
    out = []
    for i, a in enumerate(plan.alternatives, 1):
        slower = (a.step_time_s / best - 1) * 100 if best > 0 else 0.0
        fit = "" if a.fits else "  (does not fit)"
        out.append(f"  {i}. {a.step_time_s:.4f} s (+{slower:.1f}%), {a.memory_gb_per_device:.1f} GB: {a.summary}{fit}")
    return out


def explain(plan) -> str:
    d, s, pr = plan.degrees, plan.schedule, plan.prediction
    head = (f"{plan.model.name} on {plan.cluster.name} ({plan.cluster.num_devices} x {plan.cluster.gpu}): "
            f"tp={d.tp} pp={d.pp} dp={d.dp} cp={d.cp} ep={d.ep}, ZeRO-{plan.zero_stage}, "
            f"sequence parallel {'on' if plan.sequence_parallel else 'off'}, {s.name}"
            f"{f' v={s.virtual_stages}' if s.virtual_stages > 1 else ''}, micro-batch {s.microbatch_size} x "
            f"{s.num_microbatches}; {pr.step_time_s:.4f} s/step, {pr.tokens_per_s:,.0f} tokens/s, "
            f"MFU {100 * pr.mfu:.1f}%, {pr.memory_gb_per_device:.1f} GB/device")
    mem = [f"  {k:<22} {v:8.2f} GB" for k, v in sorted(pr.memory_breakdown_gb.items(), key=lambda kv: -kv[1])]
    st = plan.solver
    lines = [head, "", "stages:", *("  " + r for r in stage_table(plan)), "", "where the time goes:",
             *time_breakdown(plan)]
    if mem:
        lines += ["", "memory of the fullest device:", *mem]
    lines += ["", "why this plan: the next-best alternatives the search priced:", *alternatives(plan), "",
              f"search: {st.status}, {st.candidates_explored} structures explored, objective {st.objective:.4f} s, "
              f"bound {st.bound:.4f} s, gap {100 * st.gap:.1f}%"]
    return "\n".join(lines)
