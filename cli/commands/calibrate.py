"""``autopar calibrate``: measure this machine's matmul / memory / collective rates into a profile."""

from __future__ import annotations

import argparse
import json
import sys

NAME = "calibrate"
HELP = "measure this machine (matmuls, a memory-bound op, collectives among local ranks) and write a profile"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="autopar-calibration.json", help="profile to write (.json or .toml)")
    parser.add_argument("--ranks", type=int, default=2, help="largest number of local ranks for collectives (>= 2)")
    parser.add_argument("--concurrent", type=int, default=None, metavar="N",
                        help="CPU: processes that run the compute sweep at once (default --ranks: rates per rank "
                        "while that many ranks train; 1 for a lone process's rates)")
    parser.add_argument("--quick", action="store_true", help="a short sweep (< 60 s on 2 CPU cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--json", action="store_true", help="print the written profile as JSON instead of a summary")


DISPATCH_SPEC = "llama:layers={layers},hidden=16,ffn=32,heads=2,kv_heads=2,vocab=16,seq=8"
"""The decoder whose framework (dispatch) time the CPU calibration measures: Llama-style layers at a width
where arithmetic is negligible, so what remains is per-op Python / autograd / dispatcher time."""


def dispatch_model(layers: int):
    from planner.models import build_model

    return build_model(DISPATCH_SPEC.format(layers=layers), batch=1, seq=8, device="cpu").model


class _Bar:
    """``progress(done, total)`` as a tqdm bar on stderr."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, file=sys.stderr, desc="calibrate", unit="pt", leave=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    from cli.calibration_file import calibration_to_dict, save_calibration
    from runtime.measure.calibrate import run_calibration  # the CLI is the edge that may compose runtime

    bar = None if args.no_progress else _Bar()
    try:
        cal = run_calibration(ranks=args.ranks, quick=args.quick, progress=bar, dispatch_model=dispatch_model,
                              concurrent=args.concurrent)
    finally:
        if bar is not None:
            bar.close()
    path = save_calibration(cal, args.out)
    if args.json:
        print(json.dumps({"written_to": str(path), "calibration": calibration_to_dict(cal)}, indent=1))
        return 0
    print(f"calibrated {cal.device_name} ({cal.accelerator}, {cal.backend}) on {cal.date}")
    for fit in cal.matmul_fits:
        print(
            f"  matmul {fit.dtype}: peak {fit.peak_tflops * 1e3:.1f} GFLOP/s, half-speed below min dim "
            f"{fit.dim_half:.0f} / at {fit.flops_half:.3g} FLOPs per call"
        )
    print(f"  memory-bound (a + b): {cal.membound_gbps:.2f} GB/s")
    if cal.dispatch_fit is not None:
        d = cal.dispatch_fit
        print(f"  framework time per decoder layer: forward {d.layer_fwd_s * 1e3:.2f} ms, backward "
              f"{d.layer_bwd_s * 1e3:.2f} ms; rest of the model {d.model_fwd_s * 1e3:.2f} / {d.model_bwd_s * 1e3:.2f} ms")
    if cal.cpu_cores:
        print(f"  {cal.cpu_cores} cores: ranks beyond that share them (rates scaled per rank by cores / ranks)")
    for cfit in cal.collective_fits:
        ranks = f"2..{cfit.max_ranks} ranks" if cfit.ranks == 0 else f"{cfit.ranks} ranks"
        print(f"  {cfit.op:>14} ({ranks}): latency {cfit.latency_s * 1e6:.1f} us, bus bandwidth {cfit.bus_gbps:.3f} GB/s")
    if cal.notes:
        print(f"  notes: {cal.notes}")
    print(f"wrote {path}  (use it with --cluster local --profile {path})")
    return 0
