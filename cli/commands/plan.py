"""``autopar plan``: search the parallel configuration of a model on a cluster and write the partition JSON."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

NAME = "plan"
HELP = "find the fastest parallel plan that fits (tp/pp/dp/cp/ep, schedule, micro-batches, ZeRO, recompute)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model spec: a preset (gpt3-175b), inline dims, config.json, "
                   "or module.path:function")
    p.add_argument("--cluster", required=True, metavar="NAME|FILE", help="node type name, 'local' or a cluster .toml")
    p.add_argument("--nodes", type=int, default=None, help="with --cluster NAME: number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="override the node type's GPUs per node")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SEC",
                   help="bound the search, counted once the model is traced; the best plan so far is returned, "
                   "marked 'feasible', with the bound of what was not explored")
    p.add_argument("--fix", default=None, metavar="K=V,...",
                   help="pin choices: tp, pp, dp, cp, ep, mb, schedule, v, recompute, zero, sp (e.g. tp=8,pp=4)")
    p.add_argument("--profile", default=None, metavar="CALIBRATION", help="calibration file from `autopar calibrate`")
    add_target_arguments(p, auto=True)
    p.add_argument("--out", type=Path, default=None, help="write the plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan JSON on stdout instead of the summary")
    p.add_argument("--reproducible", action="store_true",
                   help="leave wall-clock phase times out of the plan (equal inputs give byte-identical files)")


def add_target_arguments(p: argparse.ArgumentParser, *, auto: bool) -> None:
    """``--target`` and ``--precision``, shared by plan, estimate and whatif."""
    from costmodel.step_config import PRECISIONS
    from costmodel.targets import TARGET_NAMES

    p.add_argument("--target", default="autopar", metavar="NAME[:OPTION]",
                   help=f"execution target whose kernels, overlaps, memory layout and refusals price the plan: "
                        f"{', '.join(TARGET_NAMES)} (profiles/targets/NAME.toml; options such as megatron:sc21 or "
                        "megatron:cuda-graphs:moe-a2a-overlap apply named sets of its constants, in order; "
                        "default autopar)")
    choices = PRECISIONS + (("auto",) if auto else ())
    p.add_argument("--precision", default="bf16", choices=choices,
                   help="GEMM precision of the linears (default bf16)"
                        + ("; auto: search every precision the target runs on these accelerators" if auto else ""))


class _Progress:
    """Progress on stderr: one line per update, at most a few per second."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.last = 0.0
        self.phase = ""

    def __call__(self, phase: str, done: int, total: int, best_s: float) -> None:
        now = time.perf_counter()
        if done < total and now - self.last < 0.5 and phase == self.phase:
            return
        self.last, self.phase = now, phase
        best = "none fits yet" if not math.isfinite(best_s) else f"best {best_s:.4g} s/step"
        print(f"autopar plan: {phase} {done}/{total} structures, {best}", file=self.stream, flush=True)


def run(args: argparse.Namespace) -> int:
    from costmodel.profiles import resolve_cluster
    from planner.plan import save_plan
    from planner.search.driver import plan_model

    cluster = resolve_cluster(args.cluster, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                              profile_path=args.profile)
    print(f"autopar plan: {args.model} on {cluster.name} ({cluster.num_devices} devices)", file=sys.stderr)
    plan = plan_model(args.model, cluster, global_batch=args.global_batch, seq=args.seq,
                      time_limit_s=args.time_limit, fix=args.fix, progress=_Progress(sys.stderr),
                      record_timings=not args.reproducible, target=args.target, precision=args.precision)
    if args.out is not None:
        save_plan(plan, args.out)
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        print(summary(plan))
        if args.out is not None:
            print(f"wrote {args.out}")
    return 0


def summary(plan) -> str:
    """The human summary: degrees, schedule, step time, tokens/s, MFU, memory, bottleneck, where time goes."""
    d, s, pr, st = plan.degrees, plan.schedule, plan.prediction, plan.solver
    extra = "".join(f" {k}={getattr(d, k)}" for k in ("cp", "ep") if getattr(d, k) > 1)
    sched = s.name + (f" (v={s.virtual_stages})" if s.virtual_stages > 1 else "")
    cuts = [sum(1 for m in stage.modules) for stage in plan.stages]
    knobs = (f"ZeRO-{plan.zero_stage}, recompute={plan.stages[0].recompute}, sequence parallel "
             f"{'on' if plan.sequence_parallel else 'off'}")
    total = sum(pr.breakdown_s.values()) or 1.0
    parts = ", ".join(f"{k} {v:.3g} s ({100 * v / total:.0f}%)" for k, v in
                      sorted(pr.breakdown_s.items(), key=lambda kv: (-kv[1], kv[0])) if v > 0)
    mem = ", ".join(f"{k} {v:.1f}" for k, v in sorted(pr.memory_breakdown_gb.items(), key=lambda kv: -kv[1]) if v > 0)
    phases = ", ".join(f"{k} {v:.2f}" for k, v in st.time_per_phase_s.items())
    lines = [
        f"model       {plan.model.name}: {plan.model.params / 1e9:.2f}B parameters, {plan.model.num_layers} layers, "
        f"seq {plan.model.seq_len}",
        f"cluster     {plan.cluster.name}: {plan.cluster.num_devices} x {plan.cluster.gpu}",
        f"target      {plan.target}, precision {plan.precision}",
        f"degrees     tp={d.tp} pp={d.pp} dp={d.dp}{extra}; {knobs}",
        f"schedule    {sched}, micro-batch {s.microbatch_size} x {s.num_microbatches} per dp rank, "
        f"global batch {plan.global_batch}; modules per stage {'/'.join(map(str, cuts))}",
        f"step time   {pr.step_time_s:.4g} s   tokens/s {pr.tokens_per_s:,.0f}   MFU {100 * pr.mfu:.1f}%   "
        f"model TFLOP/s per GPU {pr.model_tflops_per_gpu:.1f}",
        f"memory      {pr.memory_gb_per_device:.1f} GB per device (max){f' = {mem}' if mem else ''}"
        f"{'' if pr.fits else '  DOES NOT FIT'}",
        f"bottleneck  {pr.bottleneck or 'n/a'}",
        f"time        {parts}",
        f"search      {st.status}, {st.candidates_explored} structures explored, objective {st.objective:.4g} s, "
        f"bound {st.bound:.4g} s, gap {100 * st.gap:.1f}%" + (f"; phases (s): {phases}" if phases else ""),
    ] + ([f"proven      {st.proven}"] if st.proven else [])
    return "\n".join(lines)
