"""What a calibration measures: ``CalibrationPlan`` and its two presets (``quick_plan``, ``full_plan``)."""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.calibration import COLLECTIVE_OPS


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
