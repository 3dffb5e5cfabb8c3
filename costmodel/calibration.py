"""Calibration profiles: what ``autopar calibrate`` measured on a machine, and curves fitted to it.

A ``Calibration`` holds raw measurements (matmul times over shapes, a memory-bound op's rate, collective
times over sizes and rank counts) plus fits that the cost model uses in place of datasheet defaults:

- ``MatmulFit`` per dtype: time = ``(F (1 + dim_half/d) + flops_half) / peak``, i.e. achieved TFLOP/s =
  ``peak_tflops * F / (F (1 + dim_half / d) + flops_half)`` with ``d = min(m, n, k)`` and ``F = 2 m n k``
  (the same curve ``costmodel.compute`` uses with default constants).
- ``CollectiveFit`` per op: the alpha-beta ring model ``t = steps(n) * latency_s + factor(n) * S / bus_bw``
  (``costmodel.collectives.ring_terms``) fitted by least squares on relative error over every (ranks, bytes) point.
- Framework dispatch time (CPU calibrations): the forward and backward of a decoder at negligible FLOPs
  (hidden 16, a few tokens) with 1 and more layers, fitted to ``t = model + layers * layer`` per pass: the
  Python / autograd / dispatcher time every op pays regardless of its size. On CPU this is a large part of a
  small model's step (a Llama layer at hidden 256 spends about as long dispatching as multiplying).
- ``cpu_cores``: rates are measured in one process (one thread); ``rank_share(ranks)`` is the share of one
  core each of ``ranks`` busy processes gets (``min(1, cores / ranks)``), which ``costmodel.profiles`` applies
  to a ``local`` node of that many ranks (4 fp32 matmul processes on 2 cores measured 44 of 88 GFLOP/s each).

``calibration_from_dict`` validates (``ProfileError`` naming the key); ``costmodel.profiles.load_calibration``
reads the files (JSON or TOML). The measuring side lives in ``runtime/measure/calibrate.py``; this module is pure.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

import numpy as np

from costmodel.collectives import COLLECTIVE_OPS, ring_terms
from costmodel.errors import ProfileError

SCHEMA_VERSION = 1
BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi", "fake")
CAL_DTYPES: tuple[str, ...] = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True, kw_only=True, slots=True)
class MatmulPoint:
    """One timed ``(m, k) @ (k, n)`` matmul."""

    m: int
    n: int
    k: int
    dtype: str
    time_s: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def tflops(self) -> float:
        return self.flops / self.time_s / 1e12


@dataclass(frozen=True, kw_only=True, slots=True)
class MemboundPoint:
    """One timed memory-bound op (``out = a + b``): bytes read + written and the time."""

    nbytes: float
    time_s: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.time_s / 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectivePoint:
    """One timed collective: ``nbytes`` is the full (gathered / unsharded) buffer, NCCL convention."""

    op: str
    ranks: int
    nbytes: float
    time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchPoint:
    """Forward and backward seconds of a decoder of ``layers`` layers at negligible FLOPs (framework time)."""

    layers: int
    fwd_s: float
    bwd_s: float
    tensor_parallel: bool = False
    """Measured with DTensor tensor parallelism applied (its dispatch, on a 1-rank mesh)."""
    sequence_parallel: bool = False
    """With ``tensor_parallel``: sequence parallelism too (``SequenceParallel`` norms, activations sharded over the
    sequence between the tensor-parallel modules: DTensor's redistributes and its dispatch of the norms)."""
    fsdp: bool = False
    """Measured with FSDP2 ``fully_shard`` on every layer and the root (on a 1-rank mesh): its hooks, copy-in /
    copy-out and gloo calls without a peer."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchFit:
    """Framework seconds per micro-batch pass: ``model_* + layers * layer_*`` (one process, one core)."""

    layer_fwd_s: float
    layer_bwd_s: float
    model_fwd_s: float
    """Embedding, final norm, LM head and loss: the part of a pass that does not repeat per layer."""
    model_bwd_s: float
    tp_layer_fwd_s: float = 0.0
    """The same four under DTensor tensor parallelism (0: not measured; the plain ones are used)."""
    tp_layer_bwd_s: float = 0.0
    tp_model_fwd_s: float = 0.0
    tp_model_bwd_s: float = 0.0
    sp_layer_fwd_s: float = 0.0
    """The four under tensor and sequence parallelism (0: not measured; the tensor-parallel ones are used)."""
    sp_layer_bwd_s: float = 0.0
    sp_model_fwd_s: float = 0.0
    sp_model_bwd_s: float = 0.0
    fsdp_unit_s: float = 0.0
    """Framework seconds FSDP2 adds per wrapped unit (each layer and the root) and micro-batch pass (forward +
    backward): ``fit_dispatch`` over the ``fsdp`` points less the plain ones (0: not measured)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MatmulFit:
    dtype: str
    peak_tflops: float
    dim_half: float
    """Smallest matmul dimension at which efficiency halves (tile quantisation, skinny shapes)."""
    flops_half: float
    """FLOPs' worth of fixed time per call (launch overhead): ``flops_half / peak`` seconds; a matmul of
    ``flops_half`` FLOPs runs at half speed."""

    def tflops(self, m: int, n: int, k: int) -> float:
        d = float(min(m, n, k))
        flops = 2.0 * m * n * k
        return self.peak_tflops * flops / (flops * (1.0 + self.dim_half / d) + self.flops_half)


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveFit:
    op: str
    latency_s: float
    """Alpha: seconds per ring step."""
    bus_gbps: float
    """Bus bandwidth, GB/s (nccl-tests convention: plugs into the ring formula as ``bw``)."""
    max_ranks: int
    """Largest rank count measured (the fit is used for groups up to any size, but say what it saw)."""
    ranks: int = 0
    """0: fitted over every rank count (used for unmeasured group sizes); n: fitted to the n-rank points only
    (captures what the ring model does not, e.g. more processes than cores)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """Measurements of one machine and the fits derived from them."""

    device_name: str
    """What was measured, as the hardware names itself (``AMD EPYC (2 cores)``, ``NVIDIA H200``)."""
    accelerator: str
    """The profile name these numbers calibrate (``cpu-local``, ``H200-SXM-141GB``)."""
    date: str
    """ISO 8601 UTC time of the measurement."""
    backend: str
    """Collective backend measured: ``gloo`` or ``nccl``."""
    memory_gb: float
    matmul: tuple[MatmulPoint, ...]
    membound: tuple[MemboundPoint, ...]
    membound_gbps: float
    """Achieved memory-bound rate (bytes read + written per second / 1e9) at large sizes."""
    collectives: tuple[CollectivePoint, ...]
    matmul_fits: tuple[MatmulFit, ...]
    collective_fits: tuple[CollectiveFit, ...]
    threads_per_rank: int = 1
    torch_version: str = ""
    notes: str = ""
    cpu_cores: int = 0
    """Cores of the machine (CPU calibrations; 0: not recorded, ranks are not assumed to share cores)."""
    concurrent_ranks: int = 1
    """Processes that ran the matmul / memory / dispatch measurements at once; each rate is one process's
    while all of them competed for the ``cpu_cores`` (so it describes ranks of a job of that size)."""
    dispatch: tuple[DispatchPoint, ...] = ()
    dispatch_fits: tuple[DispatchFit, ...] = ()
    """Zero or one fit of ``dispatch`` (empty: no framework time is priced)."""
    schema_version: int = SCHEMA_VERSION

    def rank_share(self, ranks: int) -> float:
        """Rate of each of ``ranks`` busy processes relative to the measured one: ``min(1, cores / (ranks x
        threads))`` over the same for ``concurrent_ranks`` (1 when the cores were not recorded)."""
        if self.cpu_cores <= 0 or ranks <= 0:
            return 1.0
        share = lambda n: min(1.0, self.cpu_cores / (n * self.threads_per_rank))  # noqa: E731
        return share(ranks) / share(max(1, self.concurrent_ranks))

    def overlaps_communication(self, ranks: int) -> bool:
        """Whether collectives can run beside compute: always where the cores were not recorded (accelerators);
        on a CPU only when the ``ranks`` busy ranks leave a core idle for gloo's communication threads."""
        return self.cpu_cores <= 0 or ranks * self.threads_per_rank < self.cpu_cores

    @property
    def dispatch_fit(self) -> DispatchFit | None:
        return self.dispatch_fits[0] if self.dispatch_fits else None

    def matmul_fit(self, dtype: str) -> MatmulFit | None:
        for fit in self.matmul_fits:
            if fit.dtype == dtype:
                return fit
        return None

    def best_matmul_fit(self, dtype: str) -> MatmulFit | None:
        """The fit for ``dtype``, else for fp32 (what CPUs run), else any."""
        return self.matmul_fit(dtype) or self.matmul_fit("fp32") or (self.matmul_fits[0] if self.matmul_fits else None)

    def collective_fit(self, op: str, ranks: int | None = None) -> CollectiveFit | None:
        """The fit for ``op`` on ``ranks`` ranks if that size was measured, else the all-sizes fit."""
        overall = None
        for fit in self.collective_fits:
            if fit.op != op:
                continue
            if ranks is not None and fit.ranks == ranks:
                return fit
            if fit.ranks == 0:
                overall = fit
        return overall

    @property
    def max_ranks(self) -> int:
        return max((p.ranks for p in self.collectives), default=1)


# ----------------------------------------------------------------------------------------------- fitting


def fit_matmul(points: tuple[MatmulPoint, ...] | list[MatmulPoint], dtype: str) -> MatmulFit:
    """Fit ``MatmulFit`` to the points of one dtype: grid over the two half-points, closed-form peak.

    Minimises the squared log-error of predicted vs measured time, so small and large shapes weigh alike.
    """
    pts = [p for p in points if p.dtype == dtype]
    if not pts:
        raise ProfileError(f"no matmul measurements for dtype {dtype!r} to fit")
    d = np.array([min(p.m, p.n, p.k) for p in pts], dtype=float)
    flops = np.array([p.flops for p in pts])
    t = np.array([p.time_s for p in pts])
    best: tuple[float, float, float, float] | None = None
    for dim_half in (0.0, *np.geomspace(1.0, 4096.0, 25)):
        for flops_half in (0.0, *np.geomspace(1e3, 1e13, 41)):
            shape_eff = flops / (flops * (1.0 + dim_half / d) + flops_half)
            log_peak = np.mean(np.log(flops / (shape_eff * t)))  # t = F / (peak * eff)
            err = np.log(flops / (np.exp(log_peak) * shape_eff)) - np.log(t)
            score = float(np.sum(err * err))
            if best is None or score < best[0] - 1e-12:
                best = (score, float(np.exp(log_peak)) / 1e12, float(dim_half), float(flops_half))
    assert best is not None
    return MatmulFit(dtype=dtype, peak_tflops=best[1], dim_half=best[2], flops_half=best[3])


def fit_collective(
    points: tuple[CollectivePoint, ...] | list[CollectivePoint], op: str, *, ranks: int = 0
) -> CollectiveFit:
    """Least-squares alpha (latency) and bus bandwidth for ``op`` over the measured (ranks, bytes) points:
    all of them (``ranks=0``) or those of one rank count."""
    pts = [p for p in points if p.op == op and (ranks == 0 or p.ranks == ranks)]
    if not pts:
        raise ProfileError(f"no {op} measurements{f' on {ranks} ranks' if ranks else ''} to fit")
    rows, rhs = [], []
    for p in pts:
        steps, factor = ring_terms(op, p.ranks)
        # relative error: divide each equation t = steps*alpha + factor*S*beta by t
        rows.append([steps / p.time_s, factor * p.nbytes / p.time_s])
        rhs.append(1.0)
    a, b = np.array(rows), np.array(rhs)
    alpha, beta = (float(x) for x in np.linalg.lstsq(a, b, rcond=None)[0])
    if beta <= 0:  # latency-dominated data: bandwidth from the largest message as if it were all transfer
        big = max(pts, key=lambda p: p.nbytes)
        beta = big.time_s / (ring_terms(op, big.ranks)[1] * big.nbytes)
        alpha = 0.0
    elif alpha < 0:  # bandwidth-dominated data: refit bandwidth with zero latency
        alpha, beta = 0.0, float(np.linalg.lstsq(a[:, 1:2], b, rcond=None)[0][0])
    return CollectiveFit(
        op=op, latency_s=float(alpha), bus_gbps=float(1.0 / beta / 1e9), max_ranks=max(p.ranks for p in pts), ranks=ranks
    )


def _fit_pass(points: list[DispatchPoint]) -> tuple[float, float, float, float]:
    """(layer_fwd, layer_bwd, model_fwd, model_bwd) by least squares ``t = model + layers * layer``."""
    x = np.array([[1.0, float(p.layers)] for p in points])
    out: dict[str, tuple[float, float]] = {}
    for attr in ("fwd_s", "bwd_s"):
        y = np.array([getattr(p, attr) for p in points])
        model, layer = (float(v) for v in np.linalg.lstsq(x, y, rcond=None)[0])
        if model < 0:  # noise: all of it per layer
            model, layer = 0.0, float(np.sum(x[:, 1] * y) / np.sum(x[:, 1] ** 2))
        if layer < 0:  # noise: all of it fixed
            model, layer = float(np.mean(y)), 0.0
        out[attr] = (layer, model)
    return out["fwd_s"][0], out["bwd_s"][0], out["fwd_s"][1], out["bwd_s"][1]


def fit_dispatch(points: tuple[DispatchPoint, ...] | list[DispatchPoint]) -> DispatchFit:
    """Per pass ``t = model + layers * layer`` over points of >= 2 distinct layer counts, plain and (when
    measured) under tensor parallelism; negative parts (noise) clip to 0."""
    plain = [p for p in points if not p.tensor_parallel and not p.fsdp]
    tp = [p for p in points if p.tensor_parallel and not p.sequence_parallel and not p.fsdp]
    sp = [p for p in points if p.tensor_parallel and p.sequence_parallel and not p.fsdp]
    for group, what in ((plain, "plain"), (tp, "tensor-parallel"), (sp, "sequence-parallel")):
        counts = sorted({p.layers for p in group})
        if group and len(counts) < 2:
            raise ProfileError(f"dispatch ({what}) needs points at >= 2 layer counts to separate per-layer time, "
                               f"got {counts}; re-run `autopar calibrate`")
    if not plain:
        raise ProfileError("dispatch has no plain (not tensor-parallel) points; re-run `autopar calibrate`")
    lf, lb, mf, mb = _fit_pass(plain)
    tlf, tlb, tmf, tmb = _fit_pass(tp) if tp else (0.0, 0.0, 0.0, 0.0)
    slf, slb, smf, smb = _fit_pass(sp) if sp else (0.0, 0.0, 0.0, 0.0)
    return DispatchFit(layer_fwd_s=lf, layer_bwd_s=lb, model_fwd_s=mf, model_bwd_s=mb,
                       tp_layer_fwd_s=tlf, tp_layer_bwd_s=tlb, tp_model_fwd_s=tmf, tp_model_bwd_s=tmb,
                       sp_layer_fwd_s=slf, sp_layer_bwd_s=slb, sp_model_fwd_s=smf, sp_model_bwd_s=smb,
                       fsdp_unit_s=fit_fsdp_unit(plain, [p for p in points if p.fsdp]))


def fit_fsdp_unit(plain: list[DispatchPoint], fsdp: list[DispatchPoint]) -> float:
    """Seconds per FSDP2 unit and micro-batch pass: least squares of ``(fsdp - plain)`` forward + backward at
    each layer count ``n`` against its ``n + 1`` units (every layer and the root), through the origin; 0 without
    ``fsdp`` points, clipped at 0 (noise)."""
    base = {p.layers: p.fwd_s + p.bwd_s for p in plain}
    pairs = [(p.layers + 1.0, p.fwd_s + p.bwd_s - base[p.layers]) for p in fsdp if p.layers in base]
    if not pairs:
        return 0.0
    return max(0.0, sum(u * d for u, d in pairs) / sum(u * u for u, _ in pairs))


def shared_by(cal: Calibration, ranks: int) -> Calibration:
    """``cal`` as each of ``ranks`` busy local ranks sees it: matmul and memory rates times
    ``cal.rank_share(ranks)``, framework time divided by it (``cal`` itself when the cores suffice).

    Collective fits are kept: they were measured with that many ranks running. Processor sharing: ranks that
    wait (pipeline bubbles, collectives) leave their core to the others, which this uniform share ignores."""
    share = cal.rank_share(ranks)
    if share == 1.0:
        return cal
    fits = tuple(MatmulFit(dtype=f.dtype, peak_tflops=f.peak_tflops * share, dim_half=f.dim_half,
                           flops_half=f.flops_half) for f in cal.matmul_fits)
    dispatch = tuple(DispatchFit(**{g.name: getattr(f, g.name) / share for g in fields(DispatchFit)})
                     for f in cal.dispatch_fits)
    note = (f"rates x {share:.3g}: {ranks} ranks x {cal.threads_per_rank} thread(s) on {cal.cpu_cores} cores, "
            f"measured with {cal.concurrent_ranks}")
    return replace(cal, matmul_fits=fits, membound_gbps=cal.membound_gbps * share, dispatch_fits=dispatch,
                   notes=f"{cal.notes}; {note}" if cal.notes else note)


LARGE_MEMBOUND_BYTES = 32e6
"""Sizes from here on stream from DRAM / HBM rather than from caches (training activations are larger)."""


def membound_rate_gbps(points: tuple[MemboundPoint, ...] | list[MemboundPoint]) -> float:
    """Achieved rate at large sizes: the median over points of >= 32 MB (else the largest point)."""
    if not points:
        raise ProfileError("no memory-bound measurements")
    large = [p.gbps for p in points if p.nbytes >= LARGE_MEMBOUND_BYTES]
    if not large:
        large = [max(points, key=lambda p: p.nbytes).gbps]
    return float(np.median(large))


def build_calibration(
    *,
    device_name: str,
    accelerator: str,
    date: str,
    backend: str,
    memory_gb: float,
    matmul: tuple[MatmulPoint, ...],
    membound: tuple[MemboundPoint, ...],
    collectives: tuple[CollectivePoint, ...],
    threads_per_rank: int = 1,
    torch_version: str = "",
    notes: str = "",
    cpu_cores: int = 0,
    concurrent_ranks: int = 1,
    dispatch: tuple[DispatchPoint, ...] = (),
) -> Calibration:
    """A ``Calibration`` from raw measurements, with every fit computed."""
    dtypes = sorted({p.dtype for p in matmul})
    ops = [op for op in COLLECTIVE_OPS if any(p.op == op for p in collectives)]
    fits = []
    for op in ops:
        fits.append(fit_collective(collectives, op))
        sizes = sorted({p.ranks for p in collectives if p.op == op})
        if len(sizes) > 1:
            fits += [fit_collective(collectives, op, ranks=n) for n in sizes]
    cal = Calibration(
        device_name=device_name,
        accelerator=accelerator,
        date=date,
        backend=backend,
        memory_gb=float(memory_gb),
        matmul=tuple(matmul),
        membound=tuple(membound),
        membound_gbps=membound_rate_gbps(membound),
        collectives=tuple(collectives),
        matmul_fits=tuple(fit_matmul(matmul, d) for d in dtypes),
        collective_fits=tuple(fits),
        threads_per_rank=threads_per_rank,
        torch_version=torch_version,
        notes=notes,
        cpu_cores=cpu_cores,
        concurrent_ranks=concurrent_ranks,
        dispatch=tuple(dispatch),
        dispatch_fits=(fit_dispatch(dispatch),) if dispatch else (),
    )
    validate_calibration(cal, where="<measurements>")
    return cal


# ------------------------------------------------------------------------------------- (de)serialisation

_POINT_TYPES = {
    "matmul": MatmulPoint,
    "membound": MemboundPoint,
    "collectives": CollectivePoint,
    "matmul_fits": MatmulFit,
    "collective_fits": CollectiveFit,
    "dispatch": DispatchPoint,
    "dispatch_fits": DispatchFit,
}


def calibration_to_dict(cal: Calibration) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(Calibration):
        value = getattr(cal, f.name)
        if f.name in _POINT_TYPES:
            value = [{g.name: getattr(item, g.name) for g in fields(type(item))} for item in value]
        out[f.name] = value
    return out


def _num(value: Any, *, where: str, key: str, integer: bool = False, positive: bool = True) -> float:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or (isinstance(value, float) and not math.isfinite(value)):
        kind = "an integer" if integer else "a finite number"
        raise ProfileError(f"{where}: key {key!r} = {value!r} must be {kind}")
    if positive and value <= 0:
        raise ProfileError(f"{where}: key {key!r} = {value!r} must be > 0")
    if not positive and value < 0:
        raise ProfileError(f"{where}: key {key!r} = {value!r} must be >= 0")
    return value


def _items(data: dict, key: str, cls: type, *, where: str) -> tuple:
    raw = data.get(key, [])
    if not isinstance(raw, list):
        raise ProfileError(f"{where}: key {key!r} must be a list of tables, got {type(raw).__name__}")
    names = [f.name for f in fields(cls)]
    required = [f.name for f in fields(cls) if f.default is MISSING]
    out = []
    for i, item in enumerate(raw):
        here = f"{where}: {key}[{i}]"
        if not isinstance(item, dict):
            raise ProfileError(f"{here} must be a table with keys {names}")
        missing = [n for n in required if n not in item]
        if missing:
            raise ProfileError(f"{here}: missing key {missing[0]!r}; required keys: {', '.join(required)}")
        out.append(cls(**{n: item[n] for n in names if n in item}))
    return tuple(out)


def calibration_from_dict(data: dict[str, Any], *, where: str = "<calibration>") -> Calibration:
    """Parse and validate; ``where`` (usually the file path) prefixes every error."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: a calibration must be a table / object")
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ProfileError(f"{where}: schema_version {version!r} is not supported (this autopar reads {SCHEMA_VERSION}); re-run `autopar calibrate`")
    required = ("device_name", "accelerator", "date", "backend", "memory_gb", "membound_gbps")
    for key in required:
        if key not in data:
            raise ProfileError(f"{where}: missing key {key!r}; required keys: {', '.join(required)}")
    kwargs = {f.name: data[f.name] for f in fields(Calibration) if f.name in data and f.name not in _POINT_TYPES}
    for key, cls in _POINT_TYPES.items():
        kwargs[key] = _items(data, key, cls, where=where)
    try:
        cal = Calibration(**kwargs)
    except TypeError as e:  # pragma: no cover - all keys are filtered above
        raise ProfileError(f"{where}: {e}") from None
    if (not cal.matmul_fits and cal.matmul) or (cal.dispatch and not cal.dispatch_fits):
        cal = _replace_fits(cal)
    validate_calibration(cal, where=where)
    return cal


def _replace_fits(cal: Calibration) -> Calibration:
    return build_calibration(
        device_name=cal.device_name, accelerator=cal.accelerator, date=cal.date, backend=cal.backend,
        memory_gb=cal.memory_gb, matmul=cal.matmul, membound=cal.membound, collectives=cal.collectives,
        threads_per_rank=cal.threads_per_rank, torch_version=cal.torch_version, notes=cal.notes,
        cpu_cores=cal.cpu_cores, concurrent_ranks=cal.concurrent_ranks, dispatch=cal.dispatch,
    )  # fmt: skip


def validate_calibration(cal: Calibration, *, where: str) -> None:
    for key in ("device_name", "accelerator", "date", "backend"):
        if not isinstance(getattr(cal, key), str) or not getattr(cal, key):
            raise ProfileError(f"{where}: key {key!r} must be a non-empty string")
    if cal.backend not in BACKENDS:
        raise ProfileError(f"{where}: key 'backend' = {cal.backend!r}; allowed: {', '.join(BACKENDS)}")
    _num(cal.memory_gb, where=where, key="memory_gb")
    _num(cal.membound_gbps, where=where, key="membound_gbps")
    _num(cal.threads_per_rank, where=where, key="threads_per_rank", integer=True)
    _num(cal.cpu_cores, where=where, key="cpu_cores", integer=True, positive=False)
    _num(cal.concurrent_ranks, where=where, key="concurrent_ranks", integer=True)
    for i, p in enumerate(cal.dispatch):
        here = f"{where}: dispatch[{i}]"
        _num(p.layers, where=here, key="layers", integer=True, positive=False)
        _num(p.fwd_s, where=here, key="fwd_s")
        _num(p.bwd_s, where=here, key="bwd_s")
    for i, f in enumerate(cal.dispatch_fits):
        for g in fields(DispatchFit):
            _num(getattr(f, g.name), where=f"{where}: dispatch_fits[{i}]", key=g.name, positive=False)
    for i, p in enumerate(cal.matmul):
        here = f"{where}: matmul[{i}]"
        for key in ("m", "n", "k"):
            _num(getattr(p, key), where=here, key=key, integer=True)
        _num(p.time_s, where=here, key="time_s")
        if p.dtype not in CAL_DTYPES:
            raise ProfileError(f"{here}: key 'dtype' = {p.dtype!r}; allowed: {', '.join(CAL_DTYPES)}")
    for i, p in enumerate(cal.membound):
        _num(p.nbytes, where=f"{where}: membound[{i}]", key="nbytes")
        _num(p.time_s, where=f"{where}: membound[{i}]", key="time_s")
    for i, p in enumerate(cal.collectives):
        here = f"{where}: collectives[{i}]"
        if p.op not in COLLECTIVE_OPS:
            raise ProfileError(f"{here}: key 'op' = {p.op!r}; allowed: {', '.join(COLLECTIVE_OPS)}")
        _num(p.ranks, where=here, key="ranks", integer=True)
        if p.ranks < 2:
            raise ProfileError(f"{here}: key 'ranks' = {p.ranks} must be >= 2")
        _num(p.nbytes, where=here, key="nbytes")
        _num(p.time_s, where=here, key="time_s")
    for i, f in enumerate(cal.matmul_fits):
        here = f"{where}: matmul_fits[{i}]"
        _num(f.peak_tflops, where=here, key="peak_tflops")
        _num(f.dim_half, where=here, key="dim_half", positive=False)
        _num(f.flops_half, where=here, key="flops_half", positive=False)
    for i, f in enumerate(cal.collective_fits):
        here = f"{where}: collective_fits[{i}]"
        _num(f.latency_s, where=here, key="latency_s", positive=False)
        _num(f.bus_gbps, where=here, key="bus_gbps")
