"""One spawned gloo run per world size for all runtime test files (process start is the expensive part).

``spawned_results(world_size)`` runs every part registered for that size in ``PARTS`` (``"module:function"``,
each ``function(rank, world_size, tmp_dir) -> dict``) in one ``run_distributed`` call and caches the result for
the pytest session; a test reads its part with ``part(world_size, name, rank)``, which raises with the rank's
traceback if that part failed there. A part that fails leaves the others' results intact (unless it desynchronises
the ranks, which then shows as a timeout).
"""

from __future__ import annotations

import functools
import importlib
import tempfile
import time
import traceback
from typing import Any

from dist_utils import run_distributed

PARTS: dict[int, tuple[str, ...]] = {
    2: ("test_runtime_tp:_tp2_body", "test_runtime_dp:_dp2_body", "test_runtime_wrap:_wrap_body",
        "test_runtime_anymodel:_mlp_pp2_body"),
    4: ("test_runtime_tp:_tp2_dp2_body", "test_runtime_anymodel:_handwritten_body"),
}


def _run_parts(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in PARTS[world_size]:
        mod, _, fn = spec.partition(":")
        t0 = time.perf_counter()
        try:
            out[spec] = {"result": getattr(importlib.import_module(mod), fn)(rank, world_size, tmp)}
        except Exception:  # noqa: BLE001 - reported to the test that owns the part
            out[spec] = {"error": traceback.format_exc()}
        out[spec]["time_s"] = time.perf_counter() - t0
    return out


@functools.lru_cache(maxsize=None)
def spawned_results(world_size: int) -> tuple[dict[str, Any], ...]:
    with tempfile.TemporaryDirectory() as tmp:
        return tuple(run_distributed(_run_parts, world_size=world_size, args=(tmp,), timeout_s=420))


def part(world_size: int, spec: str, rank: int) -> Any:
    got = spawned_results(world_size)[rank][spec]
    if "error" in got:
        raise AssertionError(f"{spec} failed on rank {rank} of {world_size}:\n{got['error']}")
    return got["result"]


def parts_all_ranks(world_size: int, spec: str) -> list[Any]:
    return [part(world_size, spec, r) for r in range(world_size)]
