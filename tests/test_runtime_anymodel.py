"""Any PyTorch model, not only transformers ones: ``auto_wrap(plan=None)`` on 4 gloo ranks plans the plain-torch GPT
of tests/models/gpt.py for this world and trains it with the single-process losses and gradients; a planner plan
pinned to tensor x data parallelism (tp2 x dp2, from the plan's per-module shardings by FQN) does too.
"""

from __future__ import annotations

import pytest
import torch

import runtime_cases as rc
from runtime_spawn import part


def _handwritten_body(rank: int, world_size: int, tmp: str) -> dict:
    import torch.distributed as dist

    from costmodel.profiles import resolve_cluster
    from planner import plan_model
    from planner.plan import save_plan
    from runtime import auto_wrap

    example = (torch.zeros(4, rc.SEQ, dtype=torch.long),)
    out: dict = {}
    pm = auto_wrap(rc.handwritten_gpt_model(), example, loss_fn=rc.loss_fn, plan=None)
    out["planned"] = {"plan": pm.plan.to_dict(), "run": rc.parallel_run(pm, 4)}
    path = f"{tmp}/handwritten_tp2_dp2.json"
    if rank == 0:
        cluster = resolve_cluster("local", nodes=1, gpus_per_node=world_size)
        save_plan(plan_model(rc.handwritten_gpt_model(), cluster, global_batch=4, example_inputs=example,
                             fix="tp=2,dp=2,pp=1,sp=false"), path)
    dist.barrier()
    pm2 = auto_wrap(rc.handwritten_gpt_model(), example, loss_fn=rc.loss_fn, plan=path)
    out["tp2"] = {"plan": pm2.plan.to_dict(), "run": rc.parallel_run(pm2, 4)}
    return out


@pytest.mark.distributed
def test_auto_wrap_plans_and_trains_a_handwritten_gpt():
    ref = rc.reference_run("handwritten_gpt", 4)
    results = [part(4, "test_runtime_anymodel:_handwritten_body", r) for r in range(4)]
    plans = [res["planned"]["plan"] for res in results]
    assert all(p == plans[0] for p in plans)  # every rank applied rank 0's plan
    assert plans[0]["model"]["name"] == "GPT (module)"
    for rank, res in enumerate(results):
        rc.compare(res["planned"]["run"], rc.restrict(ref, res["planned"]["run"]), what=f"planned rank {rank}")
        rc.compare(res["tp2"]["run"], ref, what=f"tp2 x dp2 rank {rank}")
    styles = {s["fqn"]: s["style"] for s in results[0]["tp2"]["plan"]["shardings"]}
    assert styles["blocks.0.attn.q"] == "colwise" and styles["blocks.0.attn.o"] == "rowwise"
    assert styles["blocks.1.mlp.fc1"] == "colwise" and styles["blocks.1.mlp.fc2"] == "rowwise"
