"""Planner search: the default search equals brute force over everything the runtime runs (random small instances,
heterogeneous and memory-tight ones); its bounds hold for the step model; status and bound are honest; fix; errors;
determinism; time limit and progress."""

import functools
import itertools
import math
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _brute_force import brute_force, counts, cuts, knobs, structures  # noqa: E402
from _toy_step import ToyConfig, toy_estimate, toy_workload  # noqa: E402

from costmodel.analytic import gpt_workload, llama_workload, transformer_workload  # noqa: E402
from costmodel.errors import ConfigError, InfeasiblePlanError  # noqa: E402
from costmodel.hardware import Cluster  # noqa: E402
from costmodel.profiles import make_cluster  # noqa: E402
from costmodel.step import ParallelConfig, estimate_step  # noqa: E402
from planner.search import bounds as bd  # noqa: E402
from planner.search import driver  # noqa: E402
from planner.search import space as sp  # noqa: E402


# --- random small instances --------------------------------------------------------------------------------


def _with_memory(cluster, gb):
    groups = tuple(replace(g, node=replace(g.node, gpu=replace(g.node.gpu, memory_gb=gb))) for g in cluster.groups)
    return replace(cluster, groups=groups)


def _instance(rng):
    """A random transformer, cluster (one or two node types; often memory-tight: device memory between what
    full recomputation and none need on a plain data-parallel configuration) and global batch."""
    heads = rng.choice([4, 8])
    wl = transformer_workload(
        layers=rng.choice([2, 3, 4]), hidden=rng.choice([512, 1024, 2048]), heads=heads,
        kv_heads=rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0]), vocab=rng.choice([1000, 8000, 32000]),
        seq=rng.choice([1024, 2048, 4096]), glu=rng.random() < 0.5, tied_embeddings=rng.random() < 0.5,
        bias=rng.random() < 0.5, name="random")
    gpn = rng.choice([1, 2, 4])
    if rng.random() < 0.25:
        a, h = make_cluster("dgx-a100-80gb", 1, gpus_per_node=gpn), make_cluster("dgx-h100", 1, gpus_per_node=gpn)
        cl = Cluster(name="a100+h100", groups=(a.groups[0], h.groups[0]))
    else:
        cl = make_cluster(rng.choice(["dgx-a100-80gb", "pcie-8xa100", "dgx-h100", "pcie-8xl40s"]), rng.choice([1, 2]),
                          gpus_per_node=gpn)
    gb = rng.choice([1, 2, 4])
    n = cl.num_devices
    if rng.random() < 0.6 and gb % n == 0:
        mem = [estimate_step(wl, ParallelConfig(dp=n, microbatch=gb // n, global_batch=gb, recompute=r,
                                                zero_stage=3 if n > 1 else 0), cl).memory_gb_per_device
               for r in ("full", "none")]
        cl = _with_memory(cl, rng.uniform(mem[0], mem[1]) * (0.5 if rng.random() < 0.1 else 1.0))
    return wl, cl, gb


def _size(wl, cl, gb):
    """Configurations the brute force prices (every structure, knobs, cut and recompute count)."""
    return sum(1 for s in structures(wl, cl, gb) for k in knobs(wl, s) for c in cuts(wl, s.pp * s.virtual_stages)
               for _ in (counts(wl, c) if k.recompute != "none" else [None]))


def _instances(seed, n, most):
    rng, out = random.Random(seed), []
    while len(out) < n:
        case = _instance(rng)
        if 0 < _size(*case) <= most:
            out.append(case)
    return out


def _check_default_search(wl, cl, gb):
    """The default search (no options) against brute force: equal optimum when it says optimal; otherwise its
    bound is below the optimum and its plan at least the optimum."""
    ref = brute_force(wl, cl, gb, estimate_step)
    if ref is None:
        with pytest.raises(InfeasiblePlanError):
            driver.search(workload=wl, cluster=cl, global_batch=gb)
        return "infeasible"
    res = driver.search(workload=wl, cluster=cl, global_batch=gb)
    assert res.best.fits
    assert res.bound_s <= ref.step_time_s * (1 + 1e-9) <= res.best.step_time_s * (1 + 2e-9)
    if res.status == "optimal":
        assert res.best.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9), (
            res.best.summary(), ref.structure.summary(), ref.knobs.summary(), ref.stage_layers)
        assert res.proven.startswith("optimal over the whole space")
    else:
        assert "open" in res.proven
    partial = ref.knobs.recompute_layers is not None and any(
        k < n for k, n in zip(ref.knobs.recompute_layers, _recomputable(wl, ref.stage_layers)))
    return ("partial " if partial else "") + res.status + (" pp" if ref.structure.pp > 1 else "")


def _recomputable(wl, stage_layers):
    out, start = [], 0
    for n in stage_layers:
        out.append(sum(1 for l in wl.layers[start : start + n] if l.recomputable))
        start += n
    return out


@functools.cache
def _drawn(n: int) -> tuple:
    return tuple(_instances(2026, n, most=4000))


def test_default_search_equals_brute_force_on_80_random_instances():
    seen = [_check_default_search(*case) for case in _drawn(149)[:80]]
    assert sum("optimal" in s for s in seen) >= 40  # small instances: the whole space is proven
    assert sum("pp" in s for s in seen) >= 10 and sum("infeasible" in s for s in seen) >= 1


def test_default_search_equals_brute_force_where_partial_recomputation_wins():
    """Recomputing some layers of a stage wins somewhere: the first such instance of the same draw is the 44th
    (dp2 ZeRO-1, one layer fully recomputed; under the memory model before the small-plan and full-scale memory
    fixes it was the 149th)."""
    assert "partial" in _check_default_search(*_drawn(149)[43])


@pytest.mark.slow
def test_default_search_equals_brute_force_on_100_larger_instances():
    # every instance equals brute force (checked inside); under the runtime's FSDP2 layouts partial recomputation
    # wins in none of this draw (it did in 3 under the earlier memory model): the case where it wins is
    # test_default_search_equals_brute_force_where_partial_recomputation_wins
    seen = [_check_default_search(*case) for case in _instances(7, 100, most=20000)]
    assert sum("optimal" in s for s in seen) >= 80


# --- bounds and the step-model properties they rest on ------------------------------------------------------


def _bound_ctx(wl, cl, gb):
    ctx = driver._Ctx(workload=wl, cluster=cl, global_batch=gb, estimate=estimate_step, options=sp.SearchOptions(),
                      fix={}, deadline=None, progress=None, layout=bd.layout_of(wl.layers),
                      ideal_s=driver._ideal_step_s(wl, cl, gb))
    structs = sp.enumerate_structures(
        dims=sp.ModelDimsLite(heads=wl.heads, kv_heads=wl.kv_heads, layers=wl.num_layers, seq=wl.seq),
        num_devices=cl.num_devices, gpus_per_node=cl.gpus_per_node, global_batch=gb, options=ctx.options,
        group_devices=tuple(g.node.gpus_per_node * g.count for g in cl.groups))
    driver._probes(ctx, structs)
    return ctx, structs


@pytest.mark.parametrize("hetero", [False, True])
def test_bounds_hold_for_the_step_model(hetero):
    """Structure and cut bounds are below every estimate of every knob, recompute count and cut tried."""
    wl = llama_workload(layers=8, hidden=2048, heads=16, kv_heads=4, ffn_hidden=5632, vocab=32000, seq=2048)
    if hetero:
        a, h = make_cluster("dgx-a100-80gb", 1, gpus_per_node=4), make_cluster("dgx-h100", 1, gpus_per_node=4)
        cl = Cluster(name="a100+h100", groups=(a.groups[0], h.groups[0]))
    else:
        cl = make_cluster("pcie-8xa100", 1)
    ctx, structs = _bound_ctx(wl, cl, 16)
    rng, checked = random.Random(5), 0
    for s in rng.sample(structs, 60):
        whole = driver._sp_bounds(ctx, s)
        for _ in range(4):
            cut = rng.choice(list(cuts(wl, s.pp * s.virtual_stages)))
            at = driver._sp_bounds(ctx, s, cut)
            k = rng.choice(list(knobs(wl, s)))
            rl = rng.choice(list(counts(wl, cut))) if k.recompute != "none" else None
            est = ctx.price(s, replace(k, recompute_layers=rl), cut)
            if est is None:
                continue
            assert est.step_time_s >= whole[k.sequence_parallel] * (1 - 1e-9), (s.summary(), cut)
            assert est.step_time_s >= at[k.sequence_parallel] * (1 - 1e-9), (s.summary(), cut)
            assert est.step_time_s >= whole[k.sequence_parallel] and at[k.sequence_parallel] >= whole[
                k.sequence_parallel] * (1 - 1e-9)
            checked += 1
    assert checked > 150


def test_bounds_hold_where_zero0_computes_fp32_parameters_under_autocast():
    """On GPUs the runtime's ZeRO-0 (DDP, or no wrapper) computes fp32 parameters under bf16 autocast, which the
    step model prices over the autocast trace: more bytes than ZeRO 1-3's bf16 compute (FSDP2 mixed precision),
    so a ZeRO-0 probe's layer costs are no bound for them. The search reads its bounds off probes priced in the
    fastest regime (``estimate_step(autocast=False)``): below every estimate of every ZeRO stage, while the
    probe as ZeRO-0 runs exceeds some ZeRO-1 estimate (what made the GPT-3 plan 20.84 s instead of 20.36 s)."""
    from planner.workload import workload_from_model

    wl = workload_from_model("llama:layers=4,hidden=512,ffn=1408,heads=8,kv_heads=8,vocab=8192,seq=256")[0]
    cl = make_cluster("dgx-a100-80gb", 1)
    ctx, structs = _bound_ctx(wl, cl, 16)
    ctx.bound_estimate = functools.partial(estimate_step, autocast=False)
    runs_as, _ = _bound_ctx(wl, cl, 16)  # probes priced as the runtime runs them
    rng, checked, unsound = random.Random(3), 0, 0
    for s in rng.sample(structs, min(40, len(structs))):
        cut = ctx.even_cuts(s)
        bound, naive = driver._sp_bounds(ctx, s, cut), driver._sp_bounds(runs_as, s, cut)
        for k in knobs(wl, s):
            if k.recompute != "none":
                continue
            est = ctx.price(s, k, cut)
            if est is None:
                continue
            assert est.step_time_s >= bound[k.sequence_parallel] * (1 - 1e-9), (s.summary(), k.summary())
            unsound += est.step_time_s < naive[k.sequence_parallel] * (1 - 1e-9)
            checked += 1
    assert checked > 100 and unsound > 0


def test_rank_times_are_additive_and_recomputation_and_zero_only_add():
    """What the bounds read off one estimate: a rank's time is its entries' times (E_r + n_r u_r); ZeRO leaves
    rank times alone; recomputing more layers never takes less time, nor more memory once one layer recomputes
    (full recomputation's one-layer buffer appears with the first); a rank's memory depends on its own recompute
    counts only."""
    wl = gpt_workload(layers=12, hidden=2048, heads=16, vocab=51200, seq=2048)
    cl = make_cluster("dgx-a100-80gb", 2)
    ctx, _ = _bound_ctx(wl, cl, 32)
    layout = bd.layout_of(wl.layers)
    s = sp.Structure(tp=2, cp=1, ep=1, pp=4, dp=2, microbatch=2, schedule="1f1b", virtual_stages=1,
                     num_microbatches=8)
    base = sp.Knobs(sequence_parallel=True)
    costs = driver._costs(ctx, s, True)
    assert costs is not None
    for per in [(3, 3, 3, 3), (1, 4, 5, 2), (0, 6, 6, 0), (5, 1, 1, 5)]:
        cut = bd.stage_layers_of(layout, per)
        est = ctx.price(s, base, cut)
        want = [costs.fixed_s(r) + per[r] * costs.layer_s[r] for r in range(4)]
        assert est.stage_time_s == pytest.approx(want, rel=1e-9)
        for z in (1, 2, 3):
            assert ctx.price(s, replace(base, zero_stage=z), cut).stage_time_s == pytest.approx(est.stage_time_s)
        for mode in ("selective", "full"):
            prev = None
            for k in range(0, 4):
                rl = tuple(min(k, n) for n in per)
                e = ctx.price(s, replace(base, recompute=mode, recompute_layers=rl), cut)
                if prev is not None:
                    assert e.step_time_s >= prev.step_time_s * (1 - 1e-12)
                if k >= 2:
                    assert all(a <= b * (1 + 1e-12) for a, b in zip(e.stage_memory_gb, prev.stage_memory_gb))
                prev = e
            mixed = ctx.price(s, replace(base, recompute=mode, recompute_layers=(min(2, per[0]), 0, 0, 0)), cut)
            others = tuple(min(1, n) for n in per[1:])
            alone = ctx.price(s, replace(base, recompute=mode, recompute_layers=(min(2, per[0]),) + others), cut)
            assert mixed.stage_memory_gb[0] == pytest.approx(alone.stage_memory_gb[0], rel=1e-12)


def test_rank_count_listing_equals_filtering_every_cut():
    """``bounds.rank_counts_below`` lists exactly the cuts (water-filled within ranks) whose bound is below."""
    rng = random.Random(3)
    for _ in range(200):
        pp, v = rng.randint(1, 4), rng.randint(1, 3)
        sched = "1f1b" if v == 1 else rng.choice(["interleaved-1f1b", "zero-bubble"])
        layout = bd.Layout(lead=1, layers=pp * v + rng.randint(0, 5), trail=1)
        costs = bd.RankCosts(layer_s=tuple(rng.uniform(0.5, 2.0) for _ in range(pp)), first_s=rng.uniform(0, 1),
                             last_s=rng.uniform(0, 3), layout=layout)
        m = rng.randint(1, 8)
        lows = bd.rank_lows(layout, pp, v)
        every = {}
        for per in _compositions(layout.layers, lows):
            spreads = bd._spreads(costs, per, v) if sched == "zero-bubble" and v > 1 else [
                bd.chunk_counts(costs, per, v)]
            for c in spreads:
                every[tuple(c)] = bd.cut_bound_s(costs, c, schedule=sched, v=v, m=m)
        least = min(every.values())
        assert bd.structure_bound_s(costs, schedule=sched, v=v, m=m) <= least * (1 + 1e-12)
        below = least * rng.uniform(1.0, 1.3) + 1e-9
        got = bd.rank_counts_below(costs, schedule=sched, v=v, m=m, below_s=below, limit=10**6)
        assert sorted(c for _, c in got) == sorted(c for c, b in every.items() if b < below)


def _compositions(n, lows):
    if len(lows) == 1:
        return [(n,)] if n >= lows[0] else []
    return [(k, *rest) for k in range(lows[0], n + 1) for rest in _compositions(n - k, lows[1:])]


# --- the cases the space used to cut out --------------------------------------------------------------------


@pytest.mark.slow
def test_flagship_gpt3_reaches_the_best_hand_picked_configuration():
    """GPT-3 175B on 128 DGX-A100 (batch 1536): hand-picked Megatron-style configurations (tp 2 / 4 / 8, pp 8,
    1F1B or interleaved up to v=12, ZeRO-1 / 2, sequence parallel, no or full recomputation); the search must
    reach at most the step time of the fastest of them that fits."""
    wl = gpt_workload(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048)
    cl = make_cluster("dgx-a100-80gb", 128)
    picked = []
    for tp, v, zero, rc in itertools.product((2, 4, 8), (1, 2, 3, 4, 6, 12), (1, 2), ("none", "full")):
        cfg = ParallelConfig(tp=tp, pp=8, dp=1024 // (8 * tp), microbatch=1, global_batch=1536,
                             schedule="1f1b" if v == 1 else "interleaved-1f1b", virtual_stages=v,
                             sequence_parallel=True, zero_stage=zero, recompute=rc)
        est = estimate_step(wl, cfg, cl)
        if est.fits:
            picked.append(est.step_time_s)
    assert picked, "no hand-picked configuration fits"
    res = driver.search(workload=wl, cluster=cl, global_batch=1536)
    assert res.best.step_time_s <= min(picked) * (1 + 1e-9)
    assert res.bound_s <= res.best.step_time_s


def test_uneven_cuts_beat_the_even_split_where_the_issue_found_them():
    """Llama 8 layers with a 128k vocabulary: on one PCIe L40S node pp4 dp2 zero-bubble with cuts 3/3/3/1
    beats the old plan; with pp fixed to 8 on two PCIe A100 nodes the head gets a chunk of its own. The plan
    must be at least as fast as those cuts, and say it proved so."""
    wl = llama_workload(layers=8, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256, seq=4096)
    cl = make_cluster("pcie-8xl40s", 1)
    res = driver.search(workload=wl, cluster=cl, global_batch=16)
    zb = ParallelConfig(tp=1, pp=4, dp=2, microbatch=1, global_batch=16, schedule="zero-bubble")
    cited = estimate_step(wl, zb, cl, stage_layers=(3, 3, 3, 1))  # entries: embedding + 2 layers, 3, 3, the head
    assert res.best.step_time_s <= cited.step_time_s * (1 + 1e-9) or not cited.fits
    cl2 = make_cluster("pcie-8xa100", 2)
    fixed = driver.search(workload=wl, cluster=cl2, global_batch=16, fix="pp=8")
    even = min((e for e in (fixed.best,) + tuple(fixed.alternatives)), key=lambda c: c.step_time_s)
    assert fixed.best.uneven and fixed.best.step_time_s <= even.step_time_s
    assert fixed.status == "optimal", fixed.proven


def test_partial_recomputation_where_none_does_not_fit():
    """A 1F1B pipeline whose first rank holds four micro-batches in flight: recomputing some of its layers
    fits; full recomputation everywhere is slower than the plan."""
    wl = gpt_workload(layers=8, hidden=4096, heads=32, vocab=51200, seq=4096)
    cl = make_cluster("dgx-a100-80gb", 1, gpus_per_node=4)
    fix = "tp=1,pp=4,schedule=1f1b,mb=1,zero=0"
    plain = driver.search(workload=wl, cluster=_with_memory(cl, 1000.0), global_batch=8, fix=fix)
    full = driver.search(workload=wl, cluster=_with_memory(cl, 1000.0), global_batch=8, fix=fix + ",recompute=full")
    mid = (plain.best.estimate.memory_gb_per_device + full.best.estimate.memory_gb_per_device) / 2
    even = sp.SearchOptions(uneven_stages=False)  # uneven cuts alone can make it fit here
    res = driver.search(workload=wl, cluster=_with_memory(cl, mid), global_batch=8, fix=fix, options=even)
    rl = res.best.knobs.recompute_layers
    assert res.best.knobs.recompute != "none" and rl is not None and 0 < sum(rl) < 8, res.best.summary()
    assert res.best.step_time_s < full.best.step_time_s


# --- status, bound, limits ----------------------------------------------------------------------------------


def _toy_setup(mem=0.05):
    wl = toy_workload(layers=6, hidden=512, heads=8, vocab=1000, seq=256)
    cl = make_cluster("dgx-a100-80gb", 1, gpus_per_node=8)
    return wl, cl, functools.partial(toy_estimate, mem_gb=mem)


def test_toy_search_equals_brute_force():
    """The search against brute force under a stand-in step model (same closed forms, its own numbers)."""
    wl = toy_workload(layers=4, hidden=512, heads=8, vocab=1000, seq=256)
    cl = make_cluster("dgx-a100-80gb", 1, gpus_per_node=4)
    est = functools.partial(toy_estimate, mem_gb=0.06)
    ref = brute_force(wl, cl, 8, est, config_type=ToyConfig)
    res = driver.search(workload=wl, cluster=cl, global_batch=8, estimate=est, config_type=ToyConfig)
    assert res.status == "optimal" and res.best.step_time_s == pytest.approx(ref.step_time_s, rel=1e-12)
    assert res.bound_s == res.best.step_time_s
    assert res.best.knobs.recompute_layers is not None  # memory-tight: some layers recompute


def test_open_structures_make_the_status_feasible_with_their_least_bound():
    """With the cut search off, the pipelines whose bound is below the plan stay open: status feasible, bound
    their least bound, and the text says why."""
    wl, cl, est = _toy_setup()
    res = driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig,
                        options=sp.SearchOptions(uneven_stages=False))
    assert res.status == "feasible" and res.bound_s < res.best.step_time_s
    assert "even cuts only" in res.proven and "open" in res.proven


def test_fix_pins_choices_and_rejects_unknown_keys():
    wl, cl, est = _toy_setup()
    res = driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig,
                        fix="tp=2,pp=2,mb=2,recompute=full")
    s = res.best.structure
    assert (s.tp, s.pp, s.microbatch, res.best.knobs.recompute) == (2, 2, 2, "full")
    assert res.best.knobs.recompute_layers is None  # a fixed mode covers every layer
    with pytest.raises(ConfigError, match="known keys"):
        driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig, fix="tq=2")
    with pytest.raises(ConfigError, match="tp=3 pp=2|relax --fix"):
        driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig, fix="tp=3")


def test_batch_not_divisible_names_nearest_valid_values():
    wl, cl, est = _toy_setup()
    with pytest.raises(ConfigError, match=r"global_batch=13 .*nearest valid global batches: \[16, 8\]"):
        driver.search(workload=wl, cluster=cl, global_batch=13, estimate=est, config_type=ToyConfig,
                      fix={"tp": 1, "pp": 1, "cp": 1})


def test_expired_time_limit_returns_best_so_far_marked_feasible():
    wl, cl, est = _toy_setup()
    full = driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig)
    cut = driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig, time_limit_s=0)
    assert full.status == "optimal" and cut.status == "feasible"
    assert cut.best.fits and cut.candidates_explored < full.candidates_explored
    assert cut.bound_s <= full.best.step_time_s <= cut.best.step_time_s
    assert "time limit" in cut.proven


def test_progress_counts_structures_explored():
    wl, cl, est = _toy_setup()
    seen = []
    res = driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig,
                        progress=lambda phase, done, total, best: seen.append((phase, done, total)))
    explored = [d for p, d, _ in seen if p == "explored"]
    assert explored == list(range(1, res.candidates_explored + 1))
    assert all(t == seen[0][2] for p, _, t in seen if p == "explored") and seen[0][2] > res.candidates_explored
    assert ("pruned by bound", seen[0][2] - res.candidates_explored, seen[0][2]) in seen


def test_search_is_deterministic():
    wl, cl, est = _toy_setup()
    a, b = (driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig)
            for _ in range(2))
    assert a.best.key() == b.best.key() and a.proven == b.proven
    assert [c.key() for c in a.alternatives] == [c.key() for c in b.alternatives]
    assert all(c.step_time_s >= a.best.step_time_s for c in a.alternatives)


def test_search_makes_no_reference_cycles():
    """The search runs with the cyclic collector paused (``driver._without_cycle_collection``): what it drops
    must be freed by reference counts alone, and the collector is on again after it."""
    import gc

    wl = gpt_workload(layers=4, hidden=1024, heads=8, vocab=8000, seq=1024)
    cl = make_cluster("dgx-a100-80gb", 1)
    driver.search(workload=wl, cluster=cl, global_batch=8)  # warm the step model's memos
    gc.collect()
    gc.disable()
    try:
        driver.search(workload=wl, cluster=cl, global_batch=16)
        assert gc.collect() == 0
    finally:
        gc.enable()
    driver.search(workload=wl, cluster=cl, global_batch=8)
    assert gc.isenabled()


def test_space_rules():
    dims = sp.ModelDimsLite(heads=12, kv_heads=4, layers=10, seq=2048, experts=8)
    assert sp.tp_choices(dims, gpus_per_node=8) == [1, 2, 4]  # divides 12 and 4, power of two, within a node
    assert sp.ep_choices(dims, dp=12) == [1, 2, 4]  # divides experts and dp
    opts = sp.SearchOptions()
    structs = sp.enumerate_structures(dims=dims, num_devices=16, gpus_per_node=8, global_batch=32, options=opts)
    for s in structs:
        assert s.tp * s.cp * s.pp * s.dp == 16 and s.dp % s.ep == 0
        assert s.microbatch * s.num_microbatches * s.dp == 32
        assert s.pp * s.virtual_stages <= dims.layers
        if s.schedule == "1f1b" and s.pp > 1:
            assert s.num_microbatches >= s.pp
        if s.schedule in ("interleaved-1f1b", "zero-bubble"):
            assert s.num_microbatches % s.pp == 0
    assert max(s.virtual_stages for s in structs if s.pp == 2) == 5  # up to layers / pp
    assert max(s.microbatch for s in structs if s.dp == 1) == 32  # every divisor of global_batch / dp
    assert any(s.schedule == "zero-bubble" and s.virtual_stages == 2 for s in structs)
    assert any(s.pp == 3 for s in sp.enumerate_structures(dims=dims, num_devices=24, gpus_per_node=8,
                                                          global_batch=24, options=opts))  # uneven: 10 layers / 3
    assert sp.nearest_valid_batches(global_batch=1000, dps=[64, 48]) == [1008, 1024, 960]


def test_infeasible_error_carries_the_memory_needed():
    wl = gpt_workload(layers=4, hidden=8192, heads=64)
    cl = _with_memory(make_cluster("dgx-a100-80gb", 1, gpus_per_node=1), 4.0)
    with pytest.raises(InfeasiblePlanError, match="needs at least") as info:
        driver.search(workload=wl, cluster=cl, global_batch=8)
    assert info.value.memory_gb_needed > 4
    assert f"{info.value.memory_gb_needed:.1f} GB per device" in str(info.value)


def test_moe_models_are_never_priced_with_selective_recompute():
    """The runtime's selective checkpointing fails on MoE routers: the search must not even price it there
    (dense models still get it where memory is tight), unless the user pins it with --fix."""

    def recompute_priced(workload, fix=None):
        seen = set()

        def recording(w, cfg, cluster, **kw):
            seen.add(cfg.recompute)
            return estimate_step(w, cfg, cluster, **kw)

        roomy = driver.search(workload=workload, cluster=make_cluster("dgx-a100-80gb", 1), global_batch=16)
        tight = _with_memory(make_cluster("dgx-a100-80gb", 1), 0.7 * roomy.best.estimate.memory_gb_per_device)
        driver.search(workload=workload, cluster=tight, global_batch=16, estimate=recording, fix=fix)
        return seen

    dims = dict(layers=4, hidden=1024, ffn_hidden=2048, heads=16, kv_heads=8, vocab=32000, seq=2048)
    assert "selective" in recompute_priced(llama_workload(**dims))
    assert "selective" not in recompute_priced(llama_workload(**dims, experts=8, topk=2))
    assert "selective" in recompute_priced(llama_workload(**dims, experts=8, topk=2), fix="recompute=selective")


def test_zero_bubble_never_gets_fsdp():
    zb = sp.Structure(tp=1, cp=1, ep=1, pp=2, dp=2, microbatch=1, schedule="zero-bubble", virtual_stages=1,
                      num_microbatches=4)
    assert {k.zero_stage for k in sp.knob_choices(zb, options=sp.SearchOptions())} == {0}


@pytest.mark.parametrize("case_id", ["megatron-sc21-t1-1.7b", "megatron-sc21-t1-39.1b",
                                     pytest.param("megatron-sc21-t2-175b-zero3-768", marks=pytest.mark.slow),
                                     pytest.param("megatron-sc21-t1-1008.0b", marks=pytest.mark.slow)])
def test_plan_beats_published_megatron_config(case_id):
    """Same cost model for both: the plan predicts at least the published configuration's throughput, and fits."""
    from benchmarks.plan_quality import load_cases, published_config

    case = next(c for c in load_cases() if c.id == case_id)
    wl = gpt_workload(**case.dims, vocab=51200, seq=2048, ffn_hidden=4 * case.dims["hidden"], name=case_id)
    cl = make_cluster("dgx-a100-80gb", case.gpus // 8)
    cfg = published_config(case)
    pub = estimate_step(wl, cfg, cl)
    res = driver.search(workload=wl, cluster=cl, global_batch=cfg.global_batch)
    assert res.best.fits
    assert res.best.estimate.tokens_per_s >= pub.tokens_per_s * (1 - 1e-9), (res.best.summary(), pub.step_time_s)


def test_plan_model_byte_identical_json_and_time_limit():
    from planner.plan import ModelInfo

    wl = gpt_workload(layers=24, hidden=4096, heads=32, name="gpt-24x4096")
    info = ModelInfo(name=wl.name, fingerprint="sha256:test", params=wl.params, flops_per_step=0.0,
                     num_layers=24, seq_len=2048)
    cl = make_cluster("dgx-a100-80gb", 4)
    full = driver.plan_model((wl, info), cl, global_batch=256, record_timings=False)
    again = driver.plan_model((wl, info), cl, global_batch=256, record_timings=False)
    assert full.to_json() == again.to_json()
    assert full.solver.proven and full.solver.bound <= full.prediction.step_time_s
    assert full.solver.status != "optimal" or full.solver.gap == 0.0
    cut = driver.plan_model((wl, info), cl, global_batch=256, time_limit_s=0.0)
    assert cut.solver.status == "feasible" and cut.prediction.fits and "time limit" in cut.solver.proven
    assert cut.solver.candidates_explored < full.solver.candidates_explored
    assert cut.solver.bound <= full.prediction.step_time_s <= cut.prediction.step_time_s
    rl = [st.recompute_layers for st in full.stages]
    assert all(isinstance(k, int) and 0 <= k <= len(st.modules) for k, st in zip(rl, full.stages))


def test_sequence_parallel_only_where_the_blocks_can_execute_it():
    """GPT-2's Conv1D layers stay replicated, so no tp admits sequence parallelism: the search must not pick it."""
    from planner.search import model_input

    cluster = make_cluster("dgx-h100", 1)
    loaded = model_input.load("gpt2", seq=None, global_batch=8)
    assert model_input.sequence_parallel_tps(loaded, cluster=cluster, max_tp=8) == frozenset()
    plan = driver.plan_model("gpt2", cluster, global_batch=8, fix={"tp": 2})
    assert plan.degrees.tp == 2 and not plan.sequence_parallel


def test_plans_keep_tied_embedding_and_head_split_alike():
    from costmodel.profiles import resolve_cluster

    plan = driver.plan_model("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32",
                             resolve_cluster("local", nodes=1, gpus_per_node=2), global_batch=4, fix={"tp": 2})
    styles = {s.fqn: s.style for s in plan.shardings}
    assert styles["lm_head"] == "vocab_head"
    assert styles["model.decoder.embed_tokens"] == "vocab_embedding"
    assert styles["model.decoder.embed_positions"] == "replicate"
