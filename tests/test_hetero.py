"""Heterogeneous clusters: each pipeline rank priced on its own node group; cuts balance the groups' speeds.

Also the uneven cuts of interleaved 1F1B and zero-bubble pipelines (``planner.search.cuts``) against brute
force over every cut under the step model."""

import itertools
import sys
from pathlib import Path

import pytest

from costmodel.analytic import gpt_workload, llama_workload
from costmodel.hardware import Cluster
from costmodel.profiles import make_cluster
from costmodel.step import ParallelConfig, estimate_step
from planner.search import driver
from planner.search import space as sp

sys.path.insert(0, str(Path(__file__).parent))


def _two_groups(first: str, second: str, gpus_per_node: int = 4) -> Cluster:
    a = make_cluster(first, 1, gpus_per_node=gpus_per_node)
    b = make_cluster(second, 1, gpus_per_node=gpus_per_node)
    return Cluster(name=f"{first}+{second}", groups=(a.groups[0], b.groups[0]))


@pytest.fixture(scope="module")
def small_gpt():
    return gpt_workload(layers=8, hidden=2048, heads=16, vocab=51200, seq=2048, name="gpt-small")


def _brute_force_cuts(wl, cfg, cluster, chunks, *, transformer_in_every_chunk=False):
    kinds = [layer.kind for layer in wl.layers]
    n, best = len(kinds), None
    for inner in itertools.combinations(range(1, n), chunks - 1):
        bounds = (0, *inner, n)
        if transformer_in_every_chunk and not all(
                "transformer" in kinds[bounds[c] : bounds[c + 1]] for c in range(chunks)):
            continue
        cuts = tuple(bounds[c + 1] - bounds[c] for c in range(chunks))
        est = estimate_step(wl, cfg, cluster, stage_layers=cuts)
        if est.fits and (best is None or est.step_time_s < best[0]):
            best = (est.step_time_s, cuts)
    return best


def test_step_prices_a_stage_on_h100_faster_than_the_same_stage_on_a100(small_gpt):
    """The same chunk costs less on the H100 group, and each rank of a mixed cluster costs exactly what it
    costs on a cluster of its own group's nodes (its accelerator, its NVLink)."""
    cfg = ParallelConfig(tp=2, pp=2, dp=2, microbatch=1, global_batch=16, schedule="1f1b", recompute="none")
    cuts = (5, 5)
    a_first = estimate_step(small_gpt, cfg, _two_groups("dgx-a100-80gb", "dgx-h100"), stage_layers=cuts)
    h_first = estimate_step(small_gpt, cfg, _two_groups("dgx-h100", "dgx-a100-80gb"), stage_layers=cuts)
    assert a_first.stage_device == ("A100-SXM4-80GB", "H100-SXM5-80GB")
    assert h_first.stage_device == ("H100-SXM5-80GB", "A100-SXM4-80GB")
    for r in range(2):
        on_a, on_h = (a_first, h_first) if r == 0 else (h_first, a_first)
        assert on_h.stage_time_s[r] < 0.6 * on_a.stage_time_s[r]
    for node, est, r in (("dgx-a100-80gb", a_first, 0), ("dgx-h100", a_first, 1)):
        alone = estimate_step(small_gpt, cfg, make_cluster(node, 2, gpus_per_node=4), stage_layers=cuts)
        assert est.stage_time_s[r] == pytest.approx(alone.stage_time_s[r], rel=1e-12)
    # the old pricing put both ranks on the A100: the mixed cluster is faster than two A100 nodes
    slow = estimate_step(small_gpt, cfg, make_cluster("dgx-a100-80gb", 2, gpus_per_node=4), stage_layers=cuts)
    assert a_first.step_time_s < slow.step_time_s
    cl = _two_groups("dgx-a100-80gb", "dgx-h100")
    peak = 4 * sum(g.node.gpu.tflops("bf16") for g in cl.groups) * 1e12  # MFU over both groups' peaks
    assert a_first.mfu * peak == pytest.approx(a_first.model_tflops_per_gpu * 8e12, rel=1e-12)


def test_memory_is_checked_against_each_ranks_own_gpu():
    """A100 40 GB then H100 80 GB: a cut that puts the heavy rank on the H100 fits, the mirror cut does not,
    though both use the same largest memory per device."""
    wl = gpt_workload(layers=8, hidden=4096, heads=32, vocab=51200, seq=2048, name="gpt-mid")
    cl = _two_groups("dgx-a100-40gb", "dgx-h100")
    cfg = ParallelConfig(tp=4, pp=2, dp=1, microbatch=8, global_batch=64, schedule="gpipe", recompute="none")
    light_first = estimate_step(wl, cfg, cl, stage_layers=(2, 8))
    heavy_first = estimate_step(wl, cfg, cl, stage_layers=(8, 2))
    a100, h100 = (g.node.gpu.memory_bytes / 1e9 for g in cl.groups)  # what PyTorch can allocate on each
    assert light_first.stage_memory_limit_gb == (a100, h100) and light_first.memory_limit_gb == a100
    assert a100 < light_first.memory_gb_per_device <= h100
    assert light_first.fits and not heavy_first.fits
    over = estimate_step(wl, cfg, cl, stage_layers=(6, 4))
    assert not over.fits and a100 < over.stage_memory_gb[0] < h100  # over the A100's memory, the H100 had room
    assert max(heavy_first.stage_memory_gb) == pytest.approx(max(light_first.stage_memory_gb), rel=0.05)


@pytest.mark.parametrize("schedule,v,pp", [
    ("1f1b", 1, 2), ("gpipe", 1, 2), ("1f1b", 1, 4), ("interleaved-1f1b", 2, 2), ("zero-bubble", 1, 2),
])
def test_cut_gives_the_faster_group_more_layers_and_equals_brute_force(small_gpt, schedule, v, pp):
    cl = _two_groups("dgx-a100-80gb", "dgx-h100")
    fix = f"schedule={schedule},v={v},pp={pp},tp={4 // pp},mb=1,recompute=none,zero=0,sp=false"
    res = driver.search(workload=small_gpt, cluster=cl, global_batch=16, fix=fix)
    best = res.best
    assert best.uneven
    ranks = [0] * pp
    kinds = [layer.kind for layer in small_gpt.layers]
    start = 0
    for c, n in enumerate(best.stage_layers):
        ranks[c % pp] += sum(k == "transformer" for k in kinds[start : start + n])
        start += n
    half = pp // 2  # ranks 0 .. half-1 on the A100 node, the others on the H100 node
    assert min(ranks[half:]) > max(ranks[:half]), (best.stage_layers, ranks)
    cfg = driver.make_config(best.structure, best.knobs, global_batch=16)
    ref = _brute_force_cuts(small_gpt, cfg, cl, pp * v)
    assert best.step_time_s == pytest.approx(ref[0], rel=1e-9), (best.stage_layers, ref)
    even = estimate_step(small_gpt, cfg, cl, stage_layers=driver.even_split(kinds, pp * v))
    assert best.step_time_s < 0.85 * even.step_time_s


def test_hetero_plan_beats_slowest_gpu_pricing():
    """Llama-3-8B on 4 DGX-A100 + 2 DGX-H100 (the profiles' hetero cluster): the H100 pipeline rank gets more
    layers than the A100 ranks, and the plan is faster than the best plan on 6 DGX-A100 nodes (which is what
    pricing every stage on the slowest GPU amounted to)."""
    from costmodel.profiles import PROFILES_DIR, load_cluster_file

    wl = llama_workload(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256, seq=8192)
    hetero = load_cluster_file(PROFILES_DIR / "clusters" / "hetero-a100-h100.toml")
    res = driver.search(workload=wl, cluster=hetero, global_batch=64, fix="pp=3")
    best = res.best
    assert best.estimate.stage_device[-1] == "H100-SXM5-80GB"
    assert best.stage_layers[-1] > max(best.stage_layers[:-1])
    slow = driver.search(workload=wl, cluster=make_cluster("dgx-a100-80gb", 6), global_batch=64, fix="pp=3")
    assert best.step_time_s < 0.8 * slow.best.step_time_s


@pytest.mark.parametrize("schedule,v", [("interleaved-1f1b", 2), ("zero-bubble", 1), ("zero-bubble", 2)])
def test_interleaved_and_zero_bubble_cuts_equal_brute_force(schedule, v):
    """A heavy 128k-vocabulary head on a small model: the refined cut beats the even one and equals the best
    of every cut (the head may take a chunk of its own) under the step model."""
    wl = llama_workload(layers=8, hidden=1024, heads=16, kv_heads=4, ffn_hidden=3584, vocab=128256, seq=2048)
    cl = make_cluster("dgx-a100-80gb", 1, gpus_per_node=4)
    fix = f"schedule={schedule},v={v},pp=2,tp=2,dp=1,mb=2,recompute=none,zero=0,sp=false"
    opts = sp.SearchOptions()
    best = driver.search(workload=wl, cluster=cl, global_batch=16, fix=fix, options=opts).best
    cfg = driver.make_config(best.structure, best.knobs, global_batch=16)
    ref = _brute_force_cuts(wl, cfg, cl, 2 * v)
    assert best.uneven and best.step_time_s == pytest.approx(ref[0], rel=1e-9), (best.stage_layers, ref)
    kinds = [layer.kind for layer in wl.layers]
    even = estimate_step(wl, cfg, cl, stage_layers=driver.even_split(kinds, 2 * v))
    assert best.step_time_s < 0.9 * even.step_time_s


def test_plan_file_stage_gpu_is_the_priced_accelerator_and_is_checked_on_load(small_gpt):
    """The plan's per-chunk ``gpu`` is the accelerator its rank was priced on; a plan file naming a GPU the
    cluster lacks, or two GPUs for one pipeline rank's chunks, is refused on load."""
    import dataclasses

    from _plans import make_plan
    from costmodel.errors import PlanMismatchError
    from planner.plan import Plan
    from planner.search.assemble import stage_plans

    cl = _two_groups("dgx-a100-80gb", "dgx-h100")
    res = driver.search(workload=small_gpt, cluster=cl, global_batch=16, fix="schedule=interleaved-1f1b,v=2,pp=2,tp=2")
    stages = stage_plans(workload=small_gpt, cluster=cl, candidate=res.best)
    assert [st.gpu for st in stages] == ["A100-SXM4-80GB", "H100-SXM5-80GB"] * 2
    plan = make_plan(pp=2, tp=2, dp=2, gpu="A100-SXM4-80GB+H100-SXM5-80GB")
    good = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, gpu=("A100-SXM4-80GB", "H100-SXM5-80GB")[st.pp_rank]) for st in plan.stages))
    assert Plan.from_dict(good.to_dict()) == good
    unknown = dataclasses.replace(good, stages=(dataclasses.replace(good.stages[0], gpu="B200-SXM-180GB"),
                                                *good.stages[1:]))
    with pytest.raises(PlanMismatchError, match="not in the cluster's accelerators"):
        Plan.from_dict(unknown.to_dict())
    v2 = make_plan(pp=2, tp=2, dp=2, virtual_stages=2, gpu="A100-SXM4-80GB+H100-SXM5-80GB")
    split = dataclasses.replace(v2, stages=tuple(
        dataclasses.replace(st, gpu=("A100-SXM4-80GB", "H100-SXM5-80GB")[st.index // 2]) for st in v2.stages))
    with pytest.raises(PlanMismatchError, match="a rank's chunks share its devices"):
        Plan.from_dict(split.to_dict())
