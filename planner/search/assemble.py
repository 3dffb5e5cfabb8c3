"""Turn a search result into a ``planner.plan.Plan``: stages with module FQNs and ranks, prediction, stats."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from planner.plan import (
    Alternative,
    ClusterInfo,
    ModelInfo,
    ModuleSharding,
    ParallelDegrees,
    Plan,
    Prediction,
    ScheduleSpec,
    SolverStats,
    StagePlan,
)


def cluster_info(cluster: Any) -> ClusterInfo:
    return ClusterInfo(
        name=cluster.name,
        num_devices=cluster.num_devices,
        nodes=cluster.nodes,
        gpus_per_node=cluster.gpus_per_node,
        gpu="+".join(cluster.gpu_names),
    )


def _intra_op_stats(stats: Mapping[str, Any]) -> dict[str, float]:
    out = {k: float(stats[k]) for k in ("blocks", "distinct_solutions", "max_gap") if k in stats}
    out.update({status: float(n) for status, n in sorted(dict(stats.get("statuses", {})).items())})
    return out


def stage_plans(
    *, workload: Any, cluster: Any, candidate: Any, module_groups: Mapping[str, Sequence[str]] | None = None
) -> tuple[StagePlan, ...]:
    """One StagePlan per chunk: chunk ``c`` runs on pipeline rank ``c % pp``; ranks are row-major over
    (pp, dp, ep, cp, tp) so pipeline rank ``r`` holds the contiguous block ``[r * N/pp, (r + 1) * N/pp)``.
    ``module_groups`` expands group names (``embedding``, ``head``) into the module FQNs they stand for.
    ``gpu`` is the accelerator the step model priced the chunk's rank on (``stage_device``: its node group's,
    the slowest one if the rank's devices straddle groups)."""
    s, est = candidate.structure, candidate.estimate
    per_rank = cluster.num_devices // s.pp
    groups = dict(module_groups or {})
    names = [tuple(groups.get(layer.name, (layer.name,))) for layer in workload.layers]
    times = list(getattr(est, "stage_time_s", ()) or ())
    mems = list(getattr(est, "stage_memory_gb", ()) or ())
    chunk_times = _chunk_times(workload, candidate.stage_layers, times, s.pp)
    devices = tuple(getattr(est, "stage_device", ()) or ())
    out, start = [], 0
    counts = candidate.knobs.recompute_layers
    for c, n in enumerate(candidate.stage_layers):
        r = c % s.pp
        ranks = tuple(range(r * per_rank, (r + 1) * per_rank))
        k = 0 if candidate.knobs.recompute == "none" else _recomputed(workload.layers[start : start + n], counts, c)
        out.append(StagePlan.placed(
            c,
            pp=s.pp,
            world_size=cluster.num_devices,
            modules=tuple(m for group in names[start : start + n] for m in group),
            recompute=candidate.knobs.recompute if k > 0 else "none",  # a chunk that recomputes nothing says so
            recompute_layers=k,
            gpu=devices[r] if len(devices) == s.pp else cluster.group_of_rank(ranks[0]).node.gpu.name,
            predicted_time_s=chunk_times[c],
            predicted_memory_gb=float(mems[r]) if len(mems) == s.pp else float(est.memory_gb_per_device),
        ))
        start += n
    return tuple(out)


def _recomputed(entries: Sequence[Any], counts: Sequence[int] | None, chunk: int) -> int:
    """Recomputed layers of a chunk: the searched count, or all its recomputable entries."""
    return sum(1 for e in entries if e.recomputable) if counts is None else int(counts[chunk])


def _chunk_times(workload: Any, stage_layers: Sequence[int], times: Sequence[float], pp: int) -> list[float]:
    """Per-chunk seconds: the step model's per-chunk times when it gives them; when it gives them per pipeline
    rank (interleaving: several chunks per rank), the rank's time split over its chunks by their FLOPs."""
    n = len(stage_layers)
    if len(times) == n:
        return [float(t) for t in times]
    if len(times) != pp:
        return [0.0] * n
    bounds = [sum(stage_layers[:c]) for c in range(n + 1)]
    work = [sum(l.flops_fwd + l.flops_bwd for l in workload.layers[bounds[c] : bounds[c + 1]]) for c in range(n)]
    rank_work = [sum(work[c] for c in range(r, n, pp)) for r in range(pp)]
    return [float(times[c % pp]) * (work[c] / rank_work[c % pp] if rank_work[c % pp] > 0 else 1.0 / (n // pp))
            for c in range(n)]


def prediction(est: Any) -> Prediction:
    return Prediction(
        step_time_s=float(est.step_time_s),
        tokens_per_s=float(est.tokens_per_s),
        model_tflops_per_gpu=float(est.model_tflops_per_gpu),
        hw_tflops_per_gpu=float(est.hw_tflops_per_gpu),
        mfu=float(est.mfu),
        memory_gb_per_device=float(est.memory_gb_per_device),
        fits=bool(est.fits),
        breakdown_s={str(k): float(v) for k, v in sorted(dict(est.breakdown_s).items())},
        memory_breakdown_gb={str(k): float(v) for k, v in sorted(dict(getattr(est, "memory_breakdown_gb", {})).items())},
        bottleneck=str(getattr(est, "bottleneck", "")),
    )


def build_plan(
    *,
    model_info: ModelInfo,
    workload: Any,
    cluster: Any,
    result: Any,
    global_batch: int,
    shardings: Sequence[ModuleSharding],
    time_per_phase_s: dict[str, float],
    record_timings: bool = True,
    module_groups: Mapping[str, Sequence[str]] | None = None,
    intra_op: Mapping[str, Any] | None = None,
) -> Plan:
    best = result.best
    s = best.structure
    degrees = ParallelDegrees(tp=s.tp, cp=s.cp, pp=s.pp, dp=s.dp, ep=s.ep)
    objective = best.step_time_s
    bound = min(result.bound_s, objective)
    gap = 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)
    stats = SolverStats(
        time_per_phase_s={k: float(v) for k, v in sorted(time_per_phase_s.items())} if record_timings else {},
        status=result.status,
        objective=objective,
        bound=bound,
        gap=gap,
        candidates_explored=int(result.candidates_explored),
        proven=str(getattr(result, "proven", "")),
        intra_op=_intra_op_stats(intra_op or {}),
    )
    alternatives = tuple(
        Alternative(
            summary=c.summary(),
            step_time_s=c.step_time_s,
            memory_gb_per_device=float(c.estimate.memory_gb_per_device),
            fits=c.fits,
        )
        for c in result.alternatives
    )
    return Plan.build(
        model=model_info,
        cluster=cluster_info(cluster),
        degrees=degrees,
        stages=stage_plans(workload=workload, cluster=cluster, candidate=best, module_groups=module_groups),
        shardings=tuple(shardings),
        zero_stage=best.knobs.zero_stage,
        sequence_parallel=best.knobs.sequence_parallel,
        schedule=ScheduleSpec(
            name=s.schedule, microbatch_size=s.microbatch, num_microbatches=s.num_microbatches,
            virtual_stages=s.virtual_stages,
        ),
        prediction=prediction(best.estimate),
        solver=stats,
        alternatives=alternatives,
    )
