"""Planner search: equals brute force over the whole space on small instances; fix; errors; determinism."""

import functools
import itertools
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _toy_step import ToyConfig, toy_estimate, toy_workload  # noqa: E402

from costmodel.errors import ConfigError, InfeasiblePlanError  # noqa: E402
from costmodel.profiles import make_cluster  # noqa: E402
from planner.search import driver  # noqa: E402
from planner.search import space as sp  # noqa: E402


def _pow2(n):
    return n > 0 and n & (n - 1) == 0


def brute_force(workload, cluster, global_batch, estimate, *, max_mb=16, max_cp=8, max_v=8, zeros=(0, 1, 2, 3),
                schedules=("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"), config_type=ToyConfig,
                pp_ok=lambda pp: True):
    """Every configuration and every cut, written from the rules, not from planner.search.space."""
    N, gpn, L = cluster.num_devices, cluster.gpus_per_node, len(workload.layers)
    best = None
    for tp, cp, pp in itertools.product(range(1, N + 1), repeat=3):
        if N % (tp * cp * pp) or not _pow2(tp) or tp > gpn or workload.heads % tp or not _pow2(cp) or cp > max_cp:
            continue
        if not pp_ok(pp):
            continue
        if cp > 1 and workload.seq % (2 * cp) or pp > workload.num_layers:
            continue
        dp = N // (tp * cp * pp)
        if global_batch % dp:
            continue
        for mb in range(1, min(max_mb, global_batch // dp) + 1):
            if (global_batch // dp) % mb:
                continue
            m = global_batch // dp // mb
            scheds = [("1f1b", 1)] if pp == 1 else (
                [("gpipe", 1)] + ([("1f1b", 1)] if m >= pp else [])
                + ([("interleaved-1f1b", v) for v in range(2, max_v + 1) if pp * v <= workload.num_layers]
                   + [("zero-bubble", 1)] if m % pp == 0 else []))
            for (sched, v), rec, z, spar in itertools.product(
                    scheds, ("none", "selective", "full"), zeros, (False, True)):
                if spar and tp == 1 or sched not in schedules and pp > 1:
                    continue
                chunks = pp * v
                for inner in itertools.combinations(range(1, L), chunks - 1):
                    cuts = tuple(b - a for a, b in zip((0, *inner), (*inner, L)))
                    s = sp.Structure(tp=tp, cp=cp, ep=1, pp=pp, dp=dp, microbatch=mb, schedule=sched,
                                     virtual_stages=v, num_microbatches=m)
                    cfg = driver.make_config(s, sp.Knobs(recompute=rec, zero_stage=z, sequence_parallel=spar),
                                             global_batch=global_batch, config_type=config_type)
                    try:
                        est = estimate(workload, cfg, cluster, stage_layers=cuts)
                    except ConfigError:
                        continue
                    if est.fits and (best is None or est.step_time_s < best[0]):
                        best = (est.step_time_s, s, rec, z, spar, cuts)
    return best


CASES = [
    # (layers, hidden, heads, nodes, gpus_per_node, global_batch, mem_gb, zero stages, schedules, exhaustive cuts)
    (4, 256, 8, 1, 4, 8, 0.05, (0, 1, 2, 3), sp.SearchOptions().schedules, 10**6),  # ZeRO wins, pp = 1
    (6, 512, 8, 1, 8, 16, 0.05, (0,), sp.SearchOptions().schedules, 10**6),  # interleaved pipeline wins
    (6, 512, 8, 1, 8, 16, 0.05, (0,), ("gpipe", "1f1b"), 0),  # uneven cuts from the stage DP, not enumerated
    (5, 512, 4, 2, 2, 8, 0.03, (0, 3), sp.SearchOptions().schedules, 10**6),  # fits nowhere
]


@pytest.mark.parametrize("case", CASES)
def test_search_equals_brute_force_with_toy_model(case):
    layers, hidden, heads, nodes, gpn, gb, mem, zeros, schedules, ex_cuts = case
    wl = toy_workload(layers=layers, hidden=hidden, heads=heads, vocab=1000, seq=256)
    cl = make_cluster("dgx-a100-80gb", nodes, gpus_per_node=gpn)
    est = functools.partial(toy_estimate, mem_gb=mem)
    ref = brute_force(wl, cl, gb, est, zeros=zeros, schedules=schedules)
    opts = sp.SearchOptions(dp_margin=math.inf, dp_top_k=10**6, exhaustive_cuts=ex_cuts, zero_stages=zeros,
                            min_tokens_per_cp_rank=1, max_virtual_stages=8,
                            schedules=schedules)
    if ref is None:
        with pytest.raises(InfeasiblePlanError, match="GB per device"):
            driver.search(workload=wl, cluster=cl, global_batch=gb, estimate=est, options=opts, config_type=ToyConfig)
        return
    res = driver.search(workload=wl, cluster=cl, global_batch=gb, estimate=est, options=opts, config_type=ToyConfig)
    assert res.best.fits
    assert res.best.step_time_s == pytest.approx(ref[0], rel=1e-12), (res.best.summary(), ref)
    assert res.status == "optimal" and res.bound_s == pytest.approx(res.best.step_time_s)
    if layers == 6:
        assert res.best.structure.pp > 1  # the case must exercise pipelining


def _toy_setup(mem=0.05):
    wl = toy_workload(layers=6, hidden=512, heads=8, vocab=1000, seq=256)
    cl = make_cluster("dgx-a100-80gb", 1, gpus_per_node=8)
    return wl, cl, functools.partial(toy_estimate, mem_gb=mem)


def test_fix_pins_choices_and_rejects_unknown_keys():
    wl, cl, est = _toy_setup()
    res = driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig,
                        fix="tp=2,pp=2,mb=2,recompute=full")
    s = res.best.structure
    assert (s.tp, s.pp, s.microbatch, res.best.knobs.recompute) == (2, 2, 2, "full")
    with pytest.raises(ConfigError, match="known keys"):
        driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig, fix="tq=2")
    with pytest.raises(ConfigError, match="tp=3 pp=2|relax --fix"):
        driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig, fix="tp=3")


def test_batch_not_divisible_names_nearest_valid_values():
    wl, cl, est = _toy_setup()
    # 8 devices, tp fixed to 1 and pp to 1: dp = 8 must divide the batch
    with pytest.raises(ConfigError, match=r"global_batch=13 .*nearest valid global batches: \[16, 8\]"):
        driver.search(workload=wl, cluster=cl, global_batch=13, estimate=est, config_type=ToyConfig,
                      fix={"tp": 1, "pp": 1, "cp": 1})


def test_expired_time_limit_returns_best_so_far_marked_feasible():
    wl, cl, est = _toy_setup()
    full = driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig)
    cut = driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig, time_limit_s=0)
    assert full.status == "optimal" and cut.status == "feasible"
    assert cut.best.fits and cut.candidates_explored < full.candidates_explored
    assert cut.best.step_time_s >= full.best.step_time_s
    assert cut.bound_s <= full.best.step_time_s <= cut.best.step_time_s


def test_search_is_deterministic():
    wl, cl, est = _toy_setup()
    runs = [driver.search(workload=wl, cluster=cl, global_batch=16, estimate=est, config_type=ToyConfig)
            for _ in range(2)]
    a, b = runs
    assert a.best.key() == b.best.key()
    assert [c.key() for c in a.alternatives] == [c.key() for c in b.alternatives]
    # The memory-tight toy needs ZeRO-3, which leaves 2 fitting runner-ups once zero-bubble runs without FSDP.
    assert len(a.alternatives) == 2 and all(c.step_time_s >= a.best.step_time_s for c in a.alternatives)


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
    assert any(s.pp == 3 for s in sp.enumerate_structures(dims=dims, num_devices=24, gpus_per_node=8,
                                                          global_batch=24, options=opts))  # uneven: 10 layers / 3
    assert sp.nearest_valid_batches(global_batch=1000, dps=[64, 48]) == [1008, 1024, 960]


# --- under the real step model (costmodel.step) -------------------------------------------------------------


def _real():
    from costmodel import step
    from costmodel.analytic import gpt_workload

    return step, gpt_workload


@pytest.mark.parametrize("node,layers,hidden,heads,zeros", [
    ("dgx-a100-80gb", 4, 6144, 48, (0, 1, 2, 3)),  # memory binds: ZeRO wins
    ("pcie-8xa100", 6, 12288, 96, (0,)),  # slow tp links, no ZeRO: a pipeline wins
])
def test_search_equals_brute_force_under_the_step_model(node, layers, hidden, heads, zeros):
    step, gpt_workload = _real()
    wl = gpt_workload(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048, name="gpt-small")
    cl = make_cluster(node, 1, gpus_per_node=4)
    ref = brute_force(wl, cl, 8, step.estimate_step, max_mb=4, max_v=2, config_type=None, zeros=zeros)
    opts = sp.SearchOptions(dp_margin=math.inf, dp_top_k=10**6, exhaustive_cuts=10**6, max_microbatch=4,
                            max_virtual_stages=2, min_tokens_per_cp_rank=1, zero_stages=zeros)
    res = driver.search(workload=wl, cluster=cl, global_batch=8, options=opts)
    assert ref is not None and res.best.fits
    assert res.best.step_time_s == pytest.approx(ref[0], rel=1e-9), (res.best.summary(), ref)
    if node.startswith("pcie"):
        assert res.best.structure.pp > 1


@pytest.mark.parametrize("exhaustive_cuts", [0, 10**6])
def test_search_equals_brute_force_on_a_heterogeneous_cluster(exhaustive_cuts):
    """One 4-GPU A100 node and one 4-GPU H100 node: the search (its bounds, knob ladders and the stage DPs, or
    every cut) equals every configuration and cut in which no pipeline rank straddles the two nodes."""
    step, gpt_workload = _real()
    from costmodel.hardware import Cluster

    wl = gpt_workload(layers=4, hidden=2048, heads=16, vocab=51200, seq=2048, name="gpt-small")
    a, h = (make_cluster(n, 1, gpus_per_node=4) for n in ("dgx-a100-80gb", "dgx-h100"))
    cl = Cluster(name="a100+h100", groups=(a.groups[0], h.groups[0]))
    ref = brute_force(wl, cl, 8, step.estimate_step, max_mb=2, max_v=2, config_type=None, zeros=(0,),
                      pp_ok=lambda pp: 4 % (8 // pp) == 0)
    opts = sp.SearchOptions(dp_margin=math.inf, dp_top_k=10**6, exhaustive_cuts=exhaustive_cuts, max_microbatch=2,
                            max_virtual_stages=2, min_tokens_per_cp_rank=1, zero_stages=(0,))
    res = driver.search(workload=wl, cluster=cl, global_batch=8, options=opts)
    assert ref is not None and res.best.fits and res.status == "optimal"
    assert res.best.step_time_s == pytest.approx(ref[0], rel=1e-9), (res.best.summary(), ref)
    assert res.best.structure.pp > 1


@pytest.mark.parametrize("layers,hidden,heads", [(8, 4096, 32), (36, 12288, 96)])
def test_dominance_rules_hold_for_the_step_model(layers, hidden, heads):
    """What the pruning in space/driver assumes of the step model: recomputation never saves time; ZeRO-2 is
    neither slower nor larger than ZeRO-1; ZeRO
    above 0 never helps with one dp x cp rank; the model-state memory bound is below every estimate; layer
    times summed over pipeline ranks do not depend on pp, dp, the schedule or the cuts."""
    step, gpt_workload = _real()
    wl = gpt_workload(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048)
    cl = make_cluster("dgx-a100-80gb", 2)
    dims = sp.ModelDimsLite(heads=heads, kv_heads=heads, layers=layers, seq=2048)
    structs = sp.enumerate_structures(dims=dims, num_devices=16, gpus_per_node=8, global_batch=32,
                                      options=sp.SearchOptions())
    checked, sums, lean_cases = 0, {}, 0
    search_ctx = driver._Ctx(workload=wl, cluster=cl, global_batch=32, estimate=step.estimate_step,
                             options=sp.SearchOptions(), fix={}, deadline=None, progress=None)
    for s in structs[::5]:
        cuts = driver.even_split([l.kind for l in wl.layers], s.pp * s.virtual_stages)
        est = {}
        for r, z, spar in itertools.product(sp.RECOMPUTE_ORDER, (0, 1, 2, 3), (False, True)):
            if spar and s.tp == 1:
                continue
            cfg = driver.make_config(s, sp.Knobs(recompute=r, zero_stage=z, sequence_parallel=spar), global_batch=32)
            est[r, z, spar] = step.estimate_step(wl, cfg, cl, stage_layers=cuts)
        for (r, z, spar), e in est.items():
            for r2 in sp.RECOMPUTE_ORDER[sp.RECOMPUTE_ORDER.index(r) + 1:]:
                assert est[r2, z, spar].step_time_s >= e.step_time_s * (1 - 1e-9)
        on = s.tp > 1
        for r in sp.RECOMPUTE_ORDER:
            z1, z2 = est[r, 1, on], est[r, 2, on]
            assert z2.step_time_s <= z1.step_time_s * (1 + 1e-9)
            assert z2.memory_gb_per_device <= z1.memory_gb_per_device * (1 + 1e-9)
        for z in (0, 1, 2, 3):  # the model-state bound the driver skips ZeRO stages by
            bound = search_ctx.states_lower_bound_gb(s, z)
            assert all(est[r, z, spar].memory_gb_per_device >= bound * (1 - 1e-9) for r in sp.RECOMPUTE_ORDER
                       for spar in ((False, True) if s.tp > 1 else (False,)))
            lean_cases += bound > search_ctx.memory_limit_gb
        if s.dp * s.cp == 1:  # ZeRO-0 is all that is enumerated then
            assert all(est[r, 0, on].step_time_s <= est[r, z, on].step_time_s * (1 + 1e-9) for r in sp.RECOMPUTE_ORDER
                       for z in (1, 2, 3))
        total = sum(est["none", 0, False].stage_time_s)
        assert sums.setdefault((s.tp, s.cp, s.microbatch), total) == pytest.approx(total, rel=1e-9)
        checked += 1
    assert checked > 10
    if hidden == 12288:
        assert lean_cases > 0  # the big model must exercise the model-state bound


@pytest.mark.parametrize("case_id", ["megatron-sc21-t1-1.7b", "megatron-sc21-t1-39.1b",
                                     "megatron-sc21-t2-175b-zero3-768",
                                     pytest.param("megatron-sc21-t1-1008.0b", marks=pytest.mark.slow),
                                     pytest.param("megatron-sc21-t2-530b-ptdp-560", marks=pytest.mark.slow)])
def test_plan_beats_published_megatron_config(case_id):
    """Same cost model for both: the plan predicts at least the published configuration's throughput, and fits."""
    step, gpt_workload = _real()
    from benchmarks.plan_quality import load_cases, published_config

    case = next(c for c in load_cases() if c.id == case_id)
    wl = gpt_workload(**case.dims, vocab=51200, seq=2048, ffn_hidden=4 * case.dims["hidden"], name=case_id)
    cl = make_cluster("dgx-a100-80gb", case.gpus // 8)
    cfg = published_config(case)
    pub = step.estimate_step(wl, cfg, cl)
    res = driver.search(workload=wl, cluster=cl, global_batch=cfg.global_batch)
    assert res.best.fits
    assert res.best.estimate.tokens_per_s >= pub.tokens_per_s * (1 - 1e-9), (res.best.summary(), pub.step_time_s)


def test_plan_model_time_limit_and_byte_identical_json():
    step, gpt_workload = _real()
    from planner.plan import ModelInfo
    from planner.search.driver import plan_model

    wl = gpt_workload(layers=24, hidden=4096, heads=32, name="gpt-24x4096")
    info = ModelInfo(name=wl.name, fingerprint="sha256:test", params=wl.params, flops_per_step=0.0,
                     num_layers=24, seq_len=2048)
    cl = make_cluster("dgx-a100-80gb", 4)
    full = plan_model((wl, info), cl, global_batch=256, record_timings=False)
    again = plan_model((wl, info), cl, global_batch=256, record_timings=False)
    assert full.to_json() == again.to_json()
    assert full.solver.status == "optimal" and full.solver.gap == 0.0 and len(full.alternatives) == 5
    cut = plan_model((wl, info), cl, global_batch=256, time_limit_s=0.0)
    assert cut.solver.status == "feasible" and cut.prediction.fits
    assert cut.solver.candidates_explored < full.solver.candidates_explored
    assert cut.solver.bound <= full.prediction.step_time_s <= cut.prediction.step_time_s
    assert cut.solver.gap > 0


def test_stage_dp_moves_layers_off_the_heavy_head_stage():
    """Llama-3-8B-like: the 128k-vocabulary head costs about two layers, so with a 1F1B pipeline the stage DP
    gives the last stage fewer layers, and the step model prices that faster than the even split."""
    step, _ = _real()
    from costmodel.analytic import llama_workload

    wl = llama_workload(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256, seq=8192)
    cl = make_cluster("dgx-a100-80gb", 2)
    res = driver.search(workload=wl, cluster=cl, global_batch=64, fix="schedule=1f1b,pp=4,tp=1,cp=4")
    best = res.best
    assert best.uneven and best.stage_layers[-1] < best.stage_layers[1]
    even = step.estimate_step(wl, driver.make_config(best.structure, best.knobs, global_batch=64), cl,
                              stage_layers=driver.even_split([l.kind for l in wl.layers], 4))
    assert best.step_time_s < even.step_time_s


def test_sequence_parallel_only_where_the_blocks_can_execute_it():
    """GPT-2's Conv1D layers stay replicated, so no tp admits sequence parallelism: the search must not pick it
    (it used to, and the plan then failed in the per-block ILP)."""
    from costmodel.profiles import make_cluster
    from planner.search import model_input
    from planner.search.driver import plan_model

    cluster = make_cluster("dgx-h100", 1)
    loaded = model_input.load("gpt2", seq=None, global_batch=8)
    assert model_input.sequence_parallel_tps(loaded, cluster=cluster, max_tp=8) == frozenset()
    plan = plan_model("gpt2", cluster, global_batch=8, fix={"tp": 2})
    assert plan.degrees.tp == 2 and not plan.sequence_parallel


def test_infeasible_error_carries_the_memory_needed():
    from costmodel.errors import InfeasiblePlanError
    from costmodel.profiles import make_cluster
    from planner.search.driver import plan_model

    with pytest.raises(InfeasiblePlanError, match="needs at least") as info:
        plan_model("gpt3-175b", make_cluster("dgx-a100-80gb", 1, gpus_per_node=1), global_batch=8)
    assert info.value.memory_gb_needed > 80
    assert f"{info.value.memory_gb_needed:.1f} GB per device" in str(info.value)


def test_plans_stay_within_what_the_runtime_executes():
    """Two combinations the runtime refuses: zero-bubble with FSDP (ZeRO > 0), and a tied embedding / LM head
    split differently."""
    from costmodel.profiles import resolve_cluster
    from planner.search import space
    from planner.search.driver import plan_model

    zb = space.Structure(tp=1, cp=1, ep=1, pp=2, dp=2, microbatch=1, schedule="zero-bubble", virtual_stages=1,
                         num_microbatches=4)
    assert {k.zero_stage for k in space.knob_choices(zb, options=space.SearchOptions())} == {0}
    plan = plan_model("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32", resolve_cluster("local", nodes=1, gpus_per_node=2),
                      global_batch=4, fix={"tp": 2})
    styles = {s.fqn: s.style for s in plan.shardings}
    assert styles["lm_head"] == "vocab_head"
    assert styles["model.decoder.embed_tokens"] == "vocab_embedding"
    assert styles["model.decoder.embed_positions"] == "replicate"


def test_moe_models_are_never_priced_with_selective_recompute():
    """The runtime's selective checkpointing fails on MoE routers: the search must not even price it there
    (dense models still get it), unless the user pins it with --fix."""
    from costmodel.analytic import llama_workload
    from costmodel.step import estimate_step

    def recompute_priced(workload, fix=None):
        seen = set()

        def recording(w, cfg, cluster, **kw):
            seen.add(cfg.recompute)
            return estimate_step(w, cfg, cluster, **kw)

        driver.search(workload=workload, cluster=make_cluster("dgx-a100-80gb", 1), global_batch=16,
                      estimate=recording, fix=fix)
        return seen

    dims = dict(layers=4, hidden=1024, ffn_hidden=2048, heads=16, kv_heads=8, vocab=32000, seq=2048)
    assert "selective" in recompute_priced(llama_workload(**dims))
    assert "selective" not in recompute_priced(llama_workload(**dims, experts=8, topk=2))
    assert recompute_priced(llama_workload(**dims, experts=8, topk=2), fix="recompute=selective") == {"selective"}
