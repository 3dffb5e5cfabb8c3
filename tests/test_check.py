"""``autopar check``: a small tp2 x pp2 x dp2 plan measured on fake tensors under the fake process group (world 8):
every category has bytes, the parameters are exactly this rank's local shards; the CLI's JSON and exit codes;
bad plan files; which ranks are distinct; ``validate``'s live-byte peak on 2 ranks."""

from __future__ import annotations

import contextlib
import functools
import json

import pytest

SMALL = "llama:layers=4,hidden=512,ffn=1408,heads=8,kv_heads=8,vocab=8192,seq=256"


@functools.lru_cache(maxsize=None)
def _plan(fix: str, gpus: int = 8, batch: int = 8):
    from costmodel.profiles import make_cluster
    from planner.search.driver import plan_model

    return plan_model(SMALL, make_cluster("local", 1, gpus_per_node=gpus), global_batch=batch, fix=fix)


def _in_child(fn, *args):
    """Run ``fn(*args)`` in a fresh spawned process (check_rank makes the default process group)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=300)


def _factory(plan):
    from cli.commands.validate import build_model_for

    return functools.partial(build_model_for, plan.model.name, plan.global_batch, plan.model.seq_len)


def _check_rank(plan, rank):
    from runtime.measure.memcheck import check_rank

    return check_rank(plan, rank, model_factory=_factory(plan))


@functools.lru_cache(maxsize=None)
def _measured_rank0():
    return _in_child(_check_rank, _plan("tp=2,pp=2,dp=2,schedule=1f1b,zero=2"), 0)


@pytest.mark.planner
def test_check_rank_measures_each_category_and_exact_parameter_shards():
    from runtime.measure.memcheck import rank_coords

    plan = _plan("tp=2,pp=2,dp=2,schedule=1f1b,zero=2")
    assert (plan.degrees.tp, plan.degrees.pp, plan.degrees.dp) == (2, 2, 2)
    m = _measured_rank0()
    assert m.coords == rank_coords(plan, 0) == {"pp": 0, "dp": 0, "ep": 0, "cp": 0, "tp": 0}
    for cat in ("parameters", "gradients", "optimizer", "activations", "temporaries", "comm_buffers"):
        assert m.measured[cat] > 0, (cat, m.measured)
    assert sum(m.measured.values()) == m.measured_peak
    # the parameters counted are exactly the storages of this rank's local shards
    assert m.measured["parameters"] == m.local_param_bytes
    # which hold every local element (FSDP2 pads a shard by less than one row per parameter)
    assert m.local_param_numel_bytes <= m.local_param_bytes < 1.01 * m.local_param_numel_bytes
    # ZeRO-2 over dp=2 and tp=2: the stage's fp32 parameters over 4, Adam's two moments twice that
    assert m.measured["optimizer"] == pytest.approx(2 * m.local_param_bytes, rel=0.01)
    assert m.predicted is not None and m.predicted_total == pytest.approx(plan.stages[0].predicted_memory_gb * 1e9)
    assert not m.exceeds


@pytest.mark.planner
def test_last_stage_runs_the_loss_over_vocabulary_shards():
    """tp2 x pp2: the last stage's head leaves the logits vocabulary-sharded and the loss runs loss-parallel, as
    the plan prices it (runtime/pipeline.py); with the logits gathered the rank measured 0.123 GB against 0.099
    predicted (-19.7%), now 0.110 against 0.100 (-9.6%)."""
    from runtime.measure.memcheck import distinct_ranks

    plan = _plan("tp=2,pp=2,dp=2,schedule=1f1b,zero=2")
    m = _in_child(_check_rank, plan, distinct_ranks(plan, "last")[0])
    assert m.coords["pp"] == 1
    tensors = m.predicted_total - m.predicted_reserve
    assert m.measured_peak == pytest.approx(tensors, rel=0.12), (m.measured_peak, tensors, m.measured)


def _local_param_bytes_by_hand(plan, rank):
    """The local shard bytes of ``rank`` from the plan's degrees alone: the stage's parameters / tp / dp."""
    from planner.models import build_model
    from runtime.pipeline import cut_model

    model = build_model(SMALL, batch=8, seq=256, device="meta").model
    chunk = cut_model(model, plan=plan)[plan.stages[0].index]
    return sum(p.numel() * p.element_size() for p in chunk.parameters())


@pytest.mark.planner
def test_parameters_match_the_stage_over_tp_and_dp():
    plan = _plan("tp=2,pp=2,dp=2,schedule=1f1b,zero=2")
    m = _measured_rank0()
    whole = _local_param_bytes_by_hand(plan, 0)
    # every parameter of the first stage is split over tp (Megatron layout) or not (norms), then over dp
    assert whole / 4 <= m.local_param_numel_bytes <= whole / 2


class _Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(*argv):
    """``autopar ARGV`` in this process (the ranks still run in spawned children): exit code, stdout, stderr."""
    import contextlib
    import io

    from cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return _Result(code, out.getvalue(), err.getvalue())


@pytest.mark.planner
def test_cli_json_and_exit_code(tmp_path):
    from planner.plan import save_plan

    path = tmp_path / "plan.json"
    save_plan(_plan("tp=2,pp=2,dp=2,schedule=1f1b,zero=2"), path)
    r = _cli("check", str(path), "--ranks", "last", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    [rank] = data["ranks"]
    assert rank["rank"] == 4 and rank["coords"]["pp"] == 1 and rank["exceeds_capacity"] is False
    assert rank["measured_peak_bytes"] == sum(rank["measured_bytes"].values()) > 0
    assert rank["error"] == pytest.approx((rank["predicted_tensor_bytes"] - rank["measured_peak_bytes"])
                                          / rank["measured_peak_bytes"])
    assert "tensors" in r.stderr and "fits" in r.stderr  # the table goes to stderr with --json


@pytest.mark.planner
def test_cli_exits_1_when_a_rank_does_not_fit(monkeypatch, capsys, tmp_path):
    """A rank whose measured peak plus the allocator reserve is above its device: exit 1 and the rank named."""
    import argparse
    import dataclasses

    import runtime.measure.memcheck as mc
    from cli.commands import check as cmd
    from planner.plan import save_plan

    path = tmp_path / "plan.json"
    save_plan(_plan("tp=2,pp=2,dp=2,schedule=1f1b,zero=2"), path)
    m = mc.RankMemory(rank=0, coords={"pp": 0, "dp": 0, "ep": 0, "cp": 0, "tp": 0}, measured_peak=int(2e9),
                      measured={c: 0 for c in mc.CATEGORIES} | {"activations": int(2e9)}, peak_where="forward 0F1",
                      local_param_bytes=0, local_param_numel_bytes=0, predicted_total=1.5e9, predicted_reserve=0.0,
                      predicted=None, capacity=3e9, reserve_for_measured=0.5e9, seconds=1.0)
    assert not m.exceeds and m.error == pytest.approx(-0.25)
    full = dataclasses.replace(m, capacity=m.measured_peak + m.reserve_for_measured - 1)
    assert full.exceeds
    def fake_check_plan(plan, *, progress=None, **kw):
        if progress is not None:
            progress(full)
        return [full]

    monkeypatch.setattr(mc, "check_plan", fake_check_plan)
    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    assert cmd.run(p.parse_args([str(path), "--ranks", "0"])) == 1
    out = capsys.readouterr().out
    assert "EXCEEDS its device" in out and "ranks [0] exceed their device" in out


@pytest.mark.planner
def test_unknown_device_is_an_error_before_measuring(tmp_path):
    import dataclasses

    from planner.plan import save_plan

    plan = _plan("tp=2,pp=2,dp=2,schedule=1f1b,zero=2")
    odd = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, gpu="tiny-test-gpu") for s in plan.stages))
    path = tmp_path / "plan.json"
    save_plan(odd, path)
    r = _cli("check", str(path), "--ranks", "0")
    assert r.returncode == 2 and "tiny-test-gpu" in r.stderr and "measured" not in r.stderr


def test_bad_plan_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = _cli("check", str(bad))
    assert r.returncode == 2 and "not valid JSON" in r.stderr and "autopar plan --out" in r.stderr
    r = _cli("check", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "cannot read plan file" in r.stderr


@pytest.mark.planner
def test_distinct_ranks():
    from costmodel.errors import ConfigError
    from runtime.measure.memcheck import distinct_ranks, rank_coords, rank_of

    plan = _plan("tp=2,pp=2,dp=2,schedule=1f1b,zero=2")
    assert distinct_ranks(plan, "first,middle,last") == [0, 4]
    assert distinct_ranks(plan, "all-distinct") == list(range(8))  # every tp / dp corner of each stage
    assert distinct_ranks(plan, "3,1") == [1, 3]
    for r in range(8):
        assert rank_of(plan, rank_coords(plan, r)) == r
    assert rank_coords(plan, 5) == {"pp": 1, "dp": 0, "ep": 0, "cp": 0, "tp": 1}
    with pytest.raises(ConfigError, match="outside the plan's world of 8"):
        distinct_ranks(plan, "8")
    with pytest.raises(ConfigError, match="not one of first, middle, last"):
        distinct_ranks(plan, "top")


def _tiny_opt():
    from runtime_cases import opt_model

    return opt_model()


@pytest.mark.distributed
@pytest.mark.slow  # spawns 2 ranks that import transformers: 20-50 s on 2 shared cores
def test_validate_reports_live_peak_on_two_ranks():
    from runtime.manual_plan import manual_plan
    from runtime.measure.validate import measure_plan

    plan = manual_plan(_tiny_opt(), dp=2, microbatch_size=1, num_microbatches=1, seq_len=8)
    got = measure_plan(plan, model_factory=functools.partial(_tiny_opt), steps=1, warmup=0, compute_dtype="fp32")
    model = _tiny_opt()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in got:
        # DDP: every rank holds the whole model, and Adam's two fp32 moments of it at the second step's peak
        assert m.live_bytes["parameters"] == param_bytes
        assert m.live_bytes["optimizer"] >= 2 * param_bytes
        assert m.peak_live_bytes == sum(m.live_bytes.values()) > 3 * param_bytes
        assert m.peak_live_where.startswith("step 1")


@pytest.mark.planner
@pytest.mark.slow  # four ranks measured, each in a fresh process
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_replaying_some_microbatches_gives_the_peak_of_all(schedule):
    """The ``auto`` shortcut (warm-up, steady rounds, cool-down; receive buffers for all) against every
    micro-batch of a 16-micro-batch pp2 plan, on both pipeline ranks."""
    from runtime.measure.memcheck import check_plan, replayed_microbatches

    extra = ",v=2" if schedule != "1f1b" else ""
    plan = _plan(f"pp=2,dp=1,tp=1,mb=1,schedule={schedule}{extra},zero=0", gpus=2, batch=16)
    assert plan.schedule.num_microbatches == 16 and replayed_microbatches(plan) < 16
    some = check_plan(plan, model_factory=_factory(plan), ranks="0,1", microbatches="auto")
    every = check_plan(plan, model_factory=_factory(plan), ranks="0,1", microbatches="all")
    for a, b in zip(some, every):
        assert "replayed" in " ".join(a.notes) and not b.notes
        # the last stage keeps one 0-d loss per micro-batch replayed: a few bytes apart at most
        assert abs(a.measured_peak - b.measured_peak) <= 16 * 8, (a.measured, b.measured)


def test_replayed_microbatches_choices():
    import dataclasses

    from costmodel.errors import ConfigError
    from runtime.measure.memcheck import replayed_microbatches

    plan = _plan("pp=2,dp=1,tp=1,mb=1,schedule=1f1b,zero=0", gpus=2, batch=16)
    assert replayed_microbatches(plan, "all") == 16 and replayed_microbatches(plan) == 4
    # 1F1B: the rank's warm-up (pp - pp_rank forwards) and two steady micro-batches
    assert replayed_microbatches(plan, pp_rank=0) == 4 and replayed_microbatches(plan, pp_rank=1) == 3
    assert replayed_microbatches(plan, 5) == 6 and replayed_microbatches(plan, 1) == 2  # whole rounds, >= pp
    gpipe = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, name="gpipe"))
    assert replayed_microbatches(gpipe) == 16  # every forward is in flight before the first backward
    with pytest.raises(ConfigError, match="give auto, all or a number"):
        replayed_microbatches(plan, "most")


def test_check_builds_no_causal_mask_where_the_runtime_builds_none():
    """transformers cannot read fake position ids, assumes packed sequences and builds a (B, 1, T, T) mask per
    call; on the runtime's real ``arange`` position ids it builds none (SDPA's ``is_causal``): check matches."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.masking_utils import create_causal_mask

    from cli.commands.validate import build_model_for
    from runtime.measure.memcheck import _no_packed_sequences

    config = build_model_for(SMALL, 2, 256).config
    assert config._attn_implementation == "sdpa"

    def mask(fake: bool):
        with FakeTensorMode() if fake else contextlib.nullcontext():
            return create_causal_mask(config=config, inputs_embeds=torch.zeros(2, 256, 8), attention_mask=None,
                                      cache=None, position_ids=torch.arange(256).unsqueeze(0))

    assert mask(fake=False) is None  # what the runtime runs
    assert mask(fake=True) is not None  # what check replayed before
    with _no_packed_sequences():
        assert mask(fake=True) is None


@pytest.mark.planner
def test_stacked_experts_shard_in_whole_rows():
    """transformers' Mixtral stores each expert projection as one (experts, ...) parameter; FSDP2 shards it along
    the experts in whole rows, so with 4 experts over 8 ranks rank 0 holds one expert (1/4, not 1/8): the
    prediction (``costmodel.step.expert_shard_degree``) holds what check measures."""
    from costmodel.profiles import make_cluster
    from planner.search.driver import plan_model

    moe = "mixtral:layers=2,hidden=256,ffn=704,heads=4,kv_heads=4,vocab=1024,seq=128,experts=4,topk=2"
    plan = plan_model(moe, make_cluster("local", 1, gpus_per_node=8), global_batch=8, fix="dp=8,zero=3,tp=1,pp=1")
    m = _in_child(_check_rank, plan, 0)
    for cat in ("parameters", "optimizer"):
        assert m.predicted[cat] == pytest.approx(m.measured[cat], rel=0.001), cat
