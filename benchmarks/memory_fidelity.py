"""Predicted vs measured peak memory per device (issue "Memory truth", target: within 10%).

``python -m benchmarks.memory_fidelity [--small-only | --full-only] [--only NAME] [--json FILE]``

Small plans (each made by the planner with ``--fix`` for 2-4 local CPU ranks, as ``autopar validate`` runs
them): the small Llama ``SMALL`` (21M parameters) at global batch 8 as DDP, ZeRO-2, ZeRO-3, tp2, tp2 + SP, pp2
with 1F1B / interleaved / zero-bubble, cp2, and a small Mixtral as ep2; each runs one step on gloo ranks
(``runtime.measure.validate.measure_plan``, bf16 autocast with fp32 parameters: what the planner prices) and
the measured figure is the fullest rank's peak live tensor bytes (``runtime.measure.live_bytes``), against the
plan's ``memory_gb_per_device`` (no allocator reserve on CPU ranks).

Full-scale plans (the planner's own plans): GPT-3 175B on 128 DGX-A100 (1,024 A100), Llama-3 70B on 8 DGX-H100
(64 H100), Mixtral 8x7B on 2 DGX-H100 (16 H100), each checked on its first, middle and last pipeline rank by
``runtime.measure.memcheck.check_plan`` (fake tensors, fake process group), against the plan's per-stage
prediction without the allocator reserve (the measured bytes are tensors).

Errors are (predicted - measured) / measured; the table says which rows are within the 10% target.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

SMALL = "llama:layers=4,hidden=512,ffn=1408,heads=8,kv_heads=8,vocab=8192,seq=256"
SMALL_MOE = "mixtral:layers=4,hidden=512,ffn=1408,heads=8,kv_heads=8,vocab=8192,seq=256,experts=4,topk=2"
TARGET = 0.10

SMALL_CASES = (
    ("DDP dp2", SMALL, 2, "dp=2,zero=0"),
    ("ZeRO-2 dp2", SMALL, 2, "dp=2,zero=2"),
    ("ZeRO-3 dp2", SMALL, 2, "dp=2,zero=3"),
    ("tp2", SMALL, 2, "tp=2,sp=0"),
    ("tp2 + SP", SMALL, 2, "tp=2,sp=1"),
    ("pp2 1F1B", SMALL, 2, "pp=2,schedule=1f1b,mb=1"),
    ("pp2 interleaved", SMALL, 2, "pp=2,schedule=interleaved-1f1b,v=2,mb=1"),
    ("pp2 zero-bubble", SMALL, 2, "pp=2,schedule=zero-bubble,v=2,mb=1,zero=0"),
    ("cp2", SMALL, 2, "cp=2"),
    ("ep2 (Mixtral)", SMALL_MOE, 2, "ep=2,dp=2"),
)

FULL_CASES = (
    ("GPT-3 175B, 1024 A100", "gpt3-175b", "dgx-a100-80gb", 128, 1536),
    ("Llama-3 70B, 64 H100", "llama3-70b", "dgx-h100", 8, 512),
    ("Mixtral 8x7B, 16 H100", "mixtral-8x7b", "dgx-h100", 2, 256),
)


def _label(plan) -> str:
    d = plan.degrees
    parts = [f"{k}{getattr(d, k)}" for k in ("tp", "pp", "dp", "ep", "cp") if getattr(d, k) > 1] or ["single"]
    return "x".join(parts) + f" z{plan.zero_stage}" + (" sp" if plan.sequence_parallel else "") + \
        f" {plan.schedule.name} mb{plan.schedule.microbatch_size}x{plan.schedule.num_microbatches}"


def small_rows(only: str | None = None) -> list[dict]:
    from cli.commands.validate import build_model_for
    from costmodel.profiles import make_cluster
    from planner.search.driver import plan_model
    from runtime.measure.validate import measure_plan

    rows = []
    for name, spec, ranks, fix in SMALL_CASES:
        if only is not None and only.lower() not in name.lower():
            continue
        t0 = time.perf_counter()
        row: dict = {"case": name, "model": spec, "fix": fix}
        try:
            plan = plan_model(spec, make_cluster("local", 1, gpus_per_node=ranks), global_batch=8, fix=fix)
            factory = functools.partial(build_model_for, plan.model.name, plan.global_batch, plan.model.seq_len)
            got = measure_plan(plan, model_factory=factory, steps=1, warmup=0, compute_dtype="bf16", timeout_s=900)
        except Exception as e:  # noqa: BLE001 - a plan the runtime refuses is a row, not the end of the table
            row.update(error_text=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            rows.append(row)
            print(f"{name:<22} failed: {row['error_text']}", file=sys.stderr, flush=True)
            continue
        fullest = max(got, key=lambda m: m.peak_live_bytes)
        pred = plan.prediction.memory_gb_per_device * 1e9
        row.update(plan=_label(plan), predicted_gb=pred / 1e9, measured_gb=fullest.peak_live_bytes / 1e9,
                   error=(pred - fullest.peak_live_bytes) / fullest.peak_live_bytes,
                   predicted_terms_gb=dict(plan.prediction.memory_breakdown_gb),
                   measured_by_category_gb={k: v / 1e9 for k, v in fullest.live_bytes.items()},
                   peak_where=fullest.peak_live_where, rank=fullest.rank, seconds=time.perf_counter() - t0)
        rows.append(row)
        print(_format_small(row), file=sys.stderr, flush=True)
        print(f"{'':<22} measured at the peak: " + ", ".join(
            f"{k} {v:.3f}" for k, v in row["measured_by_category_gb"].items() if v) + "; predicted: " + ", ".join(
            f"{k} {v:.3f}" for k, v in row["predicted_terms_gb"].items() if v), file=sys.stderr, flush=True)
    return rows


def full_rows(only: str | None = None) -> list[dict]:
    from costmodel.profiles import make_cluster
    from planner.search.driver import plan_model
    from runtime.measure.memcheck import check_plan

    rows = []
    for name, spec, node, nodes, batch in FULL_CASES:
        if only is not None and only.lower() not in name.lower():
            continue
        from cli.commands.validate import build_model_for

        t0 = time.perf_counter()
        try:
            plan = plan_model(spec, make_cluster(node, nodes), global_batch=batch, record_timings=False)
            t_plan = time.perf_counter() - t0
            t1 = time.perf_counter()
            factory = functools.partial(build_model_for, plan.model.name, plan.global_batch, plan.model.seq_len)
            got = check_plan(plan, model_factory=factory, ranks="first,middle,last")
            t_check = time.perf_counter() - t1
        except Exception as e:  # noqa: BLE001 - a plan check cannot run is a row, not the end of the table
            text = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append({"case": name, "error_text": text})
            print(f"{name:<22} failed: {text}", file=sys.stderr, flush=True)
            continue
        for m in got:
            row = {"case": name, "plan": _label(plan), "rank": m.rank, "pp_rank": m.coords["pp"],
                   "predicted_gb": m.predicted_tensors / 1e9, "measured_gb": m.measured_peak / 1e9,
                   "error": m.error, "fits_predicted": plan.prediction.fits, "exceeds_measured": m.exceeds,
                   "capacity_gb": m.capacity / 1e9,
                   "measured_by_category_gb": {k: v / 1e9 for k, v in m.measured.items()},
                   "predicted_by_category_gb": None if m.predicted is None else {
                       k: v / 1e9 for k, v in m.predicted.items()},
                   "peak_where": m.peak_where, "plan_s": t_plan, "check_s": t_check, "rank_s": m.seconds}
            rows.append(row)
            print(_format_full(row), file=sys.stderr, flush=True)
    return rows


def _format_small(r: dict) -> str:
    if "error_text" in r:
        return f"{r['case']:<22} {'':<40} failed: {r['error_text']}"
    ok = "ok" if abs(r["error"]) <= TARGET else "off"
    return (f"{r['case']:<22} {r['plan']:<40} {r['predicted_gb']:>8.3f} {r['measured_gb']:>8.3f} "
            f"{100 * r['error']:>+7.1f}% {ok:>4}  peak: {r['peak_where']}")


def _format_full(r: dict) -> str:
    ok = "ok" if abs(r["error"]) <= TARGET else "off"
    fit = "EXCEEDS" if r["exceeds_measured"] else "fits"
    return (f"{r['case']:<22} {r['plan'] + ' rank ' + str(r['rank']):<52} {r['predicted_gb']:>8.2f} "
            f"{r['measured_gb']:>8.2f} {100 * r['error']:>+7.1f}% {ok:>4}  {fit} {r['capacity_gb']:.1f} GB; "
            f"check {r['check_s']:.0f} s; peak: {r['peak_where']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small-only", action="store_true")
    p.add_argument("--full-only", action="store_true")
    p.add_argument("--only", default=None, metavar="NAME",
                   help="run only the rows whose case label contains NAME (case-insensitive), e.g. 'pp2 1F1B'")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    out: dict = {}
    header = f"{'case':<22} {'plan':<40} {'pred GB':>8} {'meas GB':>8} {'error':>8} {'10%':>4}"
    if not args.full_only:
        print(header, file=sys.stderr)
        out["small"] = small_rows(args.only)
    if not args.small_only:
        out["full"] = full_rows(args.only)
    print(header)
    for r in out.get("small", []):
        print(_format_small(r))
    for r in out.get("full", []):
        print(_format_full(r) if "error_text" not in r else f"{r['case']:<22} failed: {r['error_text']}")
    rows = [r for part in out.values() for r in part if "error" in r]
    within = sum(1 for r in rows if abs(r["error"]) <= TARGET)
    print(f"{within} of {len(rows)} rows within {100 * TARGET:.0f}% (error = (predicted - measured) / measured)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
