"""Every configuration the runtime executes, priced one by one: the reference the planner search is tested against.

Written from the rules (``docs`` / ``runtime``), not from ``planner.search.space``: tp a power of two within a
node dividing heads and kv heads; cp a power of two (at most 8) with ``2 cp`` dividing the sequence and at least
``min_tokens_per_cp_rank`` tokens per rank, without pp or ep; ep dividing dp and the experts; pp up to the
layers, pipeline ranks inside one node group; dp dividing the global batch; every micro-batch size dividing
``global_batch / dp``; GPipe and 1F1B (``m >= pp``) with one chunk per rank, interleaved 1F1B (``v >= 2``) and
zero-bubble (``v >= 1``, ZeRO-0 only) with ``m % pp == 0`` and ``pp * v`` up to the layers; every recompute
mode (no selective for MoE), ZeRO stage, sequence parallel (tp > 1), every cut of the entries into chunks,
and for a recompute mode every count of recomputed layers per chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from costmodel.errors import ConfigError
from planner.search import space as sp
from planner.search.knobs import make_config


@dataclass(frozen=True, slots=True)
class Best:
    step_time_s: float
    structure: sp.Structure
    knobs: sp.Knobs
    stage_layers: tuple[int, ...]
    evaluations: int


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def structures(workload, cluster, global_batch, *, max_cp=8, min_tokens_per_cp_rank=1024):
    n, layers = cluster.num_devices, workload.num_layers
    gpn = min(g.node.gpus_per_node for g in cluster.groups)
    sizes = [g.node.gpus_per_node * g.count for g in cluster.groups]
    edges = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    for tp, cp, pp in itertools.product(range(1, n + 1), repeat=3):
        if n % (tp * cp * pp) or not _pow2(tp) or tp > gpn or workload.heads % tp or workload.kv_heads % tp:
            continue
        if not _pow2(cp) or cp > max_cp or (cp > 1 and (workload.seq % (2 * cp) or pp > 1
                                                         or workload.seq // cp < min_tokens_per_cp_rank)):
            continue
        if pp > layers or any(e % (n // pp) for e in edges):
            continue
        dp = n // (tp * cp * pp)
        if global_batch % dp:
            continue
        eps = [e for e in range(1, dp + 1) if dp % e == 0 and workload.experts % e == 0] \
            if workload.experts and cp == 1 else [1]
        for ep, mb in itertools.product(eps, range(1, global_batch // dp + 1)):
            if (global_batch // dp) % mb:
                continue
            m = global_batch // dp // mb
            if pp == 1:
                scheds = [("1f1b", 1)]
            else:
                scheds = [("gpipe", 1)] + ([("1f1b", 1)] if m >= pp else [])
                if m % pp == 0:
                    scheds += [("interleaved-1f1b", v) for v in range(2, layers // pp + 1)]
                    scheds += [("zero-bubble", v) for v in range(1, layers // pp + 1)]
            for sched, v in scheds:
                yield sp.Structure(tp=tp, cp=cp, ep=ep, pp=pp, dp=dp, microbatch=mb, schedule=sched,
                                   virtual_stages=v, num_microbatches=m)


def knobs(workload, s):
    modes = ("none", "full") if workload.experts else ("none", "selective", "full")
    zeros = (0,) if s.schedule == "zero-bubble" else (0, 1, 2, 3)
    sps = (False, True) if s.tp > 1 else (False,)
    for r, z, spar in itertools.product(modes, zeros, sps):
        yield sp.Knobs(recompute=r, zero_stage=z, sequence_parallel=spar)


def cuts(workload, chunks):
    n = len(workload.layers)
    for inner in itertools.combinations(range(1, n), chunks - 1):
        yield tuple(b - a for a, b in zip((0, *inner), (*inner, n)))


def counts(workload, stage_layers):
    rec, start = [], 0
    for c in stage_layers:
        rec.append(sum(1 for l in workload.layers[start : start + c] if l.recomputable))
        start += c
    return itertools.product(*(range(k + 1) for k in rec))


def brute_force(workload, cluster, global_batch, estimate, *, config_type=None, **rules) -> Best | None:
    """The fastest fitting configuration of everything above (None: nothing fits)."""
    best, evaluations = None, 0
    for s in structures(workload, cluster, global_batch, **rules):
        for k in knobs(workload, s):
            for cut in cuts(workload, s.pp * s.virtual_stages):
                for rl in (counts(workload, cut) if k.recompute != "none" else [None]):
                    kk = sp.Knobs(recompute=k.recompute, zero_stage=k.zero_stage,
                                  sequence_parallel=k.sequence_parallel, recompute_layers=rl)
                    cfg = make_config(s, kk, global_batch=global_batch, config_type=config_type)
                    evaluations += 1
                    try:
                        est = estimate(workload, cfg, cluster, stage_layers=cut)
                    except ConfigError:
                        continue
                    if est.fits and (best is None or est.step_time_s < best.step_time_s):
                        best = Best(est.step_time_s, s, kk, cut, 0)
    return None if best is None else Best(best.step_time_s, best.structure, best.knobs, best.stage_layers,
                                          evaluations)
