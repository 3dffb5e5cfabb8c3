"""The commands as a script sees them: exit status, --json, --version, -v, bad files; and the success paths of
explain, diff, export, whatif and the Gantt on plans the planner made (a 2-layer GPT on 4 A100s)."""

from __future__ import annotations

import json
import re

import pytest

from cli.exit import EXIT_ERROR, EXIT_NO, EXIT_OK
from cli.main import build_parser, main
from planner.plan import load_plan

TINY = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32"
ON_4_A100 = ["--cluster", "dgx-a100-80gb", "--gpus-per-node", "4", "--global-batch", "8"]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two planner-made plans of one model: pp=2 1F1B over 4 micro-batches, and tp=2 x pp=2 with recomputation."""
    root = tmp_path_factory.mktemp("plans")
    out = {}
    for name, fix in (("pp2", "pp=2,mb=1,schedule=1f1b"), ("tp2pp2", "tp=2,pp=2,mb=1,schedule=1f1b,recompute=full")):
        path = root / f"{name}.json"
        assert main(["plan", "--model", TINY, *ON_4_A100, "--fix", fix, "--out", str(path), "--reproducible"]) == 0
        out[name] = path
    return out


def test_version_comes_from_the_package_metadata(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"autopar {importlib.metadata.version('autopar')}"


def test_verbose_before_or_after_the_subcommand():
    parser = build_parser()
    assert parser.parse_args(["-v", "explain", "p.json"]).verbose
    assert parser.parse_args(["explain", "p.json", "-v"]).verbose
    assert not parser.parse_args(["explain", "p.json"]).verbose


def test_every_command_has_json_and_says_its_exit_status():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        assert "exit status: 0 ok; 1 the answer is no" in p.format_help(), name
        assert "--json" in p._option_string_actions, name
    for name, words in (("estimate", "exits 1 when it does not fit"), ("diff", "1 when they differ"),
                        ("validate", "exits 1")):
        assert words in " ".join(sub.choices[name].description.split()), name


@pytest.mark.parametrize("argv", [["explain", "{f}"], ["diff", "{f}", "{f}"], ["export", "{f}", "--to", "megatron"],
                                  ["validate", "{f}"], ["launch", "{f}", "--", "train.py"]])
def test_a_binary_plan_file_is_a_clear_error(tmp_path, capsys, argv):
    f = tmp_path / "plan.json"
    f.write_bytes(bytes(range(128, 256)) * 4)
    assert main([a.format(f=f) for a in argv]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "not a plan file (byte 0 is not UTF-8 text)" in err and "Traceback" not in err


def test_unknown_hf_model_type_lists_close_matches(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen2_moee", "hidden_size": 64}))
    assert main(["trace", "--model", str(cfg)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "model_type 'qwen2_moee' is unknown to transformers; close matches: qwen2_moe" in err
    assert len(err) < 400  # close matches, not every model type transformers knows


def test_hf_config_plans_at_its_own_positions_unless_seq_says_otherwise(tmp_path):
    from planner.models import model_dims

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 128, "max_position_embeddings": 131072}))
    assert model_dims(str(cfg)).seq == 131072
    assert model_dims(str(cfg), seq=4096).seq == 4096


def test_estimate_exits_1_when_it_does_not_fit(capsys):
    big = "gpt:layers=8,hidden=16384,heads=128,vocab=51200,seq=2048"
    argv = ["estimate", "--model", big, "--cluster", "dgx-a100-80gb", "--dp", "8", "--global-batch", "8",
            "--microbatch", "1"]
    assert main(argv) == EXIT_NO
    assert "DOES NOT FIT" in capsys.readouterr().out


# --- on planner output --------------------------------------------------------------------------------------


def test_diff_of_planner_plans(plans, capsys):
    assert main(["diff", str(plans["pp2"]), str(plans["tp2pp2"])]) == EXIT_NO
    out = capsys.readouterr().out
    assert re.search(r"recompute\s+none  ->  full\n", out)  # once, not once per stage
    assert re.search(r"throughput\s+[\d,]+ -> [\d,]+ +tokens/s", out)
    assert re.search(r"^b is \d+\.\d% (faster|slower) than a \(", out, re.M)
    assert main(["diff", str(plans["pp2"]), str(plans["pp2"]), "--json"]) == EXIT_OK
    d = json.loads(capsys.readouterr().out)
    assert d["identical"] and d["changes"] == [] and d["summary"].startswith("b is as fast as a")


def test_diff_gives_no_speed_verdict_across_models(plans, tmp_path, capsys):
    other = json.loads(plans["pp2"].read_text())
    other["model"]["fingerprint"] = "sha256:another-model"
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    assert main(["diff", str(plans["pp2"]), str(path)]) == EXIT_NO
    out = capsys.readouterr().out
    assert "no speed verdict: the plans are for different models" in out
    assert "faster" not in out and "slower" not in out


def test_export_of_planner_plans(plans, capsys):
    plan = load_plan(plans["tp2pp2"])
    assert main(["export", str(plans["tp2pp2"]), "--to", "megatron"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"--tensor-model-parallel-size {plan.degrees.tp}" in out
    assert f"--pipeline-model-parallel-size {plan.degrees.pp}" in out
    plan = load_plan(plans["pp2"])
    assert main(["export", str(plans["pp2"]), "--to", "deepspeed", "--force"]) == EXIT_OK
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["zero_optimization"]["stage"] == plan.zero_stage and cfg["train_batch_size"] == plan.global_batch
    assert main(["export", str(plans["pp2"]), "--to", "deepspeed", "--force", "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert json.loads(doc["text"]) == cfg and doc["target"] == "deepspeed" and doc["filename"].endswith(".json")
    assert doc["memory"]["ranks"][0]["pp_rank"] == 0 and doc["memory"]["ranks"][0]["target_bytes"] > 0


def test_explain_json_and_gantt_share_one_bubble_figure(plans, tmp_path, capsys, monkeypatch):
    """The Gantt's title carries explain's bubble share, and the drawn schedule's busiest-rank idle equals it."""
    import matplotlib.figure

    from costmodel.pipeline import simulate
    from planner.plots import bubble_share, plan_chunk_times, simulated_bubble_s

    titles = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **kw: (titles.append(self.axes[0].get_title()), real(self, *a, **kw))[1])
    assert main(["explain", str(plans["pp2"]), "--json", "--gantt", str(tmp_path / "g.png")]) == EXIT_OK
    d = json.loads(capsys.readouterr().out)
    bubble = next(t["share"] for t in d["breakdown"] if t["term"] == "bubble")
    assert bubble > 0 and f"bubble {100 * bubble:.1f}% of the step" in titles[-1]
    assert main(["explain", str(plans["pp2"])]) == EXIT_OK
    assert re.search(rf"bubble\s+[\d.]+ s\s+{100 * bubble:.1f}%", capsys.readouterr().out)
    plan = load_plan(plans["pp2"])
    s = plan.schedule
    tf, tb, tw = plan_chunk_times(plan)
    events = simulate(s.name, pp=plan.degrees.pp, num_microbatches=s.num_microbatches,
                      virtual_stages=s.virtual_stages, t_fwd_s=tf, t_bwd_s=tb, t_wgrad_s=tw)
    drawn = simulated_bubble_s(events, plan.degrees.pp) / plan.prediction.step_time_s
    # the plan file keeps 9 significant digits of every figure (planner/plan.py): agreement to that precision
    assert drawn == pytest.approx(bubble_share(plan), rel=1e-7) and bubble_share(plan) == pytest.approx(bubble)


def test_whatif_on_the_planner(capsys):
    argv = ["whatif", "--model", TINY, "--global-batch", "8", "--cluster", "dgx-a100-80gb", "h100",
            "--no-cache", "--jobs", "1", "--no-progress", "--fix", "pp=1"]
    assert main([*argv, "--json"]) == EXIT_OK
    rows = json.loads(capsys.readouterr().out)
    assert [r["cluster"] for r in rows] == ["dgx-a100-80gb", "h100"]
    assert all(r["status"] == "ok" and r["pp"] == 1 and r["tokens_per_s"] > 0 for r in rows)  # --fix held
    assert rows[1]["gpu"] == "H100-SXM5-80GB"
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    tokens = f"{rows[0]['tokens_per_s']:,.0f}"
    assert tokens in out and f"{100 * rows[0]['mfu']:.1f}%" in out and "e+0" not in out
