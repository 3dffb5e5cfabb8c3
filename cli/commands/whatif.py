"""``autopar whatif``: plan one model on many clusters; a table (and CSV / JSON / plots) of the best plans."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from cli.commands.plan import add_target_arguments
from costmodel.errors import ConfigError

NAME = "whatif"
HELP = "compare clusters: plan the model on each (names, files or a sweep) and tabulate the best plans"

_SHOWN = ["cluster", "gpus", "status", "tp", "pp", "dp", "cp", "zero", "schedule", "microbatch", "recompute",
          "step_time_s", "tokens_per_s", "mfu", "memory_gb", "memory_gb_needed", "bottleneck", "usd_per_mtok",
          "train_days", "train_cost_usd", "search"]


def _axis(token: str):
    from planner.whatif import parse_axis

    try:
        parse_axis(token)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return token


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model spec: a preset (llama3-70b), inline dims, config.json, ...")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--cluster", nargs="+", metavar="NAME|FILE", help="node type names or cluster .toml files")
    src.add_argument("--sweep", nargs="+", metavar="AXIS=V1,V2", type=_axis,
                     help="sweep axes (cross product): gpu=a100-80gb,h100 nodes=1,2,4 gpus-per-node=8 "
                          "inter-node-gbps=200,400 (NIC Gb/s per GPU) intra=nvlink,pcie")
    p.add_argument("--nodes", type=int, default=None, help="with --cluster NAME: nodes of that type (default 1)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--tokens", type=float, default=None, help="tokens to train, for time and cost (e.g. 1e12)")
    p.add_argument("--csv", type=Path, default=None, help="write the table as CSV")
    p.add_argument("--json", action="store_true", help="print the table as JSON records instead of text")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write PNG charts into DIR")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPU count)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="planning time limit per cluster (s)")
    add_target_arguments(p, auto=True)
    p.add_argument("--cache-dir", type=Path, default=None, help="outcome cache (default ~/.cache/autopar/whatif)")
    p.add_argument("--no-cache", action="store_true", help="plan every cluster again, write nothing to the cache")


class _Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.tty = stream.isatty()

    def __call__(self, done: int, total: int, row: dict) -> None:
        width = 30
        filled = int(width * done / total)
        step = row.get("step_time_s")
        what = f"{row['status']}" + (f" {step:.3g} s/step" if isinstance(step, float) and math.isfinite(step) else "")
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {row['cluster']}: {what}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line + ("\n" if done == total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def format_table(table) -> str:
    """The main columns as text; missing values as '-', floats to 4 significant digits."""
    import pandas as pd

    shown = table[[c for c in _SHOWN if c in table.columns]].dropna(axis=1, how="all")

    def cell(v) -> str:
        if v is None or (not isinstance(v, str) and pd.isna(v)):
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return shown.map(cell).to_string(index=False)


def run(args: argparse.Namespace) -> int:
    from planner.whatif import cluster_cases, default_cache_dir, parse_sweep, run_whatif

    cases = parse_sweep(args.sweep) if args.sweep else cluster_cases(args.cluster, nodes=args.nodes)
    if args.nodes is not None and args.sweep:
        raise ConfigError("--nodes applies to --cluster; in a sweep give nodes=N1,N2 instead")
    jobs = args.jobs or min(len(cases), os.cpu_count() or 1)
    cache = None if args.no_cache else (args.cache_dir or default_cache_dir())
    result = run_whatif(args.model, cases, global_batch=args.global_batch, seq=args.seq, tokens=args.tokens,
                        time_limit_s=args.time_limit, jobs=jobs, cache_dir=cache, on_result=_Progress(sys.stderr),
                        target=args.target, precision=args.precision)
    table = result.table
    if args.csv:
        table.to_csv(args.csv, index=False)
    if args.json:
        print(json.dumps(json.loads(table.to_json(orient="records")), indent=2))
    else:
        print(format_table(table))
    if args.plot:
        from planner.plots import write_whatif_plots

        for path in write_whatif_plots(result, args.plot, tokens=args.tokens):
            print(f"wrote {path}", file=sys.stderr)
    bad = int((table["status"] != "ok").sum())
    print(f"{len(table)} of {len(cases)} clusters in {result.elapsed_s:.1f} s ({bad} without a feasible plan)"
          + ("; interrupted: finished rows only" if result.interrupted else ""), file=sys.stderr)
    return 130 if result.interrupted else 0
