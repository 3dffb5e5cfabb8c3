"""``autopar launch`` (torchrun per node, sbatch with srun), the launch check against the plan's nodes, and picking
the plan for the running world size from a directory of plans. In one process; the real torchrun runs are in
tests/test_torchrun.py."""

from __future__ import annotations

import shlex

import pytest

import runtime_cases as rc
from cli.main import main


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    from planner.plan import save_plan
    from runtime.manual_plan import manual_plan

    d = tmp_path_factory.mktemp("plans")
    model = rc.opt_model()
    save_plan(manual_plan(model, tp=2, dp=2, microbatch_size=2, nodes=2), d / "w4.json")
    save_plan(manual_plan(model, dp=2, microbatch_size=2), d / "w2.json")
    save_plan(manual_plan(model, tp=2, microbatch_size=4), d / "w2_tp.json")
    (d / "notes.json").write_text("{}")  # not a plan: skipped
    return d


def test_launch_prints_one_torchrun_per_node(plans, capsys):
    assert main(["launch", str(plans / "w4.json"), "--master-addr", "10.1.2.3", "--max-restarts", "3", "--",
                 "train.py", "--plan", "w4.json", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    cmds = [line for line in out.splitlines() if "torchrun" in line and not line.startswith("#")]
    assert len(cmds) == 2
    for line in cmds:
        argv = shlex.split(line)
        assert argv[0] == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" and argv[1] == "torchrun"
        opts = dict(zip(argv[2:-5:2], argv[3:-5:2]))
        assert opts == {"--nnodes": "2", "--nproc-per-node": "2", "--rdzv-backend": "c10d",
                        "--rdzv-endpoint": "10.1.2.3:29500", "--rdzv-id": opts["--rdzv-id"], "--max-restarts": "3"}
        assert argv[-5:] == ["train.py", "--plan", "w4.json", "--steps", "5"]


def test_launch_json_gives_the_argv_per_node(plans, capsys):
    import json

    assert main(["launch", str(plans / "w4.json"), "--json", "--", "train.py", "--steps", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["nodes"] == 2 and out["nproc_per_node"] == 2
    assert out["env"] == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert len(out["commands"]) == 2 and out["commands"][0][:3] == ["torchrun", "--nnodes", "2"]
    assert all(c[-3:] == ["train.py", "--steps", "5"] for c in out["commands"])


def test_launch_slurm_script_runs_torchrun_under_srun(plans, capsys):
    assert main(["launch", str(plans / "w4.json"), "--slurm", "--min-nodes", "1", "--", "train.py"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=2\n" in out and "#SBATCH --ntasks-per-node=1\n" in out
    srun = [line for line in out.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1
    assert "torchrun --nnodes 1:2 --nproc-per-node 2 --rdzv-backend c10d" in srun[0]
    assert '--rdzv-endpoint "$head_node:29500" --rdzv-id "$SLURM_JOB_ID"' in srun[0]
    assert srun[0].endswith(" train.py")


def test_launch_needs_a_script_and_refuses_extra_args_elsewhere(plans, capsys):
    assert main(["launch", str(plans / "w4.json")]) == 2
    assert "no training script" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["diff", str(plans / "w4.json"), str(plans / "w2.json"), "--", "x"])
    assert e.value.code == 2


def test_check_launch_refuses_other_node_shapes(plans):
    from costmodel.errors import PlanMismatchError
    from planner.plan import load_plan
    from runtime.mesh import Layout, check_launch

    two_nodes = load_plan(plans / "w4.json")
    check_launch(two_nodes, Layout(node=(0, 0, 1, 1), local=(0, 1, 0, 1), local_world_size=2, nnodes=2))
    check_launch(two_nodes, Layout(node=(0, 0, 0, 0), local=(0, 1, 2, 3), local_world_size=None, nnodes=1))
    with pytest.raises(PlanMismatchError, match=r"2 node\(s\) x 2 GPUs per node .* launched 1 node\(s\) x 4 ranks "
                                                r"per node: launch with --nnodes 2 --nproc-per-node 2"):
        check_launch(two_nodes, Layout(node=(0, 0, 0, 0), local=(0, 1, 2, 3), local_world_size=4, nnodes=1))
    order = Layout(node=(1, 1, 0, 0), local=(0, 1, 0, 1), local_world_size=2, nnodes=2).node_major_order()
    assert order == [2, 3, 0, 1]  # mesh position 0 is node 0's local rank 0, whatever its global rank


def test_plan_directory_gives_the_plan_for_this_world(plans, monkeypatch):
    from costmodel.errors import PlanMismatchError
    from planner.plan import module_fingerprint
    from runtime.auto_wrap import plan_for_world

    fp = module_fingerprint(rc.opt_model())
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert plan_for_world(plans, fingerprint=fp, world_size=4).degrees.tp == 2
    assert plan_for_world(plans, fingerprint=fp, world_size=2).degrees.dp == 2  # w2.json sorts before w2_tp.json
    with pytest.raises(PlanMismatchError, match=r"no plan for this model on 8 ranks \(world sizes it has: 2 "
                                                r"\(w2.json, w2_tp.json\), 4 \(w4.json\)\)"):
        plan_for_world(plans, fingerprint=fp, world_size=8)
