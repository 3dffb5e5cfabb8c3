"""Measure a plan on this machine: a few training steps on ``world_size`` local ranks, step time and peak memory.

``measure_plan(plan, model_factory=..., steps=, warmup=)`` spawns ``plan.degrees.world_size`` processes (gloo on
CPU, one process per rank as ``torchrun`` would start them: ``runtime.measure.spawn``), applies the plan with
``runtime.apply_plan``, runs ``warmup + steps`` optimizer steps (fused AdamW, random token batches of
``plan.global_batch`` x ``plan.model.seq_len``) and returns one ``RankMeasurement`` per rank.

What is timed: each step starts after a barrier (so a rank's time includes waiting for the slowest rank, as a
synchronous step does) and ends after ``optimizer.step()``; ``step_time_s`` is the median over the measured steps.
``compute_dtype="bf16"`` (what the planner traces) runs under ``torch.autocast(dtype=bfloat16)`` with fp32
parameters (mixed precision, the memory model's 16 bytes per parameter with Adam); ``"fp32"`` runs without
autocast (``compute_dtype(calibration, "auto")`` picks it on CPUs without native bf16, whose emulated bf16 runs
30-70x slower than fp32; the plans are then priced for fp32 bytes).
``calibrate_after=True``: the ranks then run the quick compute calibration sweep together, so the plan can be
priced with the machine as it was during its steps.

Memory: ``peak_live_bytes`` is the peak of the live tensor bytes PyTorch allocates (``runtime.measure.live_bytes``:
every storage from ``apply_plan`` on, by category), over two steps run before the warm-up (the second has the
optimizer states from the first, as every later step has), with the counter off during the timed steps (its
dispatch hook would slow them); on CUDA also ``torch.cuda.max_memory_allocated`` over all steps.
``peak_rss_bytes`` is the process's peak resident set (``getrusage`` ``ru_maxrss``), ``base_rss_bytes`` the
resident set before the model is built (torch, the interpreter and gloo buffers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from costmodel.calibration import Calibration
from costmodel.errors import ConfigError
from planner.plan import Plan
from runtime.apply import apply_plan
from runtime.measure.compute import compute_sweep
from runtime.measure.spawn import run_ranks
from runtime.measure.sweep import quick_plan
from runtime.measure.timing import DistBarrier
from runtime.mesh import init_distributed

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMeasurement:
    rank: int
    step_times_s: tuple[float, ...]
    """Every measured step (warm-up steps excluded)."""
    step_time_s: float
    """Median of ``step_times_s``."""
    peak_rss_bytes: int
    base_rss_bytes: int
    losses: tuple[float, ...]
    peak_live_bytes: int = 0
    """Peak live tensor bytes of a step (module docstring)."""
    live_bytes: dict = field(default_factory=dict)
    """``peak_live_bytes`` by category (``runtime.measure.live_bytes.CATEGORIES``)."""
    peak_live_where: str = ""
    cuda_max_allocated_bytes: int = 0
    """``torch.cuda.max_memory_allocated`` over the steps (0 on CPU)."""
    compute_sweep: tuple = ()
    """With ``calibrate_after``: this rank's (matmul, memory-bound, dispatch) calibration points, measured right
    after the steps with every rank at once (``runtime.measure.compute.compute_sweep``)."""

    @property
    def model_rss_bytes(self) -> int:
        """Peak resident memory above the process's resident memory before the model was built."""
        return max(self.peak_rss_bytes - self.base_rss_bytes, 0)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (logits (B, T, V))."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _vocab_of(model: nn.Module) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(emb, nn.Embedding):
        raise ConfigError(f"validate needs a model with an input nn.Embedding; {type(model).__name__} has none")
    return emb.num_embeddings


class _Optimizers:
    """Several optimizers stepped as one (fused AdamW needs each call's tensors all plain or all DTensor)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def _optimizer(params: Any) -> _Optimizers:
    """AdamW as the cost model prices it: fused, one pass over each parameter's weight, gradient and two moments
    (``StepConstants.optimizer_bytes_per_param``). The per-tensor loop (``foreach=False``) makes ~10 passes
    and ~10 dispatched ops per parameter: 8.7 ms vs 1.6 ms for 2.1 M parameters on one core here. One
    optimizer per parameter type: a tensor-parallel model mixes DTensor and plain parameters."""
    by_type: dict[type, list] = {}
    for p in params:
        by_type.setdefault(type(p.data), []).append(p)
    return _Optimizers([torch.optim.AdamW(ps, lr=1e-4, fused=True) for ps in by_type.values()])


def compute_dtype(cal: Calibration | None, requested: str) -> str:
    """``requested`` unless ``auto``: bf16 when ``cal`` has a bf16 matmul fit at least as fast as its fp32 one
    (native bf16), else fp32."""
    if requested != "auto":
        return requested
    if cal is None:
        return "fp32"
    bf16, fp32 = cal.matmul_fit("bf16"), cal.matmul_fit("fp32")
    if bf16 is None:
        return "fp32"
    return "bf16" if fp32 is None or bf16.peak_tflops >= fp32.peak_tflops else "fp32"


def step_times_s(got: list[RankMeasurement]) -> list[float]:
    """Per measured step, the slowest rank's time (steps end together: every rank waits for the slowest)."""
    return [max(steps) for steps in zip(*(m.step_times_s for m in got))]


def _rank(rank: int, world: int, plan: Plan, model_factory: Callable[[], nn.Module],
          cfg: dict[str, Any]) -> RankMeasurement:
    """One rank of ``measure_plan``: its process group, the plan applied, the steps timed."""
    init_distributed(backend="gloo")
    try:
        return _measure(rank, plan, model_factory, cfg)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, plan: Plan, model_factory: Callable[[], nn.Module], cfg: dict[str, Any]) -> RankMeasurement:
    from runtime.measure.live_bytes import LiveBytes, fsdp_comm_labels, label_gradients, track_grads

    base = _rss_bytes()
    model = model_factory()
    mt = LiveBytes()
    labels = contextlib.ExitStack()
    labels.enter_context(fsdp_comm_labels(mt))
    with mt, mt.phase("other", "setup"):
        pm = apply_plan(model, plan, loss_fn=lm_loss, seed=0)
    params = list(pm.parameters())
    mt.relabel(params, "parameters")
    hooks = track_grads(mt, params)
    mt.reset_peak()
    vocab = _vocab_of(model)
    opt = _optimizer(params)
    gen = torch.Generator().manual_seed(1234)
    rows, seq = plan.global_batch, max(plan.model.seq_len, 1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg["compute_dtype"] == "bf16")
    cuda = torch.cuda.is_available() and next(iter(params)).is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    modules = pm.pipeline.modules if pm.pipeline is not None else [pm.module]
    times, losses = [], []
    memory_steps = 2
    for i in range(memory_steps + cfg["warmup"] + cfg["steps"]):
        if i == memory_steps:
            for h in hooks:
                h.remove()
            labels.close()
        ids = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
        dist.barrier()
        tracked = mt if i < memory_steps else contextlib.nullcontext()
        t0 = time.perf_counter()
        with tracked:
            with autocast, mt.phase("activations", f"step {i} forward / backward"):
                loss = pm.step(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
            if i < memory_steps:
                label_gradients(mt, params, modules)
            with mt.phase("temporaries", f"step {i} optimizer"):
                opt.step()
            if i < memory_steps:
                for o in opt.optimizers:
                    mt.relabel([v for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
                               "optimizer")
            opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if i >= memory_steps + cfg["warmup"]:
            times.append(dt)
            losses.append(float(loss))
    labels.close()
    cuda_peak = torch.cuda.max_memory_allocated() if cuda else 0
    dist.barrier()
    peak = _peak_rss_bytes()
    sweep: tuple = ()
    if cfg["calibrate_after"]:
        del pm, opt, model
        sweep = compute_sweep(quick_plan(ranks=dist.get_world_size(), cuda=False),
                              dispatch_model=cfg["dispatch_model"], barrier=DistBarrier())
        dist.barrier()
    return RankMeasurement(
        rank=rank, step_times_s=tuple(times), step_time_s=statistics.median(times),
        peak_rss_bytes=peak, base_rss_bytes=base, losses=tuple(losses), compute_sweep=sweep,
        peak_live_bytes=mt.peak, live_bytes=dict(mt.peak_by_category), peak_live_where=mt.peak_where,
        cuda_max_allocated_bytes=cuda_peak,
    )


def _rank_many(rank: int, world: int, plans: list[Plan], factories: list[Callable[[], nn.Module]],
               cfg: dict[str, Any]) -> list[RankMeasurement]:
    """One rank of ``measure_plans``: every plan applied, then their steps in turns, then one compute sweep."""
    init_distributed(backend="gloo")
    try:
        return _measure_many(rank, plans, factories, cfg)
    finally:
        dist.destroy_process_group()


def _measure_many(rank: int, plans: list[Plan], factories: list[Callable[[], nn.Module]],
                  cfg: dict[str, Any]) -> list[RankMeasurement]:
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg["compute_dtype"] == "bf16")
    gen = torch.Generator().manual_seed(1234)
    runs = []
    for plan, factory in zip(plans, factories):
        base = _rss_bytes()
        model = factory()
        pm = apply_plan(model, plan, loss_fn=lm_loss, seed=0)
        opt = _optimizer(pm.parameters())
        vocab, rows, seq = _vocab_of(model), plan.global_batch, max(plan.model.seq_len, 1)

        def one_step(pm=pm, opt=opt, vocab=vocab, rows=rows, seq=seq) -> tuple[float, float]:
            ids = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
            dist.barrier()
            t0 = time.perf_counter()
            with autocast:
                loss = pm.step(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0, float(loss)

        for _ in range(cfg["warmup"]):
            one_step()
        runs.append({"step": one_step, "rss": max(_rss_bytes() - base, 0), "times": [], "losses": []})
    sweep: tuple = ()
    for i in range(cfg["steps"]):  # in turns: a shared machine's load moves every plan alike
        if cfg["calibrate_after"] and i == cfg["steps"] // 2:  # the sweep at the steps' midpoint: a load that
            dist.barrier()  # rises or falls over the run prices the steps as they averaged
            sweep = compute_sweep(quick_plan(ranks=dist.get_world_size(), cuda=False),
                                  dispatch_model=cfg["dispatch_model"], barrier=DistBarrier())
        for run in runs:
            dt, loss = run["step"]()
            run["times"].append(dt)
            run["losses"].append(loss)
    dist.barrier()
    return [RankMeasurement(rank=rank, step_times_s=tuple(r["times"]), step_time_s=statistics.median(r["times"]),
                            peak_rss_bytes=r["rss"], base_rss_bytes=0, losses=tuple(r["losses"]),
                            compute_sweep=sweep) for r in runs]


def measure_plans(
    plans: list[Plan],
    *,
    model_factories: list[Callable[[], nn.Module]],
    steps: int = 3,
    warmup: int = 1,
    threads_per_rank: int = 1,
    compute_dtype: str = "bf16",
    timeout_s: float = 1800.0,
    calibrate_after: bool = False,
    dispatch_model: Callable[[int], nn.Module] | None = None,
) -> list[list[RankMeasurement]]:
    """Several plans of one world size measured in the same ranks, their steps in turns (plan 1's step, plan 2's,
    ..., ``steps`` rounds after ``warmup`` steps each): per plan, one measurement per rank.

    On a machine shared with other jobs the load moves within seconds; measured in turns every plan sees it alike,
    and ``calibrate_after`` takes one compute sweep for all of them halfway through the rounds (after
    ``steps // 2``), so a load that drifts over the run prices the steps at their average (a sweep after the
    steps, with the load falling from 7 to 1, priced every plan 10-33% under). Memory: ``model_rss_bytes`` is
    the resident set the plan's model, optimizer and warm-up step added (``peak_rss_bytes``; ``base_rss_bytes``
    is 0), not a process peak. Arguments as ``measure_plan``'s, one model factory per plan."""
    if not plans or len(plans) != len(model_factories):
        raise ConfigError(f"{len(plans)} plans and {len(model_factories)} model factories: give one factory per plan")
    worlds = sorted({p.degrees.world_size for p in plans})
    if len(worlds) != 1:
        raise ConfigError(f"plans in turns share their ranks: world sizes {worlds} differ; measure them apart")
    if steps < 1 or warmup < 0:
        raise ConfigError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    if compute_dtype not in ("bf16", "fp32"):
        raise ConfigError(f"compute_dtype={compute_dtype!r}; choose bf16 (the planner's) or fp32")
    cfg = {"steps": steps, "warmup": warmup, "compute_dtype": compute_dtype, "calibrate_after": calibrate_after,
           "dispatch_model": dispatch_model}
    per_rank = run_ranks(_rank_many, world_size=worlds[0], args=(list(plans), list(model_factories), cfg),
                         timeout_s=timeout_s, threads=threads_per_rank, what="validate (plans in turns)")
    return [[per_rank[r][i] for r in range(worlds[0])] for i in range(len(plans))]


def measure_plan(
    plan: Plan,
    *,
    model_factory: Callable[[], nn.Module],
    steps: int = 3,
    warmup: int = 1,
    threads_per_rank: int = 1,
    compute_dtype: str = "bf16",
    timeout_s: float = 600.0,
    calibrate_after: bool = False,
    dispatch_model: Callable[[int], nn.Module] | None = None,
) -> list[RankMeasurement]:
    """Run ``plan`` on ``plan.degrees.world_size`` local gloo ranks; one measurement per rank, by rank.

    ``model_factory()`` builds the (meta-device) model in each rank process; it must pickle by name (a module-level
    function or a ``functools.partial`` of one). ``calibrate_after``: the ranks then take the quick compute
    calibration sweep together (``dispatch_model`` builds its decoder; ~15 s), so the machine's state at the
    steps can price them (``runtime.measure.compute.with_compute``). A rank that fails raises
    ``runtime.measure.spawn.RankError`` with its traceback.
    """
    if steps < 1 or warmup < 0:
        raise ConfigError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    if compute_dtype not in ("bf16", "fp32"):
        raise ConfigError(f"compute_dtype={compute_dtype!r}; choose bf16 (the planner's) or fp32")
    cfg = {"steps": steps, "warmup": warmup, "compute_dtype": compute_dtype, "calibrate_after": calibrate_after,
           "dispatch_model": dispatch_model}
    return run_ranks(_rank, world_size=plan.degrees.world_size, args=(plan, model_factory, cfg), timeout_s=timeout_s,
                     threads=threads_per_rank, what="validate")
