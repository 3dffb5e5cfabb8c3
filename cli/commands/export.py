"""``autopar export``: a plan file as Megatron-LM flags, a torchtitan TOML or a DeepSpeed JSON config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "export"
HELP = "print a plan's equivalent settings for Megatron-LM, torchtitan or DeepSpeed"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from planner.export import TARGETS

    p.add_argument("plan", type=Path, help="plan JSON written by `autopar plan`")
    p.add_argument("--to", required=True, choices=TARGETS, help="target framework")
    p.add_argument("--out", type=Path, default=None, help="write the settings to a file instead of stdout")


def run(args: argparse.Namespace) -> int:
    from planner.export import export_plan
    from planner.plan import load_plan

    result = export_plan(load_plan(args.plan), args.to)
    if args.out:
        args.out.write_text(result.text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    for note in result.unsupported:
        print(f"not expressible in {args.to}: {note}", file=sys.stderr)
    return 0
