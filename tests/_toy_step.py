"""A small stand-in step model for the planner tests: same call shape as ``costmodel.step.estimate_step``.

Not a cost model anyone should trust: it only has to be a function of the configuration with the properties
the search relies on (a rank's time is the sum of its entries' times; recomputation adds time and saves memory;
the pipeline follows ``costmodel.pipeline``'s closed forms), so that search == brute force can be tested
independently of the real model's numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from costmodel.errors import ConfigError
from costmodel.pipeline import pipeline_time_s
from costmodel.workload import LayerWork, Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class ToyEstimate:
    step_time_s: float
    fits: bool
    memory_gb_per_device: float
    stage_time_s: tuple[float, ...]
    stage_memory_gb: tuple[float, ...]
    tokens_per_s: float = 0.0
    model_tflops_per_gpu: float = 0.0
    hw_tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    breakdown_s: dict = field(default_factory=dict)
    memory_breakdown_gb: dict = field(default_factory=dict)
    bottleneck: str = "compute"
    stage_memory_limit_gb: tuple[float, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class ToyConfig:
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    microbatch: int
    global_batch: int
    schedule: str
    virtual_stages: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    zero_stage: int = 0
    recompute_layers: tuple[int, ...] | None = None


def toy_workload(*, layers=4, hidden=64, heads=4, vocab=1000, seq=128, ffn=None, name="toy") -> Workload:
    """A GPT workload from Megatron SC21's formulas (per sequence): 24 s h^2 + 4 s^2 h forward FLOPs per layer
    with a 4h MLP, backward twice that, 12 h^2 + 13 h parameters; the LM head 2 s h V forward FLOPs."""
    h, s = hidden, seq
    f = ffn or 4 * h
    emb = LayerWork(name="model.embed_tokens", kind="embedding", params=vocab * h + s * h, flops_fwd=0.0,
                    flops_bwd=0.0, bytes_fwd=4.0 * s * h)
    layer_fwd = 8.0 * s * h * h + 4.0 * s * h * f + 4.0 * s * s * h
    tr = [LayerWork(name=f"model.layers.{i}", kind="transformer", params=4 * h * h + 2 * h * f + 9 * h + f,
                    flops_fwd=layer_fwd, flops_bwd=2.0 * layer_fwd, attn_flops_fwd=4.0 * s * s * h,
                    bytes_fwd=2.0 * 34.0 * s * h)
          for i in range(layers)]
    head = LayerWork(name="lm_head", kind="head", params=2 * h, flops_fwd=2.0 * s * h * vocab,
                     flops_bwd=4.0 * s * h * vocab, bytes_fwd=2.0 * s * vocab)
    return Workload(name=name, layers=(emb, *tr, head), hidden=h, heads=heads, kv_heads=heads, ffn_hidden=f,
                    vocab=vocab, seq=s, num_layers=layers, tied_embeddings=True)


def toy_estimate(workload, cfg, cluster, *, stage_layers=None, peak_flops=1e12, mem_gb=None):
    if workload.heads % cfg.tp:
        raise ConfigError(f"tp={cfg.tp} does not divide heads={workload.heads}")
    chunks = cfg.pp * cfg.virtual_stages
    L = len(workload.layers)
    if stage_layers is None or sum(stage_layers) != L or len(stage_layers) != chunks:
        raise ConfigError(f"bad stage_layers {stage_layers}")
    m = cfg.global_batch // (cfg.dp * cfg.microbatch)
    rec = {"none": 1.0, "selective": 1.1, "full": 4.0 / 3.0}[cfg.recompute]
    act_keep = {"none": 1.0, "selective": 0.6, "full": 0.1}[cfg.recompute]
    tp_eff = 1.0 - 0.08 * math.log2(cfg.tp)
    rate = cfg.tp * cfg.cp * peak_flops * tp_eff / cfg.microbatch
    tf, tb, params, acts, start = [], [], [], [], 0
    for c, n in enumerate(stage_layers):
        seg = workload.layers[start : start + n]
        start += n
        left = len(seg) if cfg.recompute_layers is None else cfg.recompute_layers[c]
        on = []
        for l in seg:  # the first ``left`` transformer layers of the chunk recompute
            on.append(l.recomputable and left > 0)
            left -= on[-1]
        tf.append(sum(l.flops_fwd for l in seg) / rate)
        tb.append(sum(l.flops_bwd + l.flops_fwd * ((rec if o else 1.0) - 1.0) for l, o in zip(seg, on)) / rate)
        params.append(sum(l.params for l in seg) / cfg.tp)
        acts.append(sum(34.0 * workload.seq * workload.hidden * (act_keep if o else 1.0)
                        for l, o in zip(seg, on) if l.kind == "transformer")
                    * cfg.microbatch / (cfg.tp if cfg.sequence_parallel else 1) / cfg.cp)
    # the real model's closed forms; zero-bubble splits each backward into halves (input and weight gradients)
    split = 0.5 if cfg.schedule == "zero-bubble" else 0.0
    pipe = pipeline_time_s(cfg.schedule, pp=cfg.pp, num_microbatches=m, virtual_stages=cfg.virtual_stages,
                           t_fwd_s=tf, t_bwd_s=[t * (1 - split) for t in tb], t_wgrad_s=[t * split for t in tb],
                           p2p_s=1e-4)
    times = [sum(tf[c] + tb[c] for c in range(r, chunks, cfg.pp)) for r in range(cfg.pp)]
    bubble = pipe - m * max(times)
    zero_bytes = {0: 16.0, 1: 4.0 + 12.0 / cfg.dp, 2: 2.0 + 14.0 / cfg.dp, 3: 16.0 / cfg.dp}[cfg.zero_stage]
    mems, grads = [], []
    for r in range(cfg.pp):
        p = sum(params[c] for c in range(r, chunks, cfg.pp))
        a = sum(acts[c] for c in range(r, chunks, cfg.pp))
        inflight = m if cfg.schedule == "gpipe" else min(m, cfg.pp - r)
        mems.append((p * zero_bytes + a * inflight) / 1e9)
        grads.append(p * 4.0 * (cfg.dp - 1) / cfg.dp / 50e9 * (1.5 if cfg.zero_stage == 3 else 1.0))
    opt = max(sum(params[c] for c in range(r, chunks, cfg.pp)) for r in range(cfg.pp)) * 1e-11 / (
        cfg.dp if cfg.zero_stage >= 1 else 1)
    step = pipe + max(grads) + opt
    cap = mem_gb if mem_gb is not None else cluster.groups[0].node.gpu.memory_gb
    tokens = cfg.global_batch * workload.seq / step
    return ToyEstimate(step_time_s=step, fits=max(mems) <= cap, memory_gb_per_device=max(mems),
                       stage_time_s=tuple(times), stage_memory_gb=tuple(mems), tokens_per_s=tokens,
                       stage_memory_limit_gb=(cap,) * cfg.pp,
                       breakdown_s={"compute": pipe - bubble, "bubble": bubble, "comm_ib": max(grads), "optimizer": opt})
