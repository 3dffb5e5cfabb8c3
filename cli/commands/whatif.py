"""``autopar whatif``: plan one model on many clusters; a table (and CSV / JSON / plots) of the best plans."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from cli.exit import EXIT_INTERRUPTED, EXIT_OK
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
    p.add_argument("--fix", default=None, metavar="K=V,...",
                   help="pin choices on every cluster, as `autopar plan --fix` (e.g. tp=8,pp=2)")
    p.add_argument("--cache-dir", type=Path, default=None, help="outcome cache (default ~/.cache/autopar/whatif)")
    p.add_argument("--no-cache", action="store_true", help="plan every cluster again, write nothing to the cache")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


class _Progress:
    """A tqdm bar on stderr, one step per finished cluster, with the last cluster's outcome."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        from tqdm import tqdm  # commands import their libraries when they run: `autopar --help` stays fast

        self.bar = tqdm(total=total, file=sys.stderr, unit="cluster", desc="autopar whatif", disable=not enabled)

    def __call__(self, done: int, total: int, row: dict) -> None:
        step = row.get("step_time_s")
        what = row["status"] + (f" {step:.4g} s/step" if isinstance(step, float) and math.isfinite(step) else "")
        self.bar.set_postfix_str(f"{row['cluster']}: {what}", refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def _cell(column: str, v) -> str:
    """One table cell, as ``autopar plan`` prints numbers: tokens/s whole with thousands separators, MFU in
    percent, GB and days to 0.1, dollars whole from $1,000, to the cent below, 3 digits below $1; missing
    values as '-'."""
    import pandas as pd

    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return "-"
    if column == "tokens_per_s":
        return f"{v:,.0f}"
    if column == "mfu":
        return f"{100 * v:.1f}%"
    if column in ("memory_gb", "memory_gb_needed", "train_days"):
        return f"{v:,.1f}"
    if column in ("usd_per_mtok", "train_cost_usd"):
        return f"${v:,.0f}" if v >= 1000 else f"${v:,.2f}" if v >= 1 else f"${v:.3g}"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def format_table(table) -> str:
    """The main columns as text (units in the column names, as in the CSV and JSON)."""
    import pandas as pd

    shown = table[[c for c in _SHOWN if c in table.columns]].dropna(axis=1, how="all")
    cells = pd.DataFrame({c: [_cell(c, v) for v in shown[c]] for c in shown.columns})
    return cells.to_string(index=False)


def run(args: argparse.Namespace) -> int:
    from planner.whatif import cluster_cases, default_cache_dir, parse_sweep, run_whatif

    cases = parse_sweep(args.sweep) if args.sweep else cluster_cases(args.cluster, nodes=args.nodes)
    if args.nodes is not None and args.sweep:
        raise ConfigError("--nodes applies to --cluster; in a sweep give nodes=N1,N2 instead")
    jobs = args.jobs or min(len(cases), os.cpu_count() or 1)
    cache = None if args.no_cache else (args.cache_dir or default_cache_dir())
    progress = _Progress(len(cases), enabled=not args.no_progress)
    try:
        result = run_whatif(args.model, cases, global_batch=args.global_batch, seq=args.seq, tokens=args.tokens,
                            time_limit_s=args.time_limit, fix=args.fix, jobs=jobs, cache_dir=cache,
                            on_result=progress)
    finally:
        progress.close()
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
    return EXIT_INTERRUPTED if result.interrupted else EXIT_OK
