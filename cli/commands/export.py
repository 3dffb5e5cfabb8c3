"""``autopar export``: a plan as a Megatron-LM command line, a torchtitan 0.3.0 job module or a DeepSpeed config,
refused when the target cannot run it or it would not fit under the target's memory layout."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAME = "export"
HELP = ("write a plan's settings for Megatron-LM, torchtitan or DeepSpeed; refuses (exit 1) what the target "
        "cannot run or what would not fit under its memory layout")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from planner.export import TARGETS

    p.add_argument("plan", type=Path, help="plan JSON written by `autopar plan`")
    p.add_argument("--to", required=True, choices=TARGETS, help="target framework")
    p.add_argument("--out", type=Path, default=None, help="write the settings to this file instead of stdout")
    p.add_argument("--model", default=None, metavar="SPEC",
                   help="the model's shape when the plan's model spec does not name it (user code): a preset, "
                        "inline dims or config.json")
    p.add_argument("--force", action="store_true",
                   help="write the settings even when the target cannot run the plan as planned")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (settings text, file name, notes, warnings, refusals, memory per "
                        "pipeline rank) instead of the settings")


def run(args: argparse.Namespace) -> int:
    from planner.export import export_plan
    from planner.models import model_dims
    from planner.plan import load_plan

    plan = load_plan(args.plan)
    dims = model_dims(args.model, seq=plan.model.seq_len) if args.model else None
    result = export_plan(plan, args.to, dims=dims, force=args.force)
    if args.json:
        print(json.dumps(_to_dict(result, out=args.out), indent=1))
        if args.out:
            args.out.write_text(result.text)
        return 0
    if args.out:
        args.out.write_text(result.text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    if result.memory is not None:
        for line in result.memory.lines():
            print(line, file=sys.stderr)
    for note in result.notes:
        print(f"differs in {args.to}: {note}", file=sys.stderr)
    for warning in result.warnings:
        print(f"warning: close to device memory under {warning}", file=sys.stderr)
    for refusal in result.refusals:
        print(f"refused by {args.to} (written anyway, --force): {refusal}", file=sys.stderr)
    return 0


def _to_dict(result, *, out: Path | None) -> dict:
    """The --json object; memory figures in bytes."""
    memory = None
    if result.memory is not None:
        m = result.memory
        memory = {"target": m.target, "mode": m.mode, "formula": m.formula, "dp": m.dp, "ranks": [
            {"pp_rank": r.pp_rank, "gpu": r.gpu, "capacity_bytes": r.capacity_bytes, "planned_bytes": r.planned_bytes,
             "target_bytes": r.target_bytes, "target_states_bytes": r.target_states_bytes, "status": r.status}
            for r in m.ranks]}
    return {"target": result.target, "filename": result.filename, "written_to": str(out) if out else None,
            "text": result.text, "notes": list(result.notes), "warnings": list(result.warnings),
            "refusals": list(result.refusals), "memory": memory}
