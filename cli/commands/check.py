"""``autopar check plan.json``: each distinct rank of a plan built and stepped as the runtime runs it, on fake
tensors under torch's fake process group in this machine's processes (nothing is allocated, nothing is sent);
the peak live tensor bytes by category beside the plan's predicted memory (``runtime.measure.memcheck``).

Exit status: 0 when every measured rank fits its device (live bytes plus the predicted allocator reserve within
the bytes PyTorch can allocate), 1 when one does not, 2 on errors.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

from cli.exit import EXIT_NO, EXIT_OK

NAME = "check"
HELP = ("build and step a plan's distinct ranks on fake tensors (the runtime's own code under the fake process "
        "group); measured peak memory by category vs the prediction; exits 1 when a rank exceeds its device")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", type=Path, help="plan JSON file (from `autopar plan --out`)")
    p.add_argument("--ranks", default="first,middle,last", metavar="SPEC",
                   help="which ranks: first,middle,last (the first rank of those pipeline ranks; default), "
                   "all-distinct (every pipeline rank with the first and last tp / ep / dp shard) or rank numbers")
    p.add_argument("--workers", type=int, default=None,
                   help="ranks measured at once, one process each (default: the CPU count)")
    p.add_argument("--microbatches", default="auto", metavar="auto|all|N",
                   help="micro-batches a pipelined rank replays: auto (default: all under GPipe, else 2 pp for "
                   "1F1B and 3 pp for interleaved / zero-bubble, whose steady rounds repeat the same bytes; "
                   "receive buffers for all), all, or a number; the output says when fewer than all ran")
    p.add_argument("--json", action="store_true", help="print one JSON object (the table goes to stderr)")


def run(args: argparse.Namespace) -> int:
    from costmodel.errors import ConfigError
    from planner.plan import load_plan
    from runtime.measure.memcheck import check_plan, distinct_ranks

    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers {args.workers} must be >= 1")
    plan = load_plan(args.plan)
    chosen = distinct_ranks(plan, args.ranks)
    out = sys.stderr if args.json else sys.stdout
    d = plan.degrees
    print(f"autopar check: {plan.model.name} on {plan.cluster.name}, tp={d.tp} pp={d.pp} dp={d.dp} cp={d.cp} "
          f"ep={d.ep}, ZeRO-{plan.zero_stage}, {plan.schedule.name} {plan.schedule.microbatch_size} x "
          f"{plan.schedule.num_microbatches}; measuring ranks {', '.join(map(str, chosen))} on fake tensors",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    from cli.commands.validate import build_model_for

    factory = functools.partial(build_model_for, plan.model.name, plan.global_batch, plan.model.seq_len)
    results = check_plan(plan, model_factory=factory, ranks=args.ranks, workers=args.workers,
                         microbatches=args.microbatches, progress=lambda m: print(format_rank(m), file=out, flush=True))
    wall = time.perf_counter() - t0
    over = [m.rank for m in results if m.exceeds]
    print(f"{len(results)} rank(s) in {wall:.1f} s; " + (f"ranks {over} exceed their device" if over else
                                                          "every measured rank fits its device"), file=out)
    if args.json:
        print(json.dumps({"plan": str(args.plan), "seconds": wall, "ranks": [m.to_dict() for m in results],
                          "exceeds": over}, indent=1))
    return EXIT_NO if over else EXIT_OK


def format_rank(m) -> str:
    """One rank's block: predicted and measured GB per category, the totals, the error and the capacity check."""
    from runtime.measure.live_bytes import CATEGORIES

    coords = ", ".join(f"{k} {v}" for k, v in m.coords.items())
    lines = [f"rank {m.rank} ({coords}): peak during {m.peak_where or 'setup'}, measured in {m.seconds:.1f} s",
             f"  {'category':<14} {'predicted GB':>12} {'measured GB':>12}"]
    for c in CATEGORIES:
        pred = "-" if m.predicted is None else f"{m.predicted[c] / 1e9:.3f}"
        if m.predicted is None and m.measured[c] == 0:
            continue
        lines.append(f"  {c:<14} {pred:>12} {m.measured[c] / 1e9:>12.3f}")
    lines.append(f"  {'tensors':<14} {m.predicted_tensors / 1e9:>12.3f} {m.measured_peak / 1e9:>12.3f}   "
                 f"error {100 * m.error:+.1f}% (predicted - measured) / measured")
    verdict = "EXCEEDS its device" if m.exceeds else "fits"
    need = (m.measured_peak + m.reserve_for_measured) / 1e9
    lines.append(f"  allocator reserve {m.predicted_reserve / 1e9:.3f} GB predicted; measured + reserve "
                 f"{need:.3f} GB of {m.capacity / 1e9:.3f} GB: {verdict}")
    if m.predicted is None:
        lines.append("  (the plan stores the predicted terms of its fullest pipeline rank only: totals here)")
    for n in m.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)
