"""A plan's configuration priced again: on another cluster (a fresh calibration of this machine) or for the compute
dtype that will run it, with the step model the search uses (``costmodel.step.estimate_step``, even cuts)."""

from __future__ import annotations

import dataclasses

from costmodel.calibration import Calibration
from costmodel.errors import ConfigError
from costmodel.hardware import Cluster
from costmodel.step import ParallelConfig, estimate_step
from planner.plan import Plan
from planner.search.assemble import prediction
from planner.workload import DTYPE_BYTES, workload_for_dtype, workload_from_model



def plan_config(plan: Plan) -> ParallelConfig:
    """The cost model's record of ``plan``'s configuration (the first stage's recompute mode, every stage's
    ``recompute_layers`` unless all are -1)."""
    d, s = plan.degrees, plan.schedule
    stages = sorted(plan.stages, key=lambda st: st.index)
    counts = [st.recompute_layers for st in stages]
    if -1 in counts and any(c != -1 for c in counts):
        raise ConfigError(f"recompute_layers per stage {counts}: give a count for every stage or -1 (all) for all")
    return ParallelConfig(
        tp=d.tp, pp=d.pp, dp=d.dp, cp=d.cp, ep=d.ep, microbatch=s.microbatch_size, global_batch=plan.global_batch,
        schedule=s.name, virtual_stages=s.virtual_stages, recompute=stages[0].recompute if stages else "none",
        recompute_layers=None if not counts or counts[0] == -1 else tuple(counts),
        sequence_parallel=plan.sequence_parallel, zero_stage=plan.zero_stage,
    )


def reprice(plan: Plan, cluster: Cluster, *, dtype: str) -> Plan:
    """``plan`` with the prediction of its configuration on ``cluster`` for ``dtype`` compute (even cuts): the
    planner traces bf16 (activation, gradient and tp / dp message bytes of 2 per element); fp32 runs move 4."""
    workload, _ = workload_from_model(plan.model.name, seq=plan.model.seq_len)
    workload = workload_for_dtype(workload, dtype)
    return dataclasses.replace(plan, prediction=prediction(estimate_step(workload, plan_config(plan), cluster)))


def priced_for_dtype(plan: Plan, cluster: Cluster, *, dtype: str) -> Plan:
    """``plan`` as made, or re-priced when ``dtype`` compute moves other bytes than the traced (bf16) model."""
    workload, _ = workload_from_model(plan.model.name, seq=plan.model.seq_len)
    return plan if workload.dtype_bytes == DTYPE_BYTES[dtype] else reprice(plan, cluster, dtype=dtype)


def calibration_for(cal: Calibration | None, dtype: str) -> Calibration | None:
    """``cal`` as the runs will use it: fp32 compute drops the other dtypes' matmul fits, so the cost model (which
    asks for bf16 and falls back to fp32) prices what runs."""
    if cal is None or dtype != "fp32" or cal.matmul_fit("fp32") is None:
        return cal
    return dataclasses.replace(cal, matmul_fits=(cal.matmul_fit("fp32"),))
