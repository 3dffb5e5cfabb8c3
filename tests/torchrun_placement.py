"""Run under torchrun by tests/test_torchrun.py: apply PLAN to the tiny OPT model of runtime_cases, train
``runtime_cases.STEPS`` steps on ``runtime_cases.batches``, and write OUT/rank<r>.json with where this rank runs
(RANK, LOCAL_RANK, GROUP_RANK), the ranks and nodes of its tp / cp / dp / pp process groups, and the losses.

    python -m torch.distributed.run ... tests/torchrun_placement.py PLAN OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

import runtime_cases as rc  # noqa: E402
from runtime import auto_wrap  # noqa: E402
from runtime.mesh import gather_layout, group_nodes  # noqa: E402


def main(plan: str, out: str) -> None:
    pm = auto_wrap(rc.opt_model(), None, loss_fn=rc.loss_fn, plan=plan)
    layout = gather_layout()
    groups = {axis: {"ranks": dist.get_process_group_ranks(pm.mesh.get_group(axis)),
                     "nodes": group_nodes(pm.mesh, axis, layout)} for axis in ("tp", "cp", "dp", "pp")}
    run = rc.parallel_run(pm, pm.plan.global_batch)
    record = {
        "rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "groups": groups, "losses": [float(x) for x in run["losses"]],
    }
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
