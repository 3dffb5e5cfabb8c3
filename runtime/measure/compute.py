"""Compute rates of this machine: matmuls over shapes, a memory-bound op, and the framework's time per decoder
layer (plain and with the runtime's tensor parallelism), alone or in several processes at once.

- Matmuls and the memory-bound op (``out = a + b``) run with ``threads_per_rank`` threads (the runtime's ranks run
  with 1 thread each), best of a few timed blocks; with a barrier (processes measuring together) the median block.
- Framework (dispatch) time, CPU only: forward and backward of a decoder at negligible FLOPs (``build(n)`` with 1
  and 6 layers), plain, with ``runtime.tensor_parallel`` on a 1-rank tp mesh (DTensor's dispatch in full, the
  collectives without a peer: the comm fits price them), the same with sequence parallelism, and with FSDP2 on a 1-rank mesh (``_fsdp_fixture``), all
  variants interleaved in the same blocks.
- ``measure_compute_concurrent``: the sweep in N spawned ranks at once (the rate each of N training ranks gets),
  per point the slowest process; ``compute_sweep`` is one rank's part (also run by ``runtime.measure.validate``).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from costmodel.calibration import Calibration, DispatchPoint, MatmulPoint, MemboundPoint, build_calibration
from costmodel.errors import ConfigError
from runtime.manual_plan import megatron_shardings
from runtime.measure.spawn import run_ranks
from runtime.measure.sweep import CalibrationPlan
from runtime.measure.timing import DistBarrier, time_call, time_interleaved
from runtime.tensor_parallel import shard_modules

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}


_CPU_SLOW_DTYPE_MAX_FLOPS = 2 * 512**3
"""On CPU, bf16 / fp16 matmuls without native support run ~10x slower than fp32: time only small shapes."""


def matmul_shapes(plan: CalibrationPlan, dtype: str, device: str) -> tuple[tuple[int, int, int], ...]:
    if device == "cpu" and dtype != "fp32":
        return tuple(s for s in plan.matmul_shapes if 2 * s[0] * s[1] * s[2] <= _CPU_SLOW_DTYPE_MAX_FLOPS)
    return plan.matmul_shapes


def measure_matmul(plan: CalibrationPlan, *, device: str, progress: Callable[[], None],
                   barrier: Any = None) -> list[MatmulPoint]:
    points = []
    for dtype in plan.dtypes:
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        for m, n, k in matmul_shapes(plan, dtype, device):
            a = torch.randn(m, k, device=device).to(_TORCH_DTYPES[dtype])
            b = torch.randn(k, n, device=device).to(_TORCH_DTYPES[dtype])
            out = torch.empty(m, n, device=device, dtype=_TORCH_DTYPES[dtype])
            t = time_call(lambda: torch.matmul(a, b, out=out), device=device, min_time_s=plan.min_time_s,
                           barrier=barrier)
            points.append(MatmulPoint(m=m, n=n, k=k, dtype=dtype, time_s=t))
            progress()
    return points


def measure_membound(plan: CalibrationPlan, *, device: str, progress: Callable[[], None],
                     barrier: Any = None) -> list[MemboundPoint]:
    points = []
    for nbytes in plan.membound_bytes:
        numel = max(1, nbytes // 12)  # fp32 a + b -> out: read 2, write 1
        a, b = torch.rand(numel, device=device), torch.rand(numel, device=device)
        out = torch.empty_like(a)
        t = time_call(lambda: torch.add(a, b, out=out), device=device, min_time_s=plan.min_time_s, barrier=barrier)
        points.append(MemboundPoint(nbytes=float(numel * 12), time_s=t))
        progress()
    return points


DISPATCH_LAYERS = (1, 6)
DISPATCH_BLOCK_S = 0.3
"""Shortest block of the interleaved dispatch timing (several rounds of every variant)."""
DISPATCH_TOKENS = 8


def _tensor_parallel_fixture(model: torch.nn.Module, *, sequence_parallel: bool = False) -> torch.nn.Module:
    """``model`` with the runtime's tensor parallelism (``runtime.tensor_parallel.shard_modules`` with the Megatron
    styles of ``runtime.manual_plan.megatron_shardings``, logits gathered) on a 1-rank tp mesh; with
    ``sequence_parallel`` the norms ``SequenceParallel`` too. Measured, 4 processes on 2 cores, the validate model
    (llama layers=2, hidden=256, micro-batch 4 x 64): forward + backward 160 ms plain, 235 ms tensor-parallel,
    268 ms with sequence parallelism (load 3-6)."""
    if not dist.is_initialized():  # measure_dispatch destroys it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()  # inside a job's ranks: each its own 1-rank tp mesh, made together
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rank", "tp"))["tp"] if world > 1 else (
        init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    return shard_modules(model, shardings=megatron_shardings(model, sequence_parallel=sequence_parallel), tp_mesh=mesh,
                         sequence_parallel=sequence_parallel, loss_parallel_ok=False)


def _fsdp_fixture(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as ``runtime.data_parallel.apply_data_parallel`` wraps it for ZeRO 1-3 (``fully_shard`` on each
    decoder layer, then on the root; fp32, no mixed-precision policy, as on CPU ranks) on a 1-rank mesh: FSDP2's
    per-unit hooks, copy-in / copy-out and gloo calls, without a peer (the comm fits price the traffic).
    Measured, 4 processes on 2 cores, the validate model (llama layers=2, hidden=256, micro-batch 2 x 64): a
    step's forward + backward 43 ms plain, 61-68 ms with these 3 units, ZeRO-2 and ZeRO-3 alike."""
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():  # measure_dispatch destroys it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()  # inside a job's ranks: each its own 1-rank mesh, made together
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rank", "dp"))["dp"] if world > 1 else (
        init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    for blocks in (m for m in model.modules() if isinstance(m, torch.nn.ModuleList)):
        for block in blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def measure_dispatch(
    build: Callable[[int], torch.nn.Module], *, min_time_s: float, progress: Callable[[], None],
    layers: tuple[int, ...] = DISPATCH_LAYERS, barrier: Any = None, tensor_parallel: bool = True,
) -> list[DispatchPoint]:
    """Forward and backward seconds of ``build(n)`` (a causal LM over ``DISPATCH_TOKENS`` tokens, tiny width) for
    each ``n`` in ``layers``, plain and (``tensor_parallel``) with DTensor tensor parallelism: the framework's
    time, not the arithmetic's. All variants run interleaved in the same blocks; backward = (forward +
    backward) - forward."""
    owns_group = tensor_parallel and not dist.is_initialized()
    try:
        return _measure_dispatch(build, min_time_s=min_time_s, progress=progress, layers=layers, barrier=barrier,
                                 tensor_parallel=tensor_parallel)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _measure_dispatch(build: Callable[[int], torch.nn.Module], *, min_time_s: float, progress: Callable[[], None],
                      layers: tuple[int, ...], barrier: Any, tensor_parallel: bool) -> list[DispatchPoint]:
    kinds = ("plain", "tp", "sp", "fsdp") if tensor_parallel else ("plain",)
    variants = [(n, kind) for kind in kinds for n in layers]
    fns: list[Callable[[], Any]] = []
    for n, kind in variants:
        model = build(n)
        if kind in ("tp", "sp"):
            model = _tensor_parallel_fixture(model, sequence_parallel=kind == "sp")
        elif kind == "fsdp":
            model = _fsdp_fixture(model)
        vocab = build(1).get_input_embeddings().num_embeddings if kind in ("tp", "sp") else (
            model.get_input_embeddings().num_embeddings)
        ids = torch.randint(0, vocab, (1, DISPATCH_TOKENS + 1), generator=torch.Generator().manual_seed(0))

        def forward(model=model, ids=ids) -> torch.Tensor:
            out = model(ids[:, :-1])
            logits = out.logits if hasattr(out, "logits") else out
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

        def forward_backward(model=model, forward=forward) -> None:
            model.zero_grad(set_to_none=True)
            forward().backward()

        fns += [forward, forward_backward]
    times = time_interleaved(fns, min_time_s=max(min_time_s, 7 * DISPATCH_BLOCK_S), barrier=barrier)
    points = []
    for i, (n, kind) in enumerate(variants):
        fwd, both = times[2 * i], times[2 * i + 1]
        points.append(DispatchPoint(layers=n, fwd_s=fwd, bwd_s=max(both - fwd, 1e-9), tensor_parallel=kind in ("tp", "sp"),
                                    sequence_parallel=kind == "sp", fsdp=kind == "fsdp"))
    progress()
    return points


def compute_sweep(plan: CalibrationPlan, *, dispatch_model: Any, barrier: Any,
                  progress: Callable[[], None] = lambda: None) -> tuple[list, list, list]:
    """Matmul, memory-bound and dispatch points of this process, measured in step with the others through
    ``barrier`` (an ``mp.Barrier`` or ``DistBarrier``)."""
    torch.set_num_threads(plan.threads_per_rank)
    matmul = measure_matmul(plan, device="cpu", progress=progress, barrier=barrier)
    membound = measure_membound(plan, device="cpu", progress=progress, barrier=barrier)
    dispatch = []
    if dispatch_model is not None:
        dispatch = measure_dispatch(dispatch_model, min_time_s=plan.min_time_s, progress=progress, barrier=barrier)
    return matmul, membound, dispatch


def with_compute(cal: Calibration, sweeps: list[tuple[list, list, list]], *, note: str = "") -> Calibration:
    """``cal`` with the compute measurements of ``sweeps`` (one ``compute_sweep`` per process, taken together:
    per point the slowest process) in place of its own; collectives kept."""
    matmul, membound, dispatch = (_slowest([sw[i] for sw in sweeps]) for i in range(3))
    return build_calibration(
        device_name=cal.device_name, accelerator=cal.accelerator,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), backend=cal.backend,
        memory_gb=cal.memory_gb, matmul=tuple(matmul), membound=tuple(membound), collectives=cal.collectives,
        threads_per_rank=cal.threads_per_rank, torch_version=torch.__version__, cpu_cores=cal.cpu_cores,
        concurrent_ranks=len(sweeps), dispatch=tuple(dispatch),
        notes=f"compute re-measured in {len(sweeps)} processes at once{note}; collectives of {cal.date}",
    )  # fmt: skip


def pooled_compute(cal: Calibration, runs: list[list[tuple[list, list, list]]]) -> Calibration:
    """``cal`` with the compute of several runs pooled: per run (one plan's ranks, ``with_compute``) each point's
    slowest process, then per point the median over the runs. On a machine whose load swings within seconds a
    15 s sweep after one plan can be 2x off the next one's; the median over every plan's sweep prices all of
    them with the machine as it was during the whole measurement."""
    per_run = [[_slowest([sw[i] for sw in sweeps]) for i in range(3)] for sweeps in runs if sweeps]
    if not per_run:
        raise ConfigError("no compute sweeps to pool: measure with calibrate_after=True")
    pooled = []
    for i in range(3):
        points = []
        for column in zip(*(run[i] for run in per_run)):
            key = (lambda p: p.time_s) if hasattr(column[0], "time_s") else (lambda p: p.fwd_s + p.bwd_s)
            points.append(sorted(column, key=key)[len(column) // 2])
        pooled.append(points)
    matmul, membound, dispatch = pooled
    return build_calibration(
        device_name=cal.device_name, accelerator=cal.accelerator,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), backend=cal.backend,
        memory_gb=cal.memory_gb, matmul=tuple(matmul), membound=tuple(membound), collectives=cal.collectives,
        threads_per_rank=cal.threads_per_rank, torch_version=torch.__version__, cpu_cores=cal.cpu_cores,
        concurrent_ranks=len(runs[0]), dispatch=tuple(dispatch),
        notes=f"compute: per point the median over {len(per_run)} runs' sweeps; collectives of {cal.date}",
    )  # fmt: skip


def _slowest(per_rank: list[list]) -> list:
    """Per point, the measurement of the slowest process (a synchronous step waits for it)."""
    return [max(points, key=lambda p: p.time_s if hasattr(p, "time_s") else p.fwd_s + p.bwd_s)
            for points in zip(*per_rank)]


def _compute_rank(rank: int, world_size: int, plan: CalibrationPlan, dispatch_model: Any, *,
                  progress: Callable[[Any], None]) -> tuple[list, list, list]:
    """One of ``concurrent`` ranks running the compute sweep in step with the others (CPU)."""
    tick = progress if rank == 0 else (lambda: None)
    return compute_sweep(plan, dispatch_model=dispatch_model, barrier=DistBarrier(), progress=tick)


def measure_compute_concurrent(
    plan: CalibrationPlan, *, concurrent: int, dispatch_model: Any, progress: Callable[[], None],
    timeout_s: float = 1800.0,
) -> tuple[list[MatmulPoint], list[MemboundPoint], list[DispatchPoint]]:
    """The CPU compute sweep in ``concurrent`` spawned ranks at once (as many as the ranks that will train): each
    rate is one process's while all compete for the cores; per point the slowest process."""
    runs = run_ranks(_compute_rank, world_size=concurrent, args=(plan, dispatch_model), timeout_s=timeout_s,
                     backend="gloo", threads=plan.threads_per_rank, progress=lambda _: progress(),
                     what="concurrent compute calibration")
    return tuple(_slowest([run[i] for run in runs]) for i in range(3))  # type: ignore[return-value]
