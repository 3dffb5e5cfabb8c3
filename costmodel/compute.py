"""Time of one op (or a sum of like ops) on one device: a roofline with op-class and shape efficiency.

``time = max(flops / (peak x compute efficiency), bytes / (memory bandwidth x memory efficiency))``.

Compute efficiency by op class:
- ``matmul``: time ``F / (peak * matmul_max) * (1 + dim_half / d) + matmul_time_half_s`` with ``F = 2 m n k``
  and ``d = min(m, n, k)``: skinny matmuls waste tile rows / columns (a 16-row GEMM cannot fill a 128-wide
  tile), and every kernel pays a fixed launch / tail time, so a matmul as long as that runs at half speed.
  Efficiency = ideal time / that time. With no shape, the large-matmul efficiency ``matmul_max``.
- ``attention`` (fused / flash attention kernels): ``attention`` of peak.
- everything else runs at ``vector_fraction`` of the non-tensor-core fp32 rate and is normally memory-bound.
- ``view`` ops move nothing and cost nothing.

Memory efficiency by op class (fraction of HBM bandwidth a kernel of that class reaches) is a separate
constant per class. A calibration of this accelerator (``calibration.accelerator == device.name``) replaces
the matmul curve with its fitted ``MatmulFit`` and the memory rate with the measured memory-bound rate.

Framework time (``dispatch_time_s``): what a pass pays per layer regardless of FLOPs (Python, autograd,
dispatcher; measured on CPU by ``autopar calibrate``); zero without such a calibration (on GPUs kernels run
asynchronously behind it).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.calibration import Calibration, MatmulFit
from costmodel.errors import ConfigError
from costmodel.hardware import Accelerator

OP_CLASSES: tuple[str, ...] = ("matmul", "attention", "embedding", "norm", "elementwise", "reduction", "view", "other")


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeEfficiency:
    """Default efficiencies (one set for every device and case). Sources:

    - ``matmul_max`` 0.85: cuBLAS large bf16/fp16 GEMMs reach ~250-280 of 312 TFLOP/s on A100 (NVIDIA "Matrix
      Multiplication Background" performance guide; Megatron-LM SC21 reports 52% of peak end to end with
      all overheads, i.e. GEMMs well above that).
    - ``matmul_dim_half`` 128: efficiency halves when the smallest dimension is one 128-wide tile (tile
      quantisation, same guide); a 16-row GEMM is memory-bound anyway.
    - ``matmul_time_half_s`` 4 us: kernel launch + tail effects (~3-5 us per kernel on CUDA).
    - ``attention`` 0.55: FlashAttention-2 (Dao 2023) reaches 50-73% of A100 peak forward, less backward.
    - memory: a streaming kernel reaches ~85-90% of HBM bandwidth (STREAM-like copy on A100 / H100);
      normalisations and reductions ~70% (two passes, reductions across threads), embedding gathers ~50%.
    """

    matmul_max: float = 0.85
    matmul_dim_half: float = 128.0
    matmul_time_half_s: float = 4e-6
    attention: float = 0.55
    vector_fraction: float = 0.5
    mem_matmul: float = 0.85
    mem_attention: float = 0.85
    mem_elementwise: float = 0.85
    mem_norm: float = 0.70
    mem_reduction: float = 0.70
    mem_embedding: float = 0.50
    mem_other: float = 0.70

    def memory(self, op_class: str) -> float:
        return getattr(self, f"mem_{op_class}")


DEFAULT_COMPUTE_EFFICIENCY = ComputeEfficiency()
_LARGE = (8192, 8192, 8192)  # the shape "no shape given" stands for under a calibrated curve


def _fit_for(device: Accelerator, dtype: str, calibration: Calibration | None) -> MatmulFit | None:
    if calibration is None or calibration.accelerator != device.name:
        return None
    return calibration.best_matmul_fit(dtype)


def _mnk(shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(shape) == 3:
        return int(shape[0]), int(shape[1]), int(shape[2])
    if len(shape) == 4:  # (batch, m, n, k): a batched matmul is as efficient as one of (batch*m, n, k)
        return int(shape[0] * shape[1]), int(shape[2]), int(shape[3])
    raise ConfigError(f"matmul shape {shape!r} must be (m, n, k) or (batch, m, n, k)")


def matmul_efficiency(
    m: int,
    n: int,
    k: int,
    device: Accelerator,
    calibration: Calibration | None = None,
    *,
    dtype: str = "bf16",
    efficiency: ComputeEfficiency | None = None,
) -> float:
    """Fraction of ``device``'s dense ``dtype`` peak that an ``(m, k) @ (k, n)`` matmul reaches."""
    if min(m, n, k) < 1:
        raise ConfigError(f"matmul dims m={m}, n={n}, k={k} must all be >= 1")
    peak = device.tflops(dtype)
    fit = _fit_for(device, dtype, calibration)
    if fit is not None:
        return fit.tflops(m, n, k) / peak
    eff = efficiency or DEFAULT_COMPUTE_EFFICIENCY
    d = float(min(m, n, k))
    flops = 2.0 * m * n * k
    ideal_s = flops / (peak * 1e12)
    time_s = ideal_s / eff.matmul_max * (1.0 + eff.matmul_dim_half / d) + eff.matmul_time_half_s
    return ideal_s / time_s


def compute_rate_flops(
    *,
    op_class: str,
    device: Accelerator,
    dtype: str = "bf16",
    shape: tuple[int, ...] | None = None,
    calibration: Calibration | None = None,
    efficiency: ComputeEfficiency | None = None,
) -> float:
    """Achieved FLOP/s of an op of ``op_class`` (and ``shape`` for matmuls)."""
    eff = efficiency or DEFAULT_COMPUTE_EFFICIENCY
    peak = device.tflops(dtype) * 1e12
    if op_class == "matmul":
        m, n, k = _mnk(shape) if shape is not None else _LARGE
        if shape is None and _fit_for(device, dtype, calibration) is None:
            return peak * eff.matmul_max
        return peak * matmul_efficiency(m, n, k, device, calibration, dtype=dtype, efficiency=eff)
    if op_class == "attention":
        fit = _fit_for(device, dtype, calibration)
        if fit is None:
            return peak * eff.attention * device.attention_speedup
        # a calibrated device: attention keeps its default ratio to large matmuls
        return fit.tflops(*_LARGE) * 1e12 * eff.attention / eff.matmul_max
    return device.tflops("fp32") * 1e12 * eff.vector_fraction


def memory_rate_bps(
    *, op_class: str, device: Accelerator, calibration: Calibration | None = None, efficiency: ComputeEfficiency | None = None
) -> float:
    """Achieved bytes/s of memory traffic for an op of ``op_class``."""
    eff = efficiency or DEFAULT_COMPUTE_EFFICIENCY
    if calibration is not None and calibration.accelerator == device.name:
        # the calibration measured a streaming (elementwise) kernel; other classes keep their ratio to it
        return calibration.membound_gbps * 1e9 * eff.memory(op_class) / eff.mem_elementwise
    return device.hbm_gbps * 1e9 * eff.memory(op_class)


def op_time_s(
    *,
    flops: float,
    bytes_moved: float,
    op_class: str,
    device: Accelerator,
    dtype: str = "bf16",
    shape: tuple[int, ...] | None = None,
    calibration: Calibration | None = None,
    efficiency: ComputeEfficiency | None = None,
) -> float:
    """Roofline time of an op: the larger of its compute time and its memory time (see module doc)."""
    if op_class not in OP_CLASSES:
        raise ConfigError(f"unknown op_class {op_class!r}; use one of {', '.join(OP_CLASSES)}")
    if not flops >= 0 or not bytes_moved >= 0:
        raise ConfigError(f"flops={flops!r} and bytes_moved={bytes_moved!r} must be >= 0")
    if op_class == "view" or (flops == 0 and bytes_moved == 0):
        return 0.0
    t_compute = 0.0
    if flops > 0:
        rate = compute_rate_flops(
            op_class=op_class, device=device, dtype=dtype, shape=shape, calibration=calibration, efficiency=efficiency
        )
        t_compute = flops / rate
    t_memory = bytes_moved / memory_rate_bps(
        op_class=op_class, device=device, calibration=calibration, efficiency=efficiency
    )
    return max(t_compute, t_memory)


def dispatch_time_s(
    *, part: str, device: Accelerator, calibration: Calibration | None = None, tensor_parallel: bool = False,
    sequence_parallel: bool = False,
) -> tuple[float, float]:
    """(forward, backward) framework seconds of one micro-batch pass of a decoder ``layer`` or of the ``model``'s
    non-repeating part (embedding, final norm, head, loss), under DTensor ``tensor_parallel`` (and
    ``sequence_parallel``) when measured so: the calibration's ``DispatchFit``, else zero."""
    if part not in ("layer", "model"):
        raise ConfigError(f"dispatch part {part!r}; use 'layer' or 'model'")
    if calibration is None or calibration.accelerator != device.name or calibration.dispatch_fit is None:
        return 0.0, 0.0
    fit = calibration.dispatch_fit
    tp = tensor_parallel and fit.tp_layer_fwd_s + fit.tp_layer_bwd_s > 0
    if tensor_parallel and sequence_parallel and fit.sp_layer_fwd_s + fit.sp_layer_bwd_s > 0:
        return (fit.sp_layer_fwd_s, fit.sp_layer_bwd_s) if part == "layer" else (fit.sp_model_fwd_s, fit.sp_model_bwd_s)
    if part == "layer":
        return (fit.tp_layer_fwd_s, fit.tp_layer_bwd_s) if tp else (fit.layer_fwd_s, fit.layer_bwd_s)
    return (fit.tp_model_fwd_s, fit.tp_model_bwd_s) if tp else (fit.model_fwd_s, fit.model_bwd_s)


def fsdp_unit_time_s(*, device: Accelerator, calibration: Calibration | None = None) -> float:
    """Framework seconds FSDP2 adds per wrapped unit and micro-batch pass (its pre / post forward and backward
    hooks, the copy-in before and copy-out after each all-gather, the reduce-scatter's chunk-cat and the gloo calls
    themselves): the calibration's ``DispatchFit.fsdp_unit_s`` (``runtime.measure.compute._fsdp_fixture``), else
    zero (accelerators: the host runs ahead of the device)."""
    if calibration is None or calibration.accelerator != device.name or calibration.dispatch_fit is None:
        return 0.0
    return calibration.dispatch_fit.fsdp_unit_s


def matmul_time_s(
    m: int,
    n: int,
    k: int,
    *,
    device: Accelerator,
    dtype: str = "bf16",
    dtype_bytes: int = 2,
    calibration: Calibration | None = None,
    efficiency: ComputeEfficiency | None = None,
) -> float:
    """One ``(m, k) @ (k, n)`` matmul: FLOPs ``2 m n k``, bytes ``(m k + k n + m n) * dtype_bytes``."""
    return op_time_s(
        flops=2.0 * m * n * k,
        bytes_moved=float(m * k + k * n + m * n) * dtype_bytes,
        op_class="matmul",
        device=device,
        dtype=dtype,
        shape=(m, n, k),
        calibration=calibration,
        efficiency=efficiency,
    )
