"""The collectives the step model prices (``costmodel.step.priced_collectives``) against what the runtime issues:
count and bytes per ``(axis, op)``, equal where they are deterministic.

On 2 gloo ranks: each plan kind is planned on the fly for 2 local ranks (fp32, as ``autopar validate`` runs on this
CPU: ``plan_model(compute_dtype="fp32")``), run for one warm-up and one recorded step plus the optimizer step under
``runtime.measure.comm_trace.CollectiveRecorder``: DDP, ZeRO-2 / 3, tp, tp + sequence parallel, pp, cp (its K / V
gathered once and kept, the gradient all-reduced: gloo's reduce-scatter is the slower) and ep (token all-to-alls
and the two routing all-to-alls per MoE layer; ZeRO-0 averaged by hand in DDP's buckets). The ep all-to-alls'
bytes are compared summed over the ranks (a rank's combine sends what routing gave it).

At the plan's world size in one process: plans for 8 and 64 GPUs (tp2 x dp4 ZeRO-3, tp2 + sequence parallel x
dp4 ZeRO-2, cp2 x dp4, ep2 in dp8, tp8 x dp8), rank 0 built and stepped as ``autopar check`` does
(``runtime.measure.memcheck.check_rank``: the ``fake`` process group, fake tensors, balanced expert routing), with
the recorder as its ``step_mode``; and tp2 x dp4 ZeRO-0 (FSDP2 replicate under the bf16 / fp32 mixed precision
of ZeRO 1-3, so the tp collectives move the bf16 the trace prices). Kept as it is: ZeRO-0 by hand (ep, pipeline:
no wrapper) on GPUs moves fp32 over tp and ep (fp32 parameters under bf16 autocast) where the bf16 trace is priced.

Beyond what is priced, a step may only issue the loss report (one 4-byte all-reduce per step over the batch ranks,
``ParallelModel.step``) and DDP's buffer broadcast (the rotary ``inv_freq`` buffer, bytes only: latency the
calibration does not separate).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

LLAMA = "llama:layers=2,hidden=64,ffn=128,heads=4,kv_heads=2,vocab=128,seq=16"
MIXTRAL = "mixtral:layers=2,hidden=64,ffn=128,heads=4,kv_heads=2,vocab=128,seq=16,experts=4,topk=2"
SEQ, BATCH = 16, 8

PLANS = {  # kind -> (model spec, --fix)
    "ddp": (LLAMA, "dp=2,zero=0,mb=2"),
    "zero2": (LLAMA, "dp=2,zero=2,mb=2"),
    "zero3": (LLAMA, "dp=2,zero=3,mb=2"),
    "tp2": (LLAMA, "tp=2,zero=0"),
    "tp2_sp": (LLAMA, "tp=2,sp=1,zero=0"),
    "pp2_1f1b": (LLAMA, "pp=2,schedule=1f1b,mb=2,zero=0"),
    "cp2": (LLAMA, "cp=2,zero=0"),
    "ep2": (MIXTRAL, "dp=2,ep=2,zero=0,mb=2"),
}
GROUPS = {"dense": ("ddp", "zero2", "zero3", "tp2", "tp2_sp"), "other": ("pp2_1f1b", "cp2", "ep2")}


def _record(rank: int, world: int, plans: list) -> list:
    """Each plan: applied, one warm-up step, one recorded step (with the optimizer); this rank's summary."""
    from planner.models import build_model
    from runtime.apply import apply_plan
    from runtime.measure.comm_trace import record_step
    from runtime.measure.validate import _optimizer, lm_loss

    out = []
    for spec, plan in plans:
        model = build_model(spec, batch=plan.global_batch, seq=SEQ, device="meta").model
        pm = apply_plan(model, plan, loss_fn=lm_loss, seed=0)
        opt = _optimizer(pm.parameters())
        ids = torch.randint(0, 100, (plan.global_batch, SEQ + 1), generator=torch.Generator().manual_seed(0))
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        pm.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(record_step(pm, x, y, opt))
    return out


def _plan(kind: str):
    from costmodel.profiles import make_cluster
    from planner.search.driver import plan_model

    spec, fix = PLANS[kind]
    return plan_model(spec, make_cluster("local", 1, gpus_per_node=2), global_batch=BATCH, seq=SEQ, fix=fix,
                      compute_dtype="fp32")


@functools.lru_cache(maxsize=None)
def _issued(group: str) -> dict[str, list]:
    from dist_utils import run_distributed

    kinds = GROUPS[group]
    plans = [(PLANS[k][0], _plan(k)) for k in kinds]
    per_rank = run_distributed(_record, world_size=2, args=(plans,), timeout_s=240)
    return {k: [per_rank[r][i] for r in range(2)] for i, k in enumerate(kinds)}


def issued(kind: str) -> list[dict]:
    """Per rank, ``{(axis, op): [count, bytes]}`` of one step of ``kind``'s plan."""
    return _issued(next(g for g, kinds in GROUPS.items() if kind in kinds))[kind]


def priced(kind: str) -> list[dict]:
    """Per rank, what the step model prices for the same plan (the pipeline rank's entry)."""
    from costmodel.profiles import make_cluster
    from costmodel.step import priced_collectives
    from planner.reprice import plan_config
    from planner.workload import workload_for_dtype, workload_from_model

    plan = _plan(kind)
    cfg = plan_config(plan)
    w = workload_for_dtype(workload_from_model(PLANS[kind][0], seq=SEQ)[0], "fp32")
    per_pp = priced_collectives(w, cfg, make_cluster("local", 1, gpus_per_node=2))
    per_stage = 2 // cfg.pp
    return [{k: list(v) for k, v in per_pp[r // per_stage].items()} for r in range(2)]


def _extras(got: dict, want: dict) -> dict:
    return {k: v for k, v in got.items() if k not in want}


def _assert_equal(got: dict, want: dict, keys=None) -> None:
    for key in keys or want:
        g, w = got.get(key, [0, 0]), want.get(key, [0, 0])
        assert g[0] == round(w[0]) and g[1] == pytest.approx(w[1], rel=1e-9), \
            f"{key}: issued {g[0]} x / {g[1]} B, priced {w[0]} x / {w[1]:.0f} B"


def _assert_only_reporting(extras: dict) -> None:
    """Unpriced traffic: the loss report, DDP's buffer broadcast; nothing else."""
    assert extras.pop(("loss", "all_reduce"), [1, 4]) == [1, 4]
    extras.pop(("other", "broadcast"), None)
    assert not extras, f"issued but not priced: {extras}"


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["ddp", "zero2", "zero3", "tp2", "tp2_sp", "pp2_1f1b", "cp2"])
def test_priced_equals_issued(kind):
    for r, (got, want) in enumerate(zip(issued(kind), priced(kind))):
        assert want, f"{kind}: nothing priced on rank {r}"
        _assert_equal(got, want)
        _assert_only_reporting(_extras(got, want))


@pytest.mark.distributed
def test_zero_stages_issue_what_fsdp2_issues():
    """FSDP2 units (2 blocks + root) x 2 micro-batches: ZeRO-3 gathers each unit in forward and again in
    backward every micro-batch; ZeRO-2 once a step (it reshards after the step's last backward only); both
    reduce-scatter each unit every micro-batch; DDP all-reduces once per step."""
    assert issued("zero3")[0][("dp", "all_gather")][0] == 3 * 2 * 2
    assert issued("zero2")[0][("dp", "all_gather")][0] == 3
    assert issued("zero2")[0][("dp", "reduce_scatter")][0] == issued("zero3")[0][("dp", "reduce_scatter")][0] == 6
    assert issued("ddp")[0][("dp", "all_reduce")][0] == 1


@pytest.mark.distributed
def test_context_parallel_kv_traffic():
    """Per layer and micro-batch one all-gather of K and V over the whole sequence (kept for the backward) and one
    reduction of their gradient: on these CPU ranks' gloo an all-reduce, priced as one (and issued: above)."""
    plan = _plan("cp2")
    layers, m, mb = 2, plan.schedule.num_microbatches, plan.schedule.microbatch_size
    kv = 2 * mb * SEQ * (64 * 2 // 4) * 4  # K and V: (mb, seq, hidden x kv_heads / heads), fp32
    want = priced("cp2")[0]
    assert want[("cp", "all_gather")] == [layers * m, pytest.approx(layers * m * kv)]
    assert want[("cp", "all_reduce")] == [layers * m, pytest.approx(layers * m * kv)]
    assert ("cp", "reduce_scatter") not in want


@pytest.mark.distributed
def test_expert_parallel_traffic():
    """Every (axis, op) as priced in number on each rank, and in bytes on each rank but for the ep all-to-alls,
    whose bytes over the ranks are the priced (a rank's combine and the backward of its dispatch send what it
    received: routing decides). Per MoE layer and micro-batch the priced all-to-alls are the two token dispatches
    and combines (forward, backward) and the routing: the row counts (ep int64) and the expert id of each row sent
    (int64). ZeRO-0 with ep averages by hand in DDP's buckets."""
    got, want = issued("ep2"), priced("ep2")
    layers, micro, ep, topk = 2, 2, 2, 2
    rows = BATCH // 2 // micro * SEQ * topk  # rows one rank sends per layer and micro-batch
    routing = want[0][("ep", "all_to_all")][1] - 4 * layers * micro * rows * 64 * 4  # hidden 64, fp32
    assert want[0][("ep", "all_to_all")][0] == 6 * layers * micro
    assert routing == pytest.approx(layers * micro * (ep * 8 + rows * 8))
    for g, w in zip(got, want):
        assert g[("ep", "all_to_all")][0] == w[("ep", "all_to_all")][0]
        _assert_equal(g, w, keys=[k for k in w if k != ("ep", "all_to_all")])
        _assert_only_reporting(_extras(g, w))
    assert sum(g[("ep", "all_to_all")][1] for g in got) == pytest.approx(sum(w[("ep", "all_to_all")][1] for w in want))


def test_dp_collectives_follow_the_target():
    """autopar (DDP, FSDP2): ZeRO-0 in DDP's buckets (1 MiB first, then 25 MB), ZeRO-2 per unit (reduced every
    micro-batch, gathered once); Megatron's distributed optimizer: one all-reduce, one reduce-scatter + one
    gather per step."""
    from costmodel.step import dp_collectives
    from costmodel.targets import load_target

    ours, megatron = load_target("autopar").constants, load_target("megatron").constants
    args = dict(params=1.8e6, expert_params=0.0, bytes_per_param=4.0, m=3, recompute="none", layers=2)
    (z0,) = dp_collectives(k=ours, zero_stage=0, **args)
    assert z0[1:] == ("all_reduce", pytest.approx(7.2e6 / 2), 2)  # 1 MiB + the rest under 25 MB
    assert dp_collectives(k=ours, zero_stage=0, **{**args, "params": 2e5})[0][3] == 1
    assert dp_collectives(k=megatron, zero_stage=0, **args)[0][3] == 1
    (rep,) = dp_collectives(k=ours, zero_stage=0, tensor_parallel=True, **args)  # FSDP2 replicate: per unit
    assert rep[1:] == ("all_reduce", pytest.approx(7.2e6 / 3), 3)
    assert dp_collectives(k=megatron, zero_stage=0, tensor_parallel=True, **args)[0][3] == 1
    z2 = {op: (nbytes, count) for _, op, nbytes, count in dp_collectives(k=ours, zero_stage=2, **args)}
    assert z2 == {"reduce_scatter": (pytest.approx(7.2e6 / 3), 3 * 3), "all_gather": (pytest.approx(7.2e6 / 3), 3)}
    z2m = {op: (nbytes, count) for _, op, nbytes, count in dp_collectives(k=megatron, zero_stage=2, **args)}
    assert z2m == {"reduce_scatter": (pytest.approx(7.2e6), 1), "all_gather": (pytest.approx(7.2e6), 1)}


# --- at the plan's world size, in one process: the fake process group ---------------------------------------------

FAKE_LLAMA = "llama:layers=2,hidden=1024,ffn=4096,heads=16,kv_heads=8,vocab=8192,seq=512"
FAKE_MIXTRAL = "mixtral:layers=2,hidden=512,ffn=2048,heads=8,kv_heads=8,vocab=8192,seq=512,experts=8,topk=2"
AT_SCALE = {  # kind -> (model spec, --fix, dgx-a100-80gb nodes); global batch 16, sequence 512
    "tp2_dp4_zero3": (FAKE_LLAMA, "tp=2,sp=0,dp=4,zero=3,mb=1", 1),
    "tp2_sp_dp4_zero2": (FAKE_LLAMA, "tp=2,sp=1,dp=4,zero=2,mb=1", 1),
    "cp2_dp4_zero3": (FAKE_LLAMA, "cp=2,dp=4,zero=3,mb=1", 1),
    "ep2_dp8_zero3": (FAKE_MIXTRAL, "ep=2,dp=8,zero=3,mb=1", 1),
    "tp2_dp4_zero0": (FAKE_LLAMA, "tp=2,sp=0,dp=4,zero=0,mb=1", 1),
    "tp2_ep2_dp4_zero0": (FAKE_MIXTRAL, "tp=2,ep=2,dp=4,zero=0,mb=1", 1),
    "tp8_dp8_zero3": (FAKE_LLAMA, "tp=8,dp=8,zero=3,mb=1", 8),
}
SCALE_GROUPS = {"world8": ("tp2_dp4_zero3", "tp2_sp_dp4_zero2", "cp2_dp4_zero3", "ep2_dp8_zero3", "tp2_dp4_zero0"),
                # its own process: after another kind, its loss-parallel all-reduce names a destroyed group
                "world8_by_hand": ("tp2_ep2_dp4_zero0",),
                "world64": ("tp8_dp8_zero3",)}


class _Counted:
    """``check_rank``'s ``step_mode``: the collectives of the step and the optimizer step, by (axis, op)."""

    def __init__(self) -> None:
        self.summary: dict = {}

    @contextlib.contextmanager
    def __call__(self, pm):
        from runtime.measure.comm_trace import CollectiveRecorder, axis_of_groups, summarize

        rec, groups = CollectiveRecorder(), axis_of_groups(pm.mesh)
        with rec:
            yield
        self.summary = summarize(rec.events, groups)


def _count_at_scale(kinds: tuple[str, ...]) -> dict[str, tuple[dict, dict]]:
    """Each plan made for its cluster and rank 0 built and stepped as ``autopar check`` does (the fake process group
    at the plan's world size, fake tensors: ``runtime.measure.memcheck.check_rank``); per kind, what rank 0 issued
    and what the step model priced for pipeline rank 0."""
    from cli.commands.validate import build_model_for
    from costmodel.profiles import make_cluster
    from costmodel.step import priced_collectives
    from planner.reprice import plan_config
    from planner.search.driver import plan_model
    from planner.workload import workload_from_model
    from runtime.measure.memcheck import check_rank

    out = {}
    for kind in kinds:
        spec, fix, nodes = AT_SCALE[kind]
        cluster = make_cluster("dgx-a100-80gb", nodes)
        plan = plan_model(spec, cluster, global_batch=16, seq=512, fix=fix)
        counted = _Counted()
        check_rank(plan, 0, model_factory=functools.partial(build_model_for, spec, plan.global_batch, 512),
                   step_mode=counted)
        want = priced_collectives(workload_from_model(spec, seq=512)[0], plan_config(plan), cluster)[0]
        out[kind] = (counted.summary, {k: list(v) for k, v in want.items()})
    return out


@functools.lru_cache(maxsize=None)
def _at_scale(group: str) -> dict[str, tuple[dict, dict]]:
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:  # check_rank makes the default PG
        return pool.submit(_count_at_scale, SCALE_GROUPS[group]).result(timeout=600)


def at_scale(kind: str) -> tuple[dict, dict]:
    return _at_scale(next(g for g, kinds in SCALE_GROUPS.items() if kind in kinds))[kind]


@pytest.mark.parametrize("kind", [*SCALE_GROUPS["world8"][:4],
                                  pytest.param("tp8_dp8_zero3", marks=pytest.mark.slow)])
def test_priced_equals_issued_at_plan_world_size(kind):
    got, want = at_scale(kind)
    axes = {"tp2_dp4_zero3": "tp", "tp2_sp_dp4_zero2": "tp", "cp2_dp4_zero3": "cp", "ep2_dp8_zero3": "ep",
            "tp8_dp8_zero3": "tp"}[kind]
    assert any(axis == axes for axis, _ in want), f"{kind}: the plan prices no {axes} collective"
    _assert_equal(got, want)
    _assert_only_reporting(_extras(got, want))


def test_zero0_on_gpus_reduces_bf16_gradients_over_tp():
    """ZeRO-0 on GPUs with tp (FSDP2 replicate under ``runtime.data_parallel.mixed_precision``: bf16 parameters and
    compute, fp32 gradient reduction) issues what the step model prices from the bf16 trace: the backward
    all-reduces of the colwise linears' input gradients over tp move bf16 (under fp32 parameters and bf16 autocast
    they moved fp32, 1.75x the priced bytes), the dp all-reduces fp32 gradients per replicate unit."""
    got, want = at_scale("tp2_dp4_zero0")
    assert want[("tp", "all_reduce")][0] > 0 and want[("dp", "all_reduce")][0] > 0
    _assert_equal(got, want)
    _assert_only_reporting(_extras(got, want))


def test_zero0_by_hand_on_gpus_is_priced_in_its_autocast_dtypes():
    """ZeRO-0 with ep (or in a pipeline) has no data-parallel wrapper, so on GPUs its fp32 parameters compute
    under bf16 autocast (``runtime.data_parallel.compute_autocast``): the vocabulary-parallel embedding's output,
    the gradient into the head (the final norm's fp32 output) and the tokens the experts receive are fp32. The
    step model prices those ranks over the autocast trace with each tensor at the dtype autocast runs it in
    (``planner.search.block_cost``): tp all-reduces and ep all-to-alls equal in count and bytes what rank 0
    issues, twice the bf16 bytes of the same plan priced without autocast; the dp all-reduces move the rank's
    shard of the vocabulary-parallel embedding's gradient (``average_gradients``), not DTensor's whole one."""
    got, want = at_scale("tp2_ep2_dp4_zero0")
    assert want[("tp", "all_reduce")][0] > 0 and want[("ep", "all_to_all")][0] > 0
    _assert_equal(got, want)
    _assert_only_reporting(_extras(got, want))


def test_autocast_ranks_price_fp32_messages_where_autocast_keeps_fp32():
    """The same tp2 x ep2 plan's layer contexts with and without autocast: the embedding's forward all-reduce, the
    head's input-gradient all-reduce and the ep token all-to-alls are fp32 (twice the bytes) under autocast; the
    matmuls run at the bf16 rate either way, so the blocks' compute is not the fp32 coster's."""
    import dataclasses

    from costmodel.profiles import make_cluster
    from costmodel.step import layer_contexts
    from planner.reprice import plan_config
    from planner.search.driver import plan_model
    from planner.workload import workload_from_model

    spec, fix, nodes = AT_SCALE["tp2_ep2_dp4_zero0"]
    cluster = make_cluster("dgx-a100-80gb", nodes)
    plan = plan_model(spec, cluster, global_batch=16, seq=512, fix=fix)
    w = workload_from_model(spec, seq=512)[0]
    for layer, ctx in zip(w.layers, layer_contexts(w, plan_config(plan), cluster)):
        assert ctx.autocast, layer.name
        under, plain = w.coster(layer, ctx), w.coster(layer, dataclasses.replace(ctx, autocast=False))
        pairs = [(u, p) for u, p in zip(under.collectives, plain.collectives) if u.axis in ("tp", "ep")]
        assert len(under.collectives) == len(plain.collectives) and pairs, layer.name
        assert all((u.axis, u.op, u.phase, u.count) == (p.axis, p.op, p.phase, p.count) for u, p in pairs)
        # floating-point messages double; the experts' int64 routing ids and the loss's fp32 statistics do not
        assert all(u.nbytes in (p.nbytes, 2 * p.nbytes) for u, p in pairs), layer.name
        doubled = sum(p.nbytes * p.count for u, p in pairs if u.nbytes == 2 * p.nbytes)
        assert doubled > 0.98 * sum(p.nbytes * p.count for _, p in pairs), layer.name
        assert under.params == plain.params
        fp32 = w.coster.with_dtype_bytes(4)(layer, dataclasses.replace(ctx, autocast=False))
        assert under.fwd_s < fp32.fwd_s, layer.name


def test_runtime_buckets_are_the_priced_buckets():
    """ZeRO-0 by hand (``runtime.data_parallel.gradient_buckets``) cuts the gradients where the step model counts
    DDP's buckets (``costmodel.step.ddp_buckets`` with the autopar target's sizes)."""
    from costmodel.step import ddp_buckets
    from costmodel.targets import load_target
    from runtime.data_parallel import gradient_buckets

    k = load_target("autopar").constants
    for numel in (1, 2**18, 2**18 + 1, 7_000_000, 2**18 + 3 * 25 * 2**18, 2**18 + 3 * 25 * 2**18 + 1):
        assert len(gradient_buckets(numel, 4)) == ddp_buckets(numel * 4.0, k), numel
