"""Hand-built, consistent ``Plan`` objects for tests of export, diff and plots (no planner run needed)."""

from __future__ import annotations

from costmodel.analytic import closed_form_priced
from planner.plan import (
    ClusterInfo,
    MeshSpec,
    ModelInfo,
    ParallelDegrees,
    Plan,
    Prediction,
    ScheduleSpec,
    StagePlan,
)


def make_plan(
    *,
    tp: int = 2,
    pp: int = 4,
    dp: int = 2,
    cp: int = 1,
    ep: int = 1,
    layers: int = 16,
    virtual_stages: int = 1,
    schedule: str = "1f1b",
    microbatch: int = 1,
    num_microbatches: int = 8,
    zero_stage: int = 1,
    sequence_parallel: bool = True,
    recompute: str = "selective",
    cuts: tuple[int, ...] | None = None,
    gpu: str = "H100-SXM5-80GB",
    step_time_s: float = 2.0,
    memory_gb: float = 50.0,
) -> Plan:
    """A plan of a ``layers``-layer model with embedding on chunk 0 and head on the last chunk."""
    d = ParallelDegrees(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
    chunks = pp * virtual_stages
    cuts = cuts or tuple([layers // chunks] * chunks)
    if sum(cuts) != layers or len(cuts) != chunks:
        raise ValueError(f"cuts {cuts} must be {chunks} numbers summing to {layers}")
    stages, start = [], 0
    ranks_per_stage = tp * cp * dp
    for c, n in enumerate(cuts):
        mods = [f"model.layers.{i}" for i in range(start, start + n)]
        if c == 0:
            mods.insert(0, "model.embed_tokens")
        if c == chunks - 1:
            mods += ["model.norm", "lm_head"]
        r = c % pp
        stages.append(StagePlan(
            index=c, pp_rank=r, modules=tuple(mods),
            ranks=tuple(range(r * ranks_per_stage, (r + 1) * ranks_per_stage)), recompute=recompute, gpu=gpu,
            predicted_time_s=0.01 * n * (4 / 3 if recompute == "full" else 1.0),
            predicted_memory_gb=memory_gb * (1.0 - 0.05 * r),
        ))
        start += n
    world = d.world_size
    gb = microbatch * num_microbatches * dp
    seq = 4096
    return Plan(
        model=ModelInfo(name="llama:test", fingerprint="sha256:00ff", params=8_000_000_000,
                        flops_per_step=6 * 8e9 * gb * seq, num_layers=layers, seq_len=seq),
        cluster=ClusterInfo(name=f"{world // 8 or 1}x8 {gpu}", num_devices=world, nodes=max(1, world // 8),
                            gpus_per_node=min(8, world), gpu=gpu),
        degrees=d,
        mesh=MeshSpec.from_degrees(d),
        stages=tuple(stages),
        zero_stage=zero_stage,
        sequence_parallel=sequence_parallel,
        schedule=ScheduleSpec(name=schedule, microbatch_size=microbatch, num_microbatches=num_microbatches,
                              virtual_stages=virtual_stages),
        global_batch=gb,
        prediction=Prediction(
            step_time_s=step_time_s, tokens_per_s=gb * seq / step_time_s, model_tflops_per_gpu=300.0,
            hw_tflops_per_gpu=380.0, mfu=0.3, memory_gb_per_device=memory_gb, fits=True,
            breakdown_s={"compute": 0.7 * step_time_s, "comm_nvswitch": 0.1 * step_time_s,
                         "bubble": 0.15 * step_time_s, "optimizer": 0.05 * step_time_s},
            bottleneck="nvswitch",
        ),
    )


def standin_plan(model, cluster, *, global_batch: int, seq=None, time_limit_s=None, fix=None) -> Plan:
    """A planner stand-in for testing the what-if machinery: data parallel over nodes, tp inside a node.

    Its step time follows the cluster's GPU peak and NIC rate, so different clusters give different rows;
    clusters of fewer than 8 GPUs are "infeasible" with a memory figure in the planner's message format.
    """
    from costmodel.errors import InfeasiblePlanError

    n = cluster.num_devices
    if n < 8:
        raise InfeasiblePlanError(f"{model} does not fit on {n} devices: the leanest needs at least {640 / n:.1f} GB per device",
                                  memory_gb_needed=640 / n)
    tp = min(8, cluster.gpus_per_node)
    dp = n // tp
    node = cluster.groups[0].node
    step = 1e3 / (node.gpu.tflops("bf16") * n) + 0.5 / node.nic_gbps_per_gpu
    plan = make_plan(tp=tp, pp=1, dp=dp, layers=8, num_microbatches=global_batch // dp, gpu=node.gpu.name,
                     step_time_s=step, memory_gb=640 / n)
    from dataclasses import replace

    from planner.plan import ClusterInfo

    return replace(plan, cluster=ClusterInfo(name=cluster.name, num_devices=n, nodes=cluster.nodes,
                                             gpus_per_node=cluster.gpus_per_node, gpu=node.gpu.name))


def gpt_workload(*, layers: int = 8, hidden: int = 1024, heads: int = 16, vocab: int = 32000, seq: int = 2048):
    """A ``(Workload, ModelInfo)`` pair of a GPT (4h MLP) by the SC21 formulas, without tracing anything."""
    from costmodel.workload import LayerWork, Workload
    from planner.plan import ModelInfo

    h, s = hidden, seq
    attn_core = 4.0 * s * s * h  # QK^T and AV, dense (2 * 2 s^2 h)
    per_layer = LayerWork(name="", kind="transformer", params=12 * h * h + 13 * h, flops_fwd=24.0 * s * h * h + attn_core,
                          flops_bwd=2 * (24.0 * s * h * h + attn_core), attn_flops_fwd=attn_core,
                          bytes_fwd=2.0 * 34 * s * h)
    embed = LayerWork(name="embedding", kind="embedding", params=(vocab + s) * h, flops_fwd=0.0, flops_bwd=0.0,
                      bytes_fwd=2.0 * s * h)
    head = LayerWork(name="head", kind="head", params=0, flops_fwd=2.0 * s * h * vocab, flops_bwd=4.0 * s * h * vocab,
                     bytes_fwd=2.0 * s * vocab)
    from dataclasses import replace

    body = tuple(replace(per_layer, name=f"model.layers.{i}") for i in range(layers))
    w = closed_form_priced(Workload(name=f"gpt-test-{layers}x{hidden}", layers=(embed, *body, head), hidden=h, heads=heads,
                 kv_heads=heads, ffn_hidden=4 * h, vocab=vocab, seq=s, num_layers=layers, tied_embeddings=True,
                 meta={"module_groups": {"embedding": ("model.embed_tokens", "model.embed_positions"),
                                         "head": ("model.final_layer_norm", "lm_head")}}))
    info = ModelInfo(name=w.name, fingerprint="sha256:test", params=w.params,
                     flops_per_step=w.flops_fwd_per_seq + w.flops_bwd_per_seq, num_layers=layers, seq_len=s)
    return w, info
