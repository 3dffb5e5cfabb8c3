"""Measure this machine for the cost model: matmul rates over shapes, a memory-bound op, and collectives.

The measuring side of ``autopar calibrate``; it produces a ``costmodel.calibration.Calibration`` (fits
included) that ``--cluster local --profile FILE`` (and any cluster of the same accelerator) uses in place of
datasheet numbers.

- Matmuls and the memory-bound op (``out = a + b``) run in this process with ``threads_per_rank`` threads
  (the runtime's ranks run with 1 thread each), best of a few timed blocks.
- Framework (dispatch) time, CPU only: forward and backward of a decoder at negligible FLOPs (``dispatch_model``
  builds it with 1 and 3 layers; the CLI passes a Llama-style decoder at hidden 16 over 8 tokens), best of a few
  timed passes, in this process.
- Collectives run among 2..N spawned processes (``runtime.calibrate_collectives``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import platform
import queue as _queue
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from costmodel.calibration import (
    COLLECTIVE_OPS,
    Calibration,
    CollectivePoint,
    DispatchPoint,
    MatmulPoint,
    MemboundPoint,
    build_calibration,
)
from costmodel.errors import AutoparError, ProfileError

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationPlan:
    """What to measure (``quick_plan`` / ``full_plan`` build the two presets)."""

    matmul_shapes: tuple[tuple[int, int, int], ...]
    dtypes: tuple[str, ...]
    membound_bytes: tuple[int, ...]
    collective_bytes: tuple[int, ...]
    world_sizes: tuple[int, ...]
    ops: tuple[str, ...] = COLLECTIVE_OPS
    min_time_s: float = 0.05
    collective_iters: int = 5
    collective_blocks: int = 3
    threads_per_rank: int = 1


def quick_plan(*, ranks: int, cuda: bool) -> CalibrationPlan:
    """Well under 60 s on a 2-core machine: one world size, few shapes and sizes."""
    squares = ((64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512))
    skinny = ((16, 512, 512), (512, 512, 16), (64, 1024, 512))
    return CalibrationPlan(
        matmul_shapes=squares + skinny + (((2048, 2048, 2048), (8192, 8192, 8192)) if cuda else ()),
        dtypes=("bf16",) if cuda else ("fp32",),
        membound_bytes=tuple(1 << p for p in (20, 23, 25, 27)),
        collective_bytes=tuple(1 << p for p in (10, 14, 18, 21, 23)),
        world_sizes=(ranks,),
        min_time_s=0.03,
        collective_iters=4,
    )


def full_plan(*, ranks: int, cuda: bool) -> CalibrationPlan:
    """Every world size 2..ranks, wider shape and size sweeps, two dtypes."""
    squares = tuple((s, s, s) for s in (64, 128, 256, 512, 1024, 2048))
    skinny = ((16, 1024, 1024), (64, 1024, 1024), (256, 1024, 1024), (1024, 1024, 64), (2048, 512, 2048))
    big = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192)) if cuda else ()
    return CalibrationPlan(
        matmul_shapes=squares + skinny + big,
        dtypes=("bf16", "fp16", "fp32") if cuda else ("fp32", "bf16"),
        membound_bytes=tuple(1 << p for p in range(20, 29 if cuda else 28, 2)),
        collective_bytes=tuple(1 << p for p in range(10, 28 if cuda else 23, 2)),
        world_sizes=tuple(range(2, ranks + 1)),
        min_time_s=0.2,
        collective_iters=5,
    )


# ------------------------------------------------------------------------------------------ device


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _host_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 8.0


def gpu_profile_name(cuda_name: str, memory_gb: float) -> str:
    """The ``profiles/accelerators.toml`` entry for a CUDA device name (``NVIDIA H100 80GB HBM3``)."""
    n = cuda_name.upper()
    table = (
        ("H200", "H200-SXM-141GB"), ("B200", "B200-SXM-180GB"), ("L40S", "L40S"), ("MI300X", "MI300X"),
        ("H100 PCIE", "H100-PCIe-80GB"), ("H100", "H100-SXM5-80GB"),
    )  # fmt: skip
    for key, name in table:
        if key in n:
            return name
    if "A100" in n:
        pcie = "PCIE" in n
        big = memory_gb > 50
        return f"A100-{'PCIe' if pcie else 'SXM4'}-{'80' if big else '40'}GB"
    if "V100" in n:
        return "V100-SXM2-32GB" if memory_gb > 20 else "V100-SXM2-16GB"
    return cuda_name


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceInfo:
    device: str
    """torch device string: ``cpu`` or ``cuda``."""
    device_name: str
    accelerator: str
    memory_gb: float
    backend: str
    max_ranks: int
    cpu_cores: int = 0
    """Cores the ranks share (CPU; 0 on CUDA, where each rank has its own device)."""


def detect_device() -> DeviceInfo:
    """What this process can measure (the one place that looks at the live hardware)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        mem = props.total_memory / 1e9
        return DeviceInfo(
            device="cuda", device_name=props.name, accelerator=gpu_profile_name(props.name, mem), memory_gb=mem,
            backend="nccl", max_ranks=torch.cuda.device_count(),
        )  # fmt: skip
    cores = os.cpu_count() or 1
    return DeviceInfo(
        device="cpu", device_name=f"{cpu_name()} ({cores} cores)", accelerator="cpu-local",
        memory_gb=_host_memory_gb(), backend="gloo", max_ranks=64, cpu_cores=cores,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ timing


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_call(fn: Callable[[], Any], *, device: str, min_time_s: float, blocks: int = 7, barrier: Any = None) -> float:
    """Seconds per call: best of ``blocks`` timed loops, each long enough to reach ``min_time_s / blocks``.

    The best (not the mean) because on a shared machine other processes only ever slow a loop down; many
    short loops catch the moments this process had a core to itself. With a ``barrier`` (``concurrent`` ranks
    measuring together) every block starts when all processes do and runs for the same wall time, and the
    median block counts: each process's rate while all of them compete, with whatever else the machine runs
    at the time (as the median training step ``autopar validate`` compares against)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    if barrier is not None:
        # windows well above the scheduler's time slice (~4 ms), so each process's share averages out
        window, per_call = max(min_time_s / blocks, 3 * once, CONCURRENT_WINDOW_S), []
        for _ in range(blocks):
            barrier.wait()
            t0, calls = time.perf_counter(), 0
            while time.perf_counter() - t0 < window:
                fn()
                calls += 1
            _sync(device)
            per_call.append((time.perf_counter() - t0) / calls)
        return sorted(per_call)[len(per_call) // 2]
    reps = max(1, int(min_time_s / blocks / once))
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


_CPU_SLOW_DTYPE_MAX_FLOPS = 2 * 512**3
"""On CPU, bf16 / fp16 matmuls without native support run ~10x slower than fp32: time only small shapes."""


def _shapes_for(plan: CalibrationPlan, dtype: str, device: str) -> tuple[tuple[int, int, int], ...]:
    if device == "cpu" and dtype != "fp32":
        return tuple(s for s in plan.matmul_shapes if 2 * s[0] * s[1] * s[2] <= _CPU_SLOW_DTYPE_MAX_FLOPS)
    return plan.matmul_shapes


def measure_matmul(plan: CalibrationPlan, *, device: str, progress: Callable[[], None],
                   barrier: Any = None) -> list[MatmulPoint]:
    points = []
    for dtype in plan.dtypes:
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        for m, n, k in _shapes_for(plan, dtype, device):
            a = torch.randn(m, k, device=device).to(_TORCH_DTYPES[dtype])
            b = torch.randn(k, n, device=device).to(_TORCH_DTYPES[dtype])
            out = torch.empty(m, n, device=device, dtype=_TORCH_DTYPES[dtype])
            t = _time_call(lambda: torch.matmul(a, b, out=out), device=device, min_time_s=plan.min_time_s,
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
        t = _time_call(lambda: torch.add(a, b, out=out), device=device, min_time_s=plan.min_time_s, barrier=barrier)
        points.append(MemboundPoint(nbytes=float(numel * 12), time_s=t))
        progress()
    return points


CONCURRENT_WINDOW_S = 0.1
"""Shortest timed window per block when processes measure together."""
DISPATCH_LAYERS = (1, 6)
DISPATCH_BLOCK_S = 0.3
"""Shortest block of the interleaved dispatch timing (several rounds of every variant)."""
DISPATCH_TOKENS = 8


def _time_interleaved(fns: list[Callable[[], Any]], *, min_time_s: float, blocks: int = 7,
                      barrier: Any = None) -> list[float]:
    """Seconds per call of each of ``fns``, called in turn within the same timed blocks (so a difference of two
    of them is not a difference of two moments' load) from the fastest block; with a ``barrier`` the blocks
    start when every process's do and the block of median total time counts (see ``_time_call``)."""
    for fn in fns:
        fn()
    window = max(min_time_s / blocks, CONCURRENT_WINDOW_S if barrier is not None else 0.0)
    per_block: list[list[float]] = []
    for _ in range(blocks):
        if barrier is not None:
            barrier.wait()
        spent, calls = [0.0] * len(fns), 0
        t_end = time.perf_counter() + window
        while calls == 0 or time.perf_counter() < t_end:
            for i, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn()
                spent[i] += time.perf_counter() - t0
            calls += 1
        per_block.append([t / calls for t in spent])
    per_block.sort(key=sum)
    return per_block[len(per_block) // 2] if barrier is not None else per_block[0]


_TP_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_fc")
_TP_ROWWISE = ("o_proj", "out_proj", "down_proj", "fc2")


def _tensor_parallel_fixture(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with DTensor tensor parallelism as the runtime applies it (Megatron: column-wise q / k / v and
    MLP input projections, row-wise output projections, vocabulary-parallel embedding and head) on a 1-rank
    mesh: DTensor's dispatch runs in full, the collectives have no peer (they are priced by the comm fits)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not dist.is_initialized():  # measure_dispatch destroys it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()  # inside a job's ranks (validate): each its own 1-rank tp mesh, made together
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rank", "tp"))["tp"] if world > 1 else (
        init_device_mesh("cpu", (1,)))
    plan: dict[str, Any] = {}
    for name, _ in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in _TP_COLWISE:
            plan[name] = ColwiseParallel()
        elif leaf in _TP_ROWWISE:
            plan[name] = RowwiseParallel()
        elif leaf == "embed_tokens":
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif leaf == "lm_head":
            plan[name] = ColwiseParallel(output_layouts=Replicate())
    return parallelize_module(model, mesh, plan)


def measure_dispatch(
    build: Callable[[int], torch.nn.Module], *, min_time_s: float, progress: Callable[[], None],
    layers: tuple[int, ...] = DISPATCH_LAYERS, barrier: Any = None, tensor_parallel: bool = True,
) -> list[DispatchPoint]:
    """Forward and backward seconds of ``build(n)`` (a causal LM over ``DISPATCH_TOKENS`` tokens, tiny width) for
    each ``n`` in ``layers``, plain and (``tensor_parallel``) with DTensor tensor parallelism: the framework's
    time, not the arithmetic's. All variants run interleaved in the same blocks; backward = (forward +
    backward) - forward."""
    import torch.distributed as dist

    owns_group = tensor_parallel and not dist.is_initialized()
    try:
        return _measure_dispatch(build, min_time_s=min_time_s, progress=progress, layers=layers, barrier=barrier,
                                 tensor_parallel=tensor_parallel)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _measure_dispatch(build: Callable[[int], torch.nn.Module], *, min_time_s: float, progress: Callable[[], None],
                      layers: tuple[int, ...], barrier: Any, tensor_parallel: bool) -> list[DispatchPoint]:
    variants = [(n, tp) for tp in ((False, True) if tensor_parallel else (False,)) for n in layers]
    fns: list[Callable[[], Any]] = []
    for n, tp in variants:
        model = build(n)
        if tp:
            model = _tensor_parallel_fixture(model)
        vocab = build(1).get_input_embeddings().num_embeddings if tp else model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (1, DISPATCH_TOKENS + 1), generator=torch.Generator().manual_seed(0))

        def forward(model=model, ids=ids) -> torch.Tensor:
            out = model(ids[:, :-1])
            logits = out.logits if hasattr(out, "logits") else out
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

        def forward_backward(model=model, forward=forward) -> None:
            model.zero_grad(set_to_none=True)
            forward().backward()

        fns += [forward, forward_backward]
    times = _time_interleaved(fns, min_time_s=max(min_time_s, 7 * DISPATCH_BLOCK_S), barrier=barrier)
    points = []
    for i, (n, tp) in enumerate(variants):
        fwd, both = times[2 * i], times[2 * i + 1]
        points.append(DispatchPoint(layers=n, fwd_s=fwd, bwd_s=max(both - fwd, 1e-9), tensor_parallel=tp))
    progress()
    return points


class DistBarrier:
    """``wait()`` as ``torch.distributed.barrier()``: the compute sweep in step across a job's ranks."""

    def wait(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def abort(self) -> None:
        pass


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


def _compute_worker(rank: int, plan: CalibrationPlan, dispatch_model: Any, barrier: Any, results: Any) -> None:
    """One of ``concurrent`` processes running the compute sweep in step with the others (CPU)."""
    try:
        tick = (lambda: results.put(("tick", None))) if rank == 0 else (lambda: None)
        matmul, membound, dispatch = compute_sweep(plan, dispatch_model=dispatch_model, barrier=barrier,
                                                   progress=tick)
        results.put(("done", (rank, matmul, membound, dispatch)))
    except Exception:  # reported to the parent, which raises it
        barrier.abort()
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


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


def _slowest(per_rank: list[list]) -> list:
    """Per point, the measurement of the slowest process (a synchronous step waits for it)."""
    return [max(points, key=lambda p: p.time_s if hasattr(p, "time_s") else p.fwd_s + p.bwd_s)
            for points in zip(*per_rank)]


@contextlib.contextmanager
def spawned(procs: list, *, threads: int) -> Iterator[None]:
    """Start ``procs`` with ``OMP_NUM_THREADS=threads`` (children inherit it at spawn), restore the variable, and
    join (or terminate) every process on the way out."""
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        for p in procs:
            p.start()
        yield
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def next_message(results: Any, procs: list, *, deadline: float, limit_s: float, what: str) -> tuple[str, Any]:
    """The next ``(kind, payload)`` the workers put on ``results``; AutoparError when the deadline passes, a
    worker dies, or a worker reports an ``error``."""
    while True:
        try:
            kind, payload = results.get(timeout=1.0)
        except _queue.Empty:
            if time.monotonic() > deadline:
                raise AutoparError(f"{what} did not finish within {limit_s:.0f} s") from None
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise AutoparError(f"{what}: a worker process exited with code {dead[0].exitcode}") from None
            continue
        if kind == "error":
            raise AutoparError(f"{what} failed on {payload}")
        return kind, payload


def measure_compute_concurrent(
    plan: CalibrationPlan, *, concurrent: int, dispatch_model: Any, progress: Callable[[], None],
    timeout_s: float = 1800.0,
) -> tuple[list[MatmulPoint], list[MemboundPoint], list[DispatchPoint]]:
    """The CPU compute sweep in ``concurrent`` spawned processes at once (as many as the ranks that will
    train): each rate is one process's while all compete for the cores; per point the slowest process."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results, barrier = ctx.Queue(), ctx.Barrier(concurrent)
    procs = [ctx.Process(target=_compute_worker, args=(r, plan, dispatch_model, barrier, results))
             for r in range(concurrent)]
    done: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    with spawned(procs, threads=plan.threads_per_rank):
        while len(done) < concurrent:
            kind, payload = next_message(results, procs, deadline=deadline, limit_s=timeout_s,
                                         what="concurrent compute calibration")
            if kind == "tick":
                progress()
            else:
                done[payload[0]] = payload[1:]
    runs = [done[r] for r in range(concurrent)]
    return tuple(_slowest([run[i] for run in runs]) for i in range(3))  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------- entry


def _load_average() -> float:
    """1-minute load average (other processes competing for the cores), NaN where unknown."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return float("nan")


def _progress_bar(total: int, enabled: bool) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, disable=not enabled, file=sys.stderr, desc="calibrate", unit="pt", leave=False)
    except ImportError:  # pragma: no cover - tqdm is a dependency of transformers
        return None


def run_calibration(
    *, ranks: int = 2, quick: bool = False, progress: bool = True,
    dispatch_model: Callable[[int], torch.nn.Module] | None = None, concurrent: int | None = None,
) -> Calibration:
    """Measure this machine and return the calibration (fits computed).

    ``dispatch_model(layers)`` builds the decoder whose framework time is measured (CPU only; None: not
    measured, none priced; it must pickle by name when ``concurrent`` > 1). ``concurrent`` (CPU; default
    ``ranks``): processes that run the compute sweep at once, so rates are per rank while that many train."""
    from runtime.calibrate_collectives import measure_collectives  # spawns ranks; imports this module

    if ranks < 2:
        raise ProfileError(f"--ranks {ranks}: collectives need at least 2 ranks")
    info = detect_device()
    cuda = info.device == "cuda"
    world_max = min(ranks, info.max_ranks)
    plan = (quick_plan if quick else full_plan)(ranks=world_max, cuda=cuda)
    if world_max < 2:
        plan = CalibrationPlan(**{**{f: getattr(plan, f) for f in plan.__slots__}, "world_sizes": ()})
        log.warning("only %d %s device(s): collectives not measured", info.max_ranks, info.device)
    n_coll = sum(
        len(plan.collective_bytes) * sum(1 for op in plan.ops if op != "send_recv" or w == 2) for w in plan.world_sizes
    )
    n_matmul = sum(len(_shapes_for(plan, d, info.device)) for d in plan.dtypes)
    dispatch_on = dispatch_model is not None and not cuda
    total = n_matmul + len(plan.membound_bytes) + n_coll + (1 if dispatch_on else 0)
    bar = _progress_bar(total, progress)
    tick = bar.update if bar is not None else (lambda *a: None)
    load_before = _load_average()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(plan.threads_per_rank)
    concurrent = 1 if cuda else max(1, concurrent if concurrent is not None else ranks)
    try:
        if concurrent > 1:
            matmul, membound, dispatch = measure_compute_concurrent(
                plan, concurrent=concurrent, dispatch_model=dispatch_model if dispatch_on else None, progress=tick)
        else:
            matmul = measure_matmul(plan, device=info.device, progress=tick)
            membound = measure_membound(plan, device=info.device, progress=tick)
            dispatch = measure_dispatch(dispatch_model, min_time_s=plan.min_time_s, progress=tick) if dispatch_on else []
        collectives: list[CollectivePoint] = []
        for world in plan.world_sizes:
            collectives += measure_collectives(plan, backend=info.backend, world=world, progress=tick)
    finally:
        torch.set_num_threads(threads_before)
        if bar is not None:
            bar.close()
    return build_calibration(
        device_name=info.device_name,
        accelerator=info.accelerator,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        backend=info.backend,
        memory_gb=info.memory_gb,
        matmul=tuple(matmul),
        membound=tuple(membound),
        collectives=tuple(collectives),
        threads_per_rank=plan.threads_per_rank,
        torch_version=torch.__version__,
        cpu_cores=info.cpu_cores,
        concurrent_ranks=concurrent,
        dispatch=tuple(dispatch),
        notes=f"{'quick' if quick else 'full'} calibration, world sizes {list(plan.world_sizes)}, compute measured "
        f"in {concurrent} process(es) at once; "
        f"load average before / after: {load_before:.1f} / {_load_average():.1f} on {os.cpu_count()} cores",
    )
