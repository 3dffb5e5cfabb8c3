"""``autopar diff``: what changed between two plans and the predicted effect."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "diff"
HELP = "show what changed between two plan files and what the cost model predicts it does"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, help="the first plan JSON")
    p.add_argument("b", type=Path, help="the second plan JSON")


def run(args: argparse.Namespace) -> int:
    from planner.diff import diff_plans, format_diff
    from planner.plan import load_plan

    sys.stdout.write(format_diff(diff_plans(load_plan(args.a), load_plan(args.b))))
    return 0
