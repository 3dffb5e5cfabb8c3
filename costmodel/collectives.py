"""The collective operations autopar prices, and the ring algorithm's terms for each (NCCL conventions).

``ring_terms(op, n)`` is ``(latency steps, bandwidth factor)`` of ``t = steps * alpha + factor * S / bw`` on
``n`` ranks, ``S`` the full buffer (nccl-tests' ``PERFORMANCE.md``: bus bandwidth = ``factor * S / t``).
``costmodel.comm`` prices collectives with it; ``costmodel.calibration`` fits measured times to it.
"""

from __future__ import annotations

from costmodel.errors import ConfigError

COLLECTIVE_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")

ROUTING_INDEX_BYTES = 8
"""Bytes of one routing index that expert parallelism exchanges before its dispatch (``runtime.expert_parallel``:
int64 row counts per ep rank and an int64 expert id per row)."""


def ring_terms(op: str, n: int) -> tuple[float, float]:
    """(latency steps, bandwidth factor) of the ring formula for ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(n - 1), (n - 1) / n
    if op == "broadcast":
        return float(n - 1), 1.0
    if op == "send_recv":
        return 1.0, 1.0
    raise ConfigError(f"unknown collective {op!r}; use one of {', '.join(COLLECTIVE_OPS)}")
