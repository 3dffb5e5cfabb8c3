"""Message-size ramps of bus bandwidth, from published nccl-tests curves (``profiles/comm_curves.toml``).

A curve gives the bus bandwidth ``busbw_i`` at sizes ``S_i`` of one collective on ``n0`` ranks. In the
alpha-beta form ``t = L + f(n) S / (B r(S))`` (``costmodel.comm``) the ramp ``r <= 1`` that reproduces the
curve at its own group is ``r_i = f(n0) S_i / (B (t_i - L0))``, where ``t_i = f(n0) S_i / busbw_i`` is the
measured time, ``B`` the curve's plateau (its largest busbw) and ``L0`` the latency of that group: the
model's own, or the source's floor (its time at the smallest size, when that is at most 64 KiB) where the
floor is higher; the excess is a per-call overhead of how the source launched (one process driving all GPUs,
``-g 8``) that one process per GPU does not pay. The ramp is what the latency term does not explain of the
measured time. It is capped so that time never falls as the size grows, interpolated linearly in log2 size
and held flat beyond the ends. A curve whose points start at large sizes follows its ``shape`` curve's ramp
below its smallest point, scaled to meet it. On a link whose plateau is ``B'`` the ramp is read at
``S B / B'``: the bandwidth-delay product sets where a ramp bends, so a link twice as fast needs twice the
bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from costmodel.hardware import BusCurve

RAMP_FLOOR = 1e-3
"""Smallest ramp kept (a curve whose time sits entirely in the latency term)."""
FLOOR_MAX_BYTES = 65536.0
"""A curve's smallest point measures its launch floor if it is at most this size (latency-bound)."""


@dataclass(frozen=True, slots=True)
class Ramp:
    """Fraction of the plateau bus bandwidth by message size, for a link of plateau ``plateau_gbps``."""

    log2_sizes: tuple[float, ...]
    fractions: tuple[float, ...]
    plateau_gbps: float

    def fraction(self, nbytes: float, plateau_gbps: float) -> float:
        """The ramp at ``nbytes`` on a link whose plateau bus bandwidth is ``plateau_gbps``."""
        if nbytes <= 0:
            return self.fractions[0]
        x = math.log2(nbytes * self.plateau_gbps / plateau_gbps)
        return float(np.interp(x, self.log2_sizes, self.fractions))


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = factor x S / t."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


def source_floor_s(curve: BusCurve) -> float | None:
    """The measured time of the curve's smallest point if it is latency-bound (<= 64 KiB), else None."""
    if curve.sizes_bytes[0] > FLOOR_MAX_BYTES:
        return None
    return bus_factor(curve.op, curve.ranks) * curve.sizes_bytes[0] / (curve.busbw_gbps[0] * 1e9)


def reference_latency_s(curve: BusCurve, model_latency_s: float) -> float:
    """The latency subtracted from the curve's times: the model's, or the source's floor where higher."""
    floor = source_floor_s(curve)
    return model_latency_s if floor is None else max(model_latency_s, floor)


def _own_points(curve: BusCurve, latency_s: float) -> tuple[np.ndarray, np.ndarray]:
    """log2 sizes and ramp fractions that reproduce the curve's own points with latency ``latency_s``."""
    sizes = np.asarray(curve.sizes_bytes, dtype=float)
    busbw = np.asarray(curve.busbw_gbps, dtype=float) * 1e9
    factor = bus_factor(curve.op, curve.ranks)
    measured = factor * sizes / busbw
    plateau = curve.plateau_gbps * 1e9
    bandwidth_s = np.maximum(measured - reference_latency_s(curve, latency_s), 1e-30)
    ramp = np.clip(factor * sizes / (plateau * bandwidth_s), RAMP_FLOOR, 1.0)
    return np.log2(sizes), ramp


def _time_never_falls(log2_sizes: np.ndarray, ramp: np.ndarray) -> np.ndarray:
    """The ramp rising no faster than the size between points, so S / r (the bandwidth time) never falls."""
    out = ramp.copy()
    for i in range(1, len(out)):
        out[i] = min(out[i], out[i - 1] * 2.0 ** (log2_sizes[i] - log2_sizes[i - 1]))
    return out


def build_ramp(curve: BusCurve, latency_s: float, shape: Ramp | None = None) -> Ramp:
    """The ramp of ``curve`` derived with the model latency ``latency_s`` of its own group (or the source's
    floor, see the module doc); below its smallest size it follows ``shape`` (the ramp of ``curve.shape``),
    scaled to meet its first point."""
    x, r = _own_points(curve, latency_s)
    if shape is not None:
        first = shape.fraction(2.0 ** x[0], curve.plateau_gbps)
        scale = r[0] / first if first > 0 else 1.0
        below = [(sx + math.log2(curve.plateau_gbps / shape.plateau_gbps), sr * scale)
                 for sx, sr in zip(shape.log2_sizes, shape.fractions)]
        below = [(bx, br) for bx, br in below if bx < x[0]]
        if below:
            x = np.concatenate([[b[0] for b in below], x])
            r = np.concatenate([[min(1.0, max(RAMP_FLOOR, b[1])) for b in below], r])
    r = _time_never_falls(x, r)
    return Ramp(log2_sizes=tuple(float(v) for v in x), fractions=tuple(float(v) for v in r),
                plateau_gbps=curve.plateau_gbps)
