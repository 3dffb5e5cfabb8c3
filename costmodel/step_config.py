"""``ParallelConfig`` (one fixed parallel configuration) and its validation against a workload and cluster.

Every check raises ``ConfigError`` naming the numbers and a fix (the nearest valid values).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.errors import ConfigError
from costmodel.pipeline import SCHEDULES, check_schedule
from costmodel.workload import Workload

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepConstants:
    """The step model's own constants (one set for every case; see ``benchmarks/fidelity.py`` for how they
    were set). Memory-bound traffic in bytes per token and hidden (or ffn) element, forward pass, bf16:

    - ``elementwise_replicated_bytes`` 22: two LayerNorms (read + write 4 each), two dropout + residual adds
      (read 2 x 2 + mask, write 2: 7 each): replicated over tp unless sequence parallel.
    - ``elementwise_ffn_bytes`` 4: bias + GeLU over the ``f / tp`` MLP activations (read 2, write 2).
    - ``softmax_bytes`` 9 per attention score (unfused attention): scaled-masked softmax read + write 4,
      dropout read + write 4, mask 1.
    - ``optimizer_bytes_per_param`` 32: Adam reads and writes fp32 master, momentum, variance (24), reads the
      gradient and writes the bf16 weight.
    - ``overlap_slowdown`` 0.5: an overlapped collective still slows the compute it hides behind (NCCL
      kernels take SMs and HBM bandwidth, and prefetching leaves the first and last gathers exposed; the step
      is ``max(comm, compute) + k min(comm, compute)``).
    - ``zero3_flat_nic`` True: ZeRO-3's per-parameter all-gathers / reduce-scatters across nodes run as a flat
      ring at each GPU's own NIC rate (no rail-parallel hierarchy), as DeepSpeed / FSDP issue them.
    - ``zero3_passes_recompute`` False: with full recomputation a layer's recomputed forward runs right before
      its backward, so one parameter all-gather serves both (three passes a micro-batch: gather in forward,
      gather before recompute + backward, reduce-scatter of the gradients).
    - ``zero3_collectives_per_layer`` 1: ZeRO-3 gathers and reduces parameters once per layer per pass, as
      autopar's runtime runs it (FSDP2 ``fully_shard`` on each block), each paying the ring latency
      ``(n - 1) alpha``. DeepSpeed ZeRO-3 fetches module by module (two LayerNorms, QKV, attention projection,
      two MLP linears): 6, what ``benchmarks/fidelity.py`` uses for the SC21 DeepSpeed rows.
    - ``tp_fused_input_projections`` False: the backward all-reduces the input gradient of each
      column-parallel projection separately (q, k, v, and the MLP's up or gate + up: DTensor's
      ``ColwiseParallel`` on separate modules, as autopar's runtime applies it); True: once for attention and
      once for the MLP (Megatron-LM's fused QKV, what ``benchmarks/fidelity.py`` uses).
    """

    elementwise_replicated_bytes: float = 22.0
    elementwise_ffn_bytes: float = 4.0
    softmax_bytes: float = 9.0
    optimizer_bytes_per_param: float = 32.0
    overlap_slowdown: float = 0.5
    zero3_flat_nic: bool = True
    zero3_passes_recompute: bool = False
    zero3_collectives_per_layer: int = 1
    tp_fused_input_projections: bool = False
    sustained_compute: float = 0.85
    last_bucket_bytes: float = 25e6
    """Gradient bucket reduced after the backward ends (PyTorch DDP's default bucket): never overlapped."""


DEFAULT_STEP_CONSTANTS = StepConstants()


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Degrees and knobs of one configuration; ``tp * cp * pp * dp`` = devices, ``ep`` divides ``dp``."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    microbatch: int | None = None
    """Sequences per micro-batch; None: ``estimate_step`` chooses the fastest that fits."""
    global_batch: int
    """Sequences per optimizer step (all data-parallel ranks together)."""
    schedule: str = "1f1b"
    virtual_stages: int | None = 1
    """Model chunks per pipeline rank (interleaved / zero-bubble); None: chosen."""
    recompute: str = "none"
    recompute_layers: tuple[int, ...] | None = None
    """Per pipeline chunk (``pp * virtual_stages`` entries): how many of the chunk's layers (every block but the
    embedding and the head), counted from its first, run with ``recompute``; None: all of them (Megatron-LM's
    ``--recompute-num-layers`` per stage). Ignored when ``recompute`` is ``none``."""
    sequence_parallel: bool = False
    zero_stage: int = 0
    flash_attention: bool = True
    """Fused attention that never materialises the scores (False: Megatron-2021-style unfused softmax)."""
    overlap_grad_reduce: bool = True
    """Data-parallel gradient reduction overlapped with the backward (torch DDP / FSDP); False: after it
    (Megatron-LM 2021 ``local`` DDP)."""

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        if self.microbatch is None:
            raise ConfigError("microbatch is not chosen yet")
        return self.global_batch // (self.dp * self.microbatch)

    def summary(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages != 1 else ""
        extra = "".join(f" {k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) != 1)
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}{extra} mb={self.microbatch} {self.schedule}{v} "
                f"recompute={self.recompute}{' sp' if self.sequence_parallel else ''} zero={self.zero_stage}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(values: list[int], target: int) -> list[int]:
    return sorted(sorted(values, key=lambda v: (abs(v - target), v))[:2])


def _positive(cfg: ParallelConfig) -> None:
    for key in ("tp", "pp", "dp", "cp", "ep", "global_batch"):
        val = getattr(cfg, key)
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ConfigError(f"{key}={val!r} must be a positive integer")
    for key in ("microbatch", "virtual_stages"):
        val = getattr(cfg, key)
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ConfigError(f"{key}={val!r} must be a positive integer or None (chosen)")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"schedule={cfg.schedule!r} is unknown; choose one of {SCHEDULES}")
    if cfg.recompute not in RECOMPUTE:
        raise ConfigError(f"recompute={cfg.recompute!r} is unknown; choose one of {RECOMPUTE}")
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={cfg.zero_stage!r} must be 0, 1, 2 or 3")


def _check_model(cfg: ParallelConfig, w: Workload) -> None:
    if w.heads % cfg.tp:
        raise ConfigError(f"tp={cfg.tp} does not divide heads={w.heads}; choose tp in {_divisors(w.heads)}")
    if w.kv_heads % cfg.tp:
        raise ConfigError(
            f"tp={cfg.tp} does not divide kv_heads={w.kv_heads}; choose tp in {_divisors(w.kv_heads)}"
        )
    if w.seq % cfg.cp:
        raise ConfigError(f"cp={cfg.cp} does not divide seq={w.seq}; choose cp in {_divisors(w.seq)[:12]}")
    if cfg.ep > 1 and not w.experts:
        raise ConfigError(f"ep={cfg.ep} needs a MoE model; {w.name} has no experts: use ep=1")
    if w.experts and w.experts % cfg.ep:
        raise ConfigError(f"ep={cfg.ep} does not divide experts={w.experts}; choose ep in {_divisors(w.experts)}")
    if cfg.dp % cfg.ep:
        raise ConfigError(f"ep={cfg.ep} must divide dp={cfg.dp}; choose ep in {_divisors(cfg.dp)}")
    chunks = cfg.pp * (cfg.virtual_stages or 1)
    if chunks > w.num_layers:
        raise ConfigError(
            f"pp*virtual_stages={chunks} exceeds the {w.num_layers} transformer layers; "
            f"use pp*virtual_stages <= {w.num_layers}"
        )


def _check_batch(cfg: ParallelConfig) -> None:
    if cfg.global_batch % cfg.dp:
        lo = max(cfg.dp, cfg.global_batch - cfg.global_batch % cfg.dp)
        raise ConfigError(
            f"global_batch={cfg.global_batch} is not divisible by dp={cfg.dp}; use global_batch {lo} or "
            f"{lo + cfg.dp}, or dp in {_nearest(_divisors(cfg.global_batch), cfg.dp)}"
        )
    if cfg.microbatch is None:
        return
    per_rank = cfg.global_batch // cfg.dp
    if per_rank % cfg.microbatch:
        raise ConfigError(
            f"global_batch={cfg.global_batch} is not divisible by dp*microbatch={cfg.dp}*{cfg.microbatch}; "
            f"use microbatch in {_nearest(_divisors(per_rank), cfg.microbatch)} "
            f"(divisors of global_batch/dp={per_rank})"
        )


def validate_config(cfg: ParallelConfig, workload: Workload, num_devices: int) -> None:
    """Raise ConfigError for an invalid configuration (see the module docstring)."""
    _positive(cfg)
    _check_model(cfg, workload)
    if cfg.devices != num_devices:
        rest = cfg.tp * cfg.cp * cfg.pp
        fix = f"dp={num_devices // rest}" if num_devices % rest == 0 else f"tp*cp*pp dividing {num_devices}"
        raise ConfigError(
            f"tp*cp*pp*dp = {cfg.tp}*{cfg.cp}*{cfg.pp}*{cfg.dp} = {cfg.devices} != {num_devices} devices; use {fix}"
        )
    _check_batch(cfg)
    if cfg.microbatch is not None and cfg.virtual_stages is not None:
        check_schedule(cfg.schedule, pp=cfg.pp, num_microbatches=cfg.num_microbatches,
                       virtual_stages=cfg.virtual_stages)


def check_stage_layers(stage_layers: tuple[int, ...], workload: Workload, chunks: int) -> None:
    n = len(workload.layers)
    if len(stage_layers) != chunks or sum(stage_layers) != n or min(stage_layers) < 1:
        raise ConfigError(
            f"stage_layers={tuple(stage_layers)} must be {chunks} positive counts (pp*virtual_stages) summing "
            f"to the workload's {n} entries"
        )


def check_recompute_layers(cfg: ParallelConfig, workload: Workload, stage_layers: tuple[int, ...]) -> None:
    """``recompute_layers``: one count per chunk, each between 0 and the chunk's recomputable layers."""
    rl = cfg.recompute_layers
    if rl is None:
        return
    if len(rl) != len(stage_layers):
        raise ConfigError(
            f"recompute_layers={tuple(rl)} has {len(rl)} entries; give one per pipeline chunk "
            f"(pp*virtual_stages={len(stage_layers)})"
        )
    start = 0
    for c, (k, n) in enumerate(zip(rl, stage_layers)):
        have = sum(1 for layer in workload.layers[start:start + n] if layer.recomputable)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= have:
            raise ConfigError(
                f"recompute_layers[{c}]={k!r}: chunk {c} has {have} recomputable layers; use 0..{have}"
            )
        start += n
