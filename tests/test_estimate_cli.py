"""``autopar estimate``: human and --json output, chosen knobs, a configuration that does not fit, bad input."""

import json

import pytest

from cli.main import main

MODEL = "gpt:layers=4,hidden=256,heads=8,vocab=1000,seq=256"
KEYS = {"step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "memory_gb_per_device",
        "fits", "breakdown"}


def _run(capsys, *extra):
    rc = main(["estimate", "--model", MODEL, "--cluster", "dgx-a100-80gb", "--nodes", "1", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_has_the_keys_and_chosen_values(capsys):
    rc, out, _ = _run(capsys, "--tp", "2", "--pp", "2", "--global-batch", "16", "--schedule",
                      "interleaved-1f1b", "--recompute", "full", "--json")
    assert rc == 0
    d = json.loads(out)
    assert KEYS <= set(d)
    assert d["config"]["dp"] == 2 and d["config"]["tp"] == 2  # dp defaults to devices / (tp*pp*cp)
    assert set(d["chosen"]) == {"microbatch", "virtual_stages"}
    assert d["config"]["microbatch"] == d["chosen"]["microbatch"]
    assert sum(d["breakdown"].values()) == pytest.approx(d["step_time_s"])
    assert {"compute", "bubble", "optimizer"} <= set(d["breakdown"])
    assert d["fits"] is True and 0 < d["mfu"] < 1
    assert d["hw_tflops_per_gpu"] > d["model_tflops_per_gpu"]  # full recomputation counted
    assert len(d["stage_time_s"]) == 2


def test_human_output(capsys):
    rc, out, _ = _run(capsys, "--tp", "8", "--global-batch", "8", "--microbatch", "1", "--sequence-parallel",
                      "--zero", "1")
    assert rc == 0
    assert "step time" in out and "MFU" in out and "where the step goes" in out and "fits" in out
    assert "comm_nvswitch" in out


def test_does_not_fit_says_how_much(capsys):
    big = "gpt:layers=8,hidden=16384,heads=128,vocab=51200,seq=2048"
    rc = main(["estimate", "--model", big, "--cluster", "dgx-a100-80gb", "--nodes", "1", "--dp", "8",
               "--global-batch", "8", "--microbatch", "1", "--json"])
    out = capsys.readouterr()
    assert rc == 1  # the answer is no: a script can test it
    d = json.loads(out.out)
    assert d["fits"] is False and d["memory_gb_per_device"] > 80
    assert f"{d['memory_gb_per_device']:.1f} GB per device" in out.err


@pytest.mark.parametrize("extra,msg", [
    (["--tp", "3", "--dp", "1", "--pp", "1", "--global-batch", "8"], "tp=3 does not divide heads=8"),
    (["--tp", "2", "--global-batch", "16", "--microbatch", "3"], "microbatch in [2, 4]"),
    (["--tp", "2", "--dp", "2", "--global-batch", "8"], "!= 8 devices; use dp=4"),
])
def test_bad_configurations_exit_2_with_the_fix(capsys, extra, msg):
    rc, _, err = _run(capsys, *extra)
    assert rc == 2
    assert "autopar estimate: error:" in err and msg in err


def test_traced_workload_agrees_with_the_analytic_count():
    """costmodel.analytic cross-checks the tracer on the same GPT (the trace is cached from the tests above)."""
    from costmodel.analytic import gpt_workload
    from planner.workload import workload_from_model

    traced, _ = workload_from_model(MODEL)
    ana = gpt_workload(layers=4, hidden=256, heads=8, vocab=1000, seq=256)
    assert traced.num_layers == ana.num_layers and traced.hidden == ana.hidden
    assert traced.params == pytest.approx(ana.params, rel=1e-3)
    assert traced.flops_fwd_per_seq == pytest.approx(ana.flops_fwd_per_seq, rel=1e-3)
    t_layers = [l for l in traced.layers if l.kind == "transformer"]
    a_layers = [l for l in ana.layers if l.kind == "transformer"]
    assert [l.params for l in t_layers] == [l.params for l in a_layers]
    assert [l.attn_flops_fwd for l in t_layers] == pytest.approx([l.attn_flops_fwd for l in a_layers])
    # backward: 2x forward for the GEMMs; the tracer counts the attention backward as the kernel does (2.5x)
    assert traced.flops_bwd_per_seq == pytest.approx(ana.flops_bwd_per_seq, rel=0.05)
