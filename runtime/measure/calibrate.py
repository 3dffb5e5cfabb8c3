"""``run_calibration``: measure this machine for the cost model (what ``autopar calibrate`` writes), and where
calibrations are kept.

It produces a ``costmodel.calibration.Calibration`` (fits included) that ``--cluster local --profile FILE`` (and
any cluster of the same accelerator) uses in place of datasheet numbers: compute rates (``runtime.measure.compute``,
in as many processes at once as will train), collectives among 2..N spawned ranks
(``runtime.measure.collectives``), the device from ``runtime.measure.device``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from costmodel.calibration import Calibration, CollectivePoint, build_calibration
from costmodel.errors import ProfileError
from costmodel.profiles import PROFILES_DIR
from runtime.measure.collectives import measure_collectives
from runtime.measure.compute import (
    matmul_shapes,
    measure_compute_concurrent,
    measure_dispatch,
    measure_matmul,
    measure_membound,
)
from runtime.measure.device import detect_device
from runtime.measure.sweep import CalibrationPlan, full_plan, quick_plan
from runtime.measure.timing import load_average

log = logging.getLogger(__name__)

CALIBRATION_DIR = PROFILES_DIR / "calibration"
"""Where the repository keeps calibrations of the machines it was measured on."""


def latest_calibration(directory: Path = CALIBRATION_DIR) -> Path | None:
    """The newest calibration file in ``directory`` (None when there is none)."""
    files = sorted(directory.glob("*.json"), key=lambda f: f.stat().st_mtime)
    return files[-1] if files else None


Progress = Callable[[int, int], None]
"""``progress(done, total)``: called after each measured point."""


def _points(plan: CalibrationPlan, *, device: str, dispatch: bool) -> int:
    """How many points ``run_calibration`` measures (for its progress)."""
    from runtime.measure.collectives import halves_measured

    backend = "gloo" if device == "cpu" else "nccl"
    sizes = [n for w in plan.world_sizes for n in (w, halves_measured(plan, backend=backend, world=w)) if n]
    n_coll = sum(len(plan.collective_bytes) * sum(1 for op in plan.ops if op != "send_recv" or n == 2) for n in sizes)
    n_matmul = sum(len(matmul_shapes(plan, d, device)) for d in plan.dtypes)
    return n_matmul + len(plan.membound_bytes) + n_coll + (1 if dispatch else 0)


def run_calibration(
    *, ranks: int = 2, quick: bool = False, progress: Progress | None = None,
    dispatch_model: Callable[[int], torch.nn.Module] | None = None, concurrent: int | None = None,
) -> Calibration:
    """Measure this machine and return the calibration (fits computed); ``progress(done, total)`` after each point.

    ``dispatch_model(layers)`` builds the decoder whose framework time is measured (CPU only; None: not
    measured, none priced; it must pickle by name when ``concurrent`` > 1). ``concurrent`` (CPU; default
    ``ranks``): processes that run the compute sweep at once, so rates are per rank while that many train."""
    if ranks < 2:
        raise ProfileError(f"--ranks {ranks}: collectives need at least 2 ranks")
    info = detect_device()
    cuda = info.device == "cuda"
    world_max = min(ranks, info.max_ranks)
    plan = (quick_plan if quick else full_plan)(ranks=world_max, cuda=cuda)
    if world_max < 2:
        plan = dataclasses.replace(plan, world_sizes=())
        log.warning("only %d %s device(s): collectives not measured", info.max_ranks, info.device)
    dispatch_on = dispatch_model is not None and not cuda
    total = _points(plan, device=info.device, dispatch=dispatch_on)
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    load_before = load_average()
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
        f"load average before / after: {load_before:.1f} / {load_average():.1f} on {os.cpu_count()} cores",
    )
