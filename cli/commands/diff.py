"""``autopar diff``: what changed between two plans and the predicted effect."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli.exit import EXIT_NO, EXIT_OK

NAME = "diff"
HELP = ("show what changed between two plan files and what the cost model predicts it does; exits 0 when the "
        "plans are identical, 1 when they differ (as diff(1))")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, help="the first plan JSON")
    p.add_argument("b", type=Path, help="the second plan JSON")
    p.add_argument("--json", action="store_true", help="print the changes and effects as one JSON object")


def run(args: argparse.Namespace) -> int:
    from planner.diff import diff_plans, format_diff
    from planner.plan import load_plan

    diff = diff_plans(load_plan(args.a), load_plan(args.b))
    if args.json:
        print(json.dumps(diff.to_dict(), indent=1))
    else:
        sys.stdout.write(format_diff(diff))
    return EXIT_OK if diff.identical else EXIT_NO
