"""``autopar validate``: a measured 2-rank run of a hand-made plan (numbers come from the run, not the plan), the
table's arithmetic, and bad input (typed errors, exit 1)."""

from __future__ import annotations

import argparse
import dataclasses
import functools

import pytest

from planner.commands import validate as cmd


def _opt():
    from runtime_cases import opt_model

    return opt_model()


@pytest.mark.distributed
@pytest.mark.slow  # spawns 2 ranks that import transformers: 20-50 s on 2 shared cores
def test_measure_plan_two_ranks():
    from runtime.manual_plan import manual_plan
    from runtime.validate import measure_plan

    plan = manual_plan(_opt(), dp=2, microbatch_size=1, num_microbatches=1, seq_len=8)
    got = measure_plan(plan, model_factory=functools.partial(_opt), steps=2, warmup=1, compute_dtype="fp32")
    assert [m.rank for m in got] == [0, 1]
    for m in got:
        assert len(m.step_times_s) == 2 and all(t > 0 for t in m.step_times_s)
        assert min(m.step_times_s) <= m.step_time_s <= max(m.step_times_s)
        assert m.peak_rss_bytes >= m.base_rss_bytes > 0
        assert len(m.losses) == 2 and all(0 < x < 20 for x in m.losses)
    assert got[0].losses == got[1].losses  # the global mean loss on every rank


def _parse(*argv):
    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    return p.parse_args(list(argv))


def test_row_error_is_relative_to_measured():
    from runtime.manual_plan import manual_plan
    from runtime.validate import RankMeasurement

    plan = manual_plan(_opt(), dp=2)
    plan = dataclasses.replace(plan, prediction=dataclasses.replace(plan.prediction, step_time_s=1.2,
                                                                     memory_gb_per_device=0.5))
    ms = [RankMeasurement(rank=r, step_times_s=(t,), step_time_s=t, peak_rss_bytes=int(3e8), base_rss_bytes=int(1e8),
                          losses=(1.0,)) for r, t in enumerate((0.9, 1.0))]
    row = cmd._row(plan, ms)
    assert row["measured_s"] == 1.0 and row["error"] == pytest.approx(0.2)
    assert row["measured_gb"] == pytest.approx(0.2)
    assert "+20.0%" in cmd._format([row], header=True)


def test_bad_input_is_a_typed_error():
    from costmodel.errors import ConfigError
    from runtime.validate import measure_plan
    from runtime.manual_plan import manual_plan

    with pytest.raises(ConfigError, match="nothing to validate"):
        cmd._plans(_parse(), None)
    with pytest.raises(ConfigError, match="not both"):
        cmd._plans(_parse("x.json", "--model", "gpt2"), None)
    with pytest.raises(ConfigError, match="steps=0"):
        measure_plan(manual_plan(_opt(), dp=2), model_factory=_opt, steps=0)


def test_cli_registered_and_error_exit(capsys):
    from planner.cli import main

    assert main(["validate"]) == 1
    assert "nothing to validate" in capsys.readouterr().err
