"""Which node groups of a (heterogeneous) cluster each pipeline rank runs on.

Ranks are numbered node by node in group order (``costmodel.hardware``) and the mesh puts pp outermost, so
pipeline rank ``r`` of ``pp`` holds the contiguous ranks ``[r N/pp, (r+1) N/pp)``: its tp / cp / ep / dp
groups all lie in the node groups those ranks span. The planner keeps each rank inside one group
(``planner.search.space.enumerate_structures``); a rank that straddles groups runs at the pace of the
slowest of them, within the least memory.
"""

from __future__ import annotations

import functools

from costmodel.hardware import Accelerator, Cluster
from costmodel.memo import ByIdentity

__all__ = ["rank_clusters", "slowest_device"]


def slowest_device(cluster: Cluster) -> Accelerator:
    """The slowest accelerator of a (part of a) cluster paces what runs on all its devices (memoized, the
    cluster by identity: the step model asks per pipeline rank of every estimate)."""
    return _slowest_cached(ByIdentity(cluster))


@functools.lru_cache(maxsize=256)
def _slowest_cached(cluster: ByIdentity) -> Accelerator:
    return min((g.node.gpu for g in cluster.obj.groups), key=lambda a: a.tflops("bf16"))


def rank_clusters(cluster: Cluster, pp: int) -> tuple[tuple[Cluster, ...], tuple[int, ...]]:
    """The node groups each pipeline rank runs on: distinct sub-clusters and, per rank, its index into them.

    A sub-cluster holds the groups a rank's devices span (the calibration kept): it prices the rank's
    compute (its slowest accelerator), its collectives and its memory. When every rank runs on the same
    groups: ``((cluster,), ())`` for one group, ``(part,), ()`` otherwise, ``()`` meaning "every rank in part
    0". Memoized: the sub-clusters keep their identity, which the step model's memos key on."""
    return _rank_clusters_cached(ByIdentity(cluster), int(pp))


@functools.lru_cache(maxsize=256)
def _rank_clusters_cached(cluster: ByIdentity, pp: int) -> tuple[tuple[Cluster, ...], tuple[int, ...]]:
    whole: Cluster = cluster.obj
    if len(whole.groups) == 1:
        return (whole,), ()
    per_rank = whole.num_devices // pp
    parts: list[Cluster] = []
    index: dict[tuple[int, int], int] = {}
    classes = []
    for r in range(pp):
        span = (whole.group_index_of_rank(r * per_rank), whole.group_index_of_rank((r + 1) * per_rank - 1))
        if span not in index:
            index[span] = len(parts)
            parts.append(_part(whole, *span))
        classes.append(index[span])
    if len(parts) == 1:
        return (parts[0],), ()
    return tuple(parts), tuple(classes)


def _part(whole: Cluster, lo: int, hi: int) -> Cluster:
    if lo == 0 and hi == len(whole.groups) - 1:
        return whole
    name = f"{whole.name}[{lo}]" if lo == hi else f"{whole.name}[{lo}-{hi}]"
    return Cluster(name=name, groups=whole.groups[lo : hi + 1], calibration=whole.calibration)
