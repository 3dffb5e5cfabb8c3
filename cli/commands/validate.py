"""``autopar validate``: run a plan for a few steps on local gloo ranks; measured step time and memory beside the
plan's predictions.

``autopar validate plan.json [plan2.json ...]`` measures saved plans (made for ``--cluster local``);
``autopar validate --model SPEC --cluster local --gpus-per-node N --global-batch B [--fix tp=2,dp=2 ...]`` makes
the plan(s) on the fly (one per ``--fix``), priced with the local calibration (``--profile``, default the newest
file in ``profiles/calibration/``), and measures them. ``--calibrate`` first takes a quick calibration with as
many ranks as the plans use (so prediction and measurement see the machine in the same state; the machine may
be shared) and prices the plans with it; each plan's ranks then measure the compute rates again right after
their steps (~15 s), all at once. Every plan is then priced with those sweeps pooled (per calibration point the
median over the plans: on 2 cores at load 15-25 one 15 s sweep was up to 2.3x off the next for the same work),
``own s`` with its own sweep alone (``--own-calibration`` makes that the prediction). ``--in-turns`` runs
plans of one world size in the same ranks, a step of each in turn, then one sweep: the load moves every plan
alike (step times only). Plans are planned and priced for the dtype that runs (``plan_model(compute_dtype=)``:
fp32 here moves 4 bytes per element).

Compute dtype: ``auto`` runs bf16 (what the planner prices) only where the calibration measured bf16 matmuls at
least as fast as fp32; a CPU without native bf16 emulates it 30-70x slower than fp32 (0.4-2.9 vs 44-90 GFLOP/s
here), so it runs fp32 and the plans made here are priced with the fp32 fit alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from cli.exit import EXIT_NO, EXIT_OK

NAME = "validate"
HELP = ("run plans for a few steps on local ranks; measured step time / memory vs the plan's predictions; exits 1 "
        "when a plan's measured step time is more than 15 percent off its prediction")

TOLERANCE = 0.15
"""Largest |predicted - measured| / measured step time counted as within (issue 12's target for 4 gloo ranks)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plans", nargs="*", type=Path, help="plan JSON files (from `autopar plan --cluster local`)")
    p.add_argument("--model", default=None, help="model spec, to plan on the fly (instead of plan files)")
    p.add_argument("--cluster", default="local", help="cluster to plan for on the fly (default local)")
    p.add_argument("--gpus-per-node", type=int, default=4, help="local ranks to plan for and run (default 4)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step when planning (default 8)")
    p.add_argument("--seq", type=int, default=None, help="sequence length when planning (default the model's)")
    p.add_argument("--fix", action="append", default=None, metavar="K=V,...",
                   help="pin choices (as `autopar plan --fix`); repeat for several plans; default: the planner's")
    p.add_argument("--profile", default=None, metavar="CALIBRATION",
                   help="calibration from `autopar calibrate` (default: the newest in profiles/calibration/)")
    p.add_argument("--calibrate", action="store_true",
                   help="take a quick calibration with the plans' rank count first and price the plans with it")
    p.add_argument("--in-turns", action="store_true",
                   help="measure plans of one world size in the same ranks, their steps in turns, so a shared "
                   "machine's load moves every plan alike (step times only: memory is not measured then)")
    p.add_argument("--own-calibration", action="store_true",
                   help="with --calibrate: price each plan with the compute its own ranks measured right after its "
                   "steps (default: every plan's sweeps pooled, the median per point; `own s` shows both)")
    p.add_argument("--calibration-out", type=Path, default=None, metavar="FILE",
                   help="where --calibrate writes its profile (default: a temporary file)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per plan (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: the calibration's)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="compute dtype; auto (default): bf16 (what the planner prices) when the calibration's bf16 "
                   "matmuls are at least as fast as its fp32 ones, else fp32 (priced with the fp32 fit alone)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON object (the table goes to stderr)")


def build_model_for(spec: str, batch: int, seq: int):
    """The meta-device model of ``spec`` (module level: pickled by name into the rank processes)."""
    from planner.models import build_model

    return build_model(spec, batch=batch, seq=seq, device="meta").model


def _plans(args: argparse.Namespace, cal, dtype: str = "bf16") -> list:
    from costmodel.errors import ConfigError
    from costmodel.profiles import load_cluster_file, make_cluster
    from planner.plan import load_plan
    from planner.search.driver import plan_model

    if args.plans and args.model:
        raise ConfigError("give plan files or --model (to plan on the fly), not both")
    if args.plans:
        return [load_plan(p) for p in args.plans]
    if not args.model:
        raise ConfigError("nothing to validate: give plan files or --model SPEC --cluster local --gpus-per-node N")
    if args.cluster.endswith(".toml"):
        cluster = load_cluster_file(args.cluster, calibration=cal)
    else:
        cluster = make_cluster(args.cluster, 1, gpus_per_node=args.gpus_per_node, calibration=cal)
    return [plan_model(args.model, cluster, global_batch=args.global_batch, seq=args.seq, fix=fix,
                       compute_dtype=dtype)
            for fix in (args.fix or [None])]


def _label(plan) -> str:
    d = plan.degrees
    parts = [f"{k}{getattr(d, k)}" for k in ("tp", "pp", "dp", "ep", "cp") if getattr(d, k) > 1] or ["single"]
    extra = f" z{plan.zero_stage}" + (" sp" if plan.sequence_parallel else "")
    recompute = {st.recompute for st in plan.stages}
    if recompute != {"none"}:
        extra += " rc=" + "/".join(sorted(recompute))
    sched = f" {plan.schedule.name} mb{plan.schedule.microbatch_size}x{plan.schedule.num_microbatches}"
    return "x".join(parts) + extra + sched


def _calibrate(args: argparse.Namespace) -> Path:
    import tempfile

    from cli.calibration_file import save_calibration
    from cli.commands.calibrate import dispatch_model
    from runtime.measure.calibrate import run_calibration

    print(f"autopar validate: quick calibration on {args.gpus_per_node} ranks first ...", file=sys.stderr, flush=True)
    cal = run_calibration(ranks=max(2, args.gpus_per_node), quick=True, dispatch_model=dispatch_model)
    out = args.calibration_out or Path(tempfile.mkdtemp(prefix="autopar-validate-")) / "calibration.json"
    return save_calibration(cal, out)


def _measure(args: argparse.Namespace, plan, *, dtype: str, threads: int) -> list:
    """Run ``plan``'s steps on its ranks (with ``--calibrate``, the compute sweep right after)."""
    from cli.commands.calibrate import dispatch_model
    from runtime.measure.validate import measure_plan

    if "local" not in plan.cluster.name:
        print(f"autopar validate: warning: plan made for {plan.cluster.name!r}, not 'local': predictions are "
              "for that cluster", file=sys.stderr)
    factory = functools.partial(build_model_for, plan.model.name, plan.global_batch, plan.model.seq_len)
    return measure_plan(plan, model_factory=factory, steps=args.steps, warmup=args.warmup, threads_per_rank=threads,
                        compute_dtype=dtype, calibrate_after=args.calibrate, dispatch_model=dispatch_model)


def _measure_in_turns(args: argparse.Namespace, plans: list, *, dtype: str, threads: int) -> list:
    """Every plan in the same ranks, their steps in turns (``runtime.measure.validate.measure_plans``)."""
    from cli.commands.calibrate import dispatch_model
    from runtime.measure.validate import measure_plans

    print(f"autopar validate: {len(plans)} plans in the same {plans[0].degrees.world_size} ranks, their steps in "
          "turns", file=sys.stderr, flush=True)
    factories = [functools.partial(build_model_for, p.model.name, p.global_batch, p.model.seq_len) for p in plans]
    return measure_plans(plans, model_factories=factories, steps=args.steps, warmup=args.warmup,
                         threads_per_rank=threads, compute_dtype=dtype, calibrate_after=args.calibrate,
                         dispatch_model=dispatch_model)


def _repriced(plan, cal, dtype: str):
    from costmodel.profiles import make_cluster
    from planner.reprice import calibration_for, reprice

    cluster = make_cluster("local", 1, gpus_per_node=plan.degrees.world_size, calibration=calibration_for(cal, dtype))
    return reprice(plan, cluster, dtype=dtype)


def _rows(args: argparse.Namespace, measured: list, *, cal, dtype: str) -> list[dict]:
    """One row per (plan, measurements). With ``--calibrate``: ``own_s`` prices the plan with the compute its
    ranks measured right after its steps, ``predicted_s`` with every plan's sweeps pooled (the median per point,
    ``runtime.measure.compute.pooled_compute``) unless ``--own-calibration``."""
    from runtime.measure.compute import pooled_compute, with_compute

    if not args.calibrate:
        return [_row(plan, got) for plan, got in measured]
    pooled = pooled_compute(cal, [[m.compute_sweep for m in got] for _, got in measured])
    rows = []
    for plan, got in measured:
        own = _repriced(plan, with_compute(cal, [m.compute_sweep for m in got]), dtype)
        row = _row(own if args.own_calibration else _repriced(plan, pooled, dtype), got)
        row["own_s"] = own.prediction.step_time_s
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    import os

    from costmodel.errors import ConfigError
    from costmodel.profiles import load_calibration
    from planner.reprice import calibration_for
    from runtime.measure.calibrate import latest_calibration
    from runtime.measure.validate import compute_dtype

    if args.calibrate and args.plans:
        raise ConfigError("--calibrate prices plans made on the fly (--model); saved plan files keep their predictions")
    profile = _calibrate(args) if args.calibrate else (Path(args.profile) if args.profile else latest_calibration())
    cal = load_calibration(profile) if profile else None
    threads = args.threads if args.threads is not None else (cal.threads_per_rank if cal is not None else 1)
    dtype = compute_dtype(cal, args.dtype)
    plans = _plans(args, calibration_for(cal, dtype), dtype)
    load_before = os.getloadavg()[0]
    print(f"autopar validate: {len(plans)} plan(s), calibration {profile or 'none'}, {threads} thread(s) per rank, "
          f"{args.warmup} warm-up + {args.steps} measured steps, compute {dtype}", file=sys.stderr)
    measured = []
    out = sys.stderr if args.json else sys.stdout
    if args.in_turns and len(plans) > 1 and len({p.degrees.world_size for p in plans}) == 1:
        measured = list(zip(plans, _measure_in_turns(args, plans, dtype=dtype, threads=threads)))
        if not args.calibrate:
            print(_format([_row(*m) for m in measured], header=True), flush=True, file=out)
    for i, plan in enumerate(plans if not measured else []):
        measured.append((plan, _measure(args, plan, dtype=dtype, threads=threads)))
        if not args.calibrate:
            print(_format([_row(*measured[-1])], header=i == 0), flush=True, file=out)
        else:
            print(f"autopar validate: measured {_label(plan)} ({i + 1} of {len(plans)})", file=sys.stderr, flush=True)
    if not measured:
        raise ConfigError("no plans measured")
    rows = _rows(args, measured, cal=cal, dtype=dtype)
    if args.calibrate:
        print(_format(rows, header=True), flush=True, file=out)
    world = plans[-1].degrees.world_size
    shared = ""
    if cal is not None and cal.cpu_cores:
        shared = (f"; the cost model prices each rank at {cal.rank_share(world):.2f}x the calibrated rate "
                  f"(measured with {cal.concurrent_ranks} process(es) at once)")
    print(f"machine: {world} ranks on {os.cpu_count()} cores, load average {load_before:.1f} before / "
          f"{os.getloadavg()[0]:.1f} after the runs{shared}", file=out)
    within = sum(1 for r in rows if abs(r["error"]) <= TOLERANCE)
    print(f"{within} of {len(rows)} plans within {TOLERANCE:.0%} of the predicted step time (meas s: the median step, "
          "best s: the fastest, each the slowest rank's time; own s: priced with the plan's own sweep)", file=out)
    for r in rows:
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["breakdown_s"].items() if v > 0)
        print(f"  predicted ms {r['plan']}: {parts}", file=out)
    if args.json:
        print(json.dumps({"rows": rows, "within_tolerance": within, "tolerance": TOLERANCE}, indent=1))
    return EXIT_OK if within == len(rows) else EXIT_NO


def _row(plan, got) -> dict:
    """One table row. ``measured_s`` is the median step (a shared machine's other jobs slow some steps; the
    calibration, measured with the same ranks at once just before, keeps its median blocks alike),
    ``fastest_s`` the fastest. ``measured_gb``: the fullest rank's peak live tensor bytes (the memory the plan's
    ``memory_gb_per_device`` describes less its allocator reserve, the CUDA context and fragmentation margin
    that live tensors and ``torch.cuda.max_memory_allocated`` do not count: ``predicted_tensor_gb``; zero on CPU
    ranks; None where not measured, as in turns), ``memory_error`` that prediction's error relative to it."""
    import statistics

    from runtime.measure.validate import step_times_s

    steps = step_times_s(got)
    measured_s = statistics.median(steps)
    fullest = max(got, key=lambda m: m.peak_live_bytes)
    # the largest peak of live tensor bytes over ranks (on CUDA: torch.cuda.max_memory_allocated where larger)
    # None where memory was not measured (plans run in turns count no live bytes)
    measured_gb = max(max(m.peak_live_bytes, m.cuda_max_allocated_bytes) for m in got) / 1e9 or None
    predicted_s = plan.prediction.step_time_s
    tensors_gb = plan.prediction.memory_gb_per_device - plan.prediction.memory_breakdown_gb.get("allocator_reserve", 0.0)
    return {
        "plan": _label(plan),
        "predicted_s": predicted_s,
        "measured_s": measured_s,
        "fastest_s": min(steps),
        "error": (predicted_s - measured_s) / measured_s,
        "predicted_gb": plan.prediction.memory_gb_per_device,
        "measured_gb": measured_gb,
        "predicted_tensor_gb": tensors_gb,
        "memory_error": (tensors_gb - measured_gb) / measured_gb if measured_gb else None,
        "measured_by_category_gb": {k: v / 1e9 for k, v in fullest.live_bytes.items()},
        "measured_peak_where": fullest.peak_live_where,
        "per_rank_live_gb": [m.peak_live_bytes / 1e9 for m in got],
        "cuda_max_allocated_gb": max(m.cuda_max_allocated_bytes for m in got) / 1e9,
        "model_rss_gb": max(m.model_rss_bytes for m in got) / 1e9,
        "peak_rss_gb": max(m.peak_rss_bytes for m in got) / 1e9,
        "per_rank_s": [m.step_time_s for m in got],
        "breakdown_s": dict(plan.prediction.breakdown_s),
    }


def _format(rows: list[dict], *, header: bool) -> str:
    lines = []
    if header:
        lines.append(f"{'plan':<36} {'pred s':>8} {'meas s':>8} {'error':>7} {'best s':>8} {'own s':>7} {'pred GB':>8} "
                     f"{'meas GB':>8} {'mem err':>7} {'RSS GB':>7}  per-rank median s")
    for r in rows:
        ranks = " ".join(f"{t:.3f}" for t in r["per_rank_s"])
        own = f"{r['own_s']:>7.3f}" if "own_s" in r else f"{'-':>7}"
        mem_err = "-" if r["memory_error"] is None else f"{100 * r['memory_error']:+.1f}%"
        meas_gb = "-" if r["measured_gb"] is None else f"{r['measured_gb']:.3f}"
        lines.append(f"{r['plan']:<36} {r['predicted_s']:>8.3f} {r['measured_s']:>8.3f} {100 * r['error']:>+6.1f}% "
                     f"{r['fastest_s']:>8.3f} {own} {r['predicted_tensor_gb']:>8.3f} {meas_gb:>8} {mem_err:>7} "
                     f"{r['peak_rss_gb']:>7.3f}  {ranks}")
    return "\n".join(lines)
