"""Any PyTorch model, not only transformers ones: ``auto_wrap(plan=None)`` on 4 gloo ranks plans the plain-torch GPT
of tests/models/gpt.py for this world (the planner picks a pipeline with the tied head on the other stage) and
trains it with the single-process losses and gradients; a planner plan pinned to tensor x data parallelism (tp2 x
dp2) with the Megatron styles by FQN does too, and so does the planner's tp2 x pp2 plan with sequence parallelism.
Pipeline chunks of a user model come from a torch.fx trace of its forward (runtime/traced_units.py): chained, they
compute what the model computes; a forward that is no chain of its layers is refused naming why and the fix; the
MLP of tests/models/mlp.py pipelines on 2 ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import runtime_cases as rc
from runtime_spawn import part

MEGATRON = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
            "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
"""Styles by FQN suffix set on the tp2 plan: at hidden 64 the planner's ILP keeps every linear replicated on this
machine's profile (each gloo all-reduce costs more than the sharded compute saves; tests/test_user_models.py shows
the sizes where it shards), so the styles are set by hand to run the runtime's sharding of a user model."""


def _megatron(plan):
    shardings = tuple(
        dataclasses.replace(m, style=next((s for k, s in MEGATRON.items() if m.fqn.endswith("." + k)), m.style))
        for m in plan.shardings
    )
    return dataclasses.replace(plan, shardings=shardings)


def _handwritten_body(rank: int, world_size: int, tmp: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

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
        save_plan(_megatron(plan_model(rc.handwritten_gpt_model(), cluster, global_batch=4, example_inputs=example,
                                       fix="tp=2,dp=2,pp=1,sp=false")), path)
    dist.barrier()
    pm2 = auto_wrap(rc.handwritten_gpt_model(), example, loss_fn=rc.loss_fn, plan=path)
    tp_placement = {}  # the placement of each parameter over the tp mesh axis (ZeRO shards over dp besides)
    for n, p in pm2.named_parameters():
        names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        pl = p.placements[names.index("tp")] if "tp" in names else None
        tp_placement[n] = f"shard {pl.dim}" if pl is not None and pl.is_shard() else "replicate"
    out["tp2"] = {"plan": pm2.plan.to_dict(), "run": rc.parallel_run(pm2, 4), "tp_placement": tp_placement}
    # the planner's tp2 x pp2 plan with sequence parallel: vocab-parallel embedding and head, tied across the stages
    plan3 = None
    if rank == 0:
        cluster = resolve_cluster("local", nodes=1, gpus_per_node=world_size)
        plan3 = plan_model(rc.handwritten_gpt_model(), cluster, global_batch=4, example_inputs=example,
                           fix="tp=2,pp=2,sp=true")
    pm3 = auto_wrap(rc.handwritten_gpt_model(), example, loss_fn=rc.loss_fn, plan=plan3)
    out["tp2_pp2_sp"] = {"plan": pm3.plan.to_dict(), "run": rc.parallel_run(pm3, 4)}
    return out


@pytest.mark.distributed
def test_auto_wrap_plans_and_trains_a_handwritten_gpt():
    ref = rc.reference_run("handwritten_gpt", 4)
    results = [part(4, "test_runtime_anymodel:_handwritten_body", r) for r in range(4)]
    plans = [res["planned"]["plan"] for res in results]
    assert all(p == plans[0] for p in plans)  # every rank applied rank 0's plan
    assert plans[0]["model"]["name"] == "GPT (module)"
    assert plans[0]["degrees"]["pp"] > 1  # what this test is about: the planner pipelines it, the runtime runs it
    sp_plan = results[0]["tp2_pp2_sp"]["plan"]
    assert sp_plan["sequence_parallel"] and sp_plan["degrees"]["pp"] == 2 and sp_plan["degrees"]["tp"] == 2
    sp_styles = {s["fqn"]: s["style"] for s in sp_plan["shardings"]}
    assert (sp_styles["wte"], sp_styles["head"]) == ("vocab_embedding", "vocab_head")
    for rank, res in enumerate(results):
        rc.compare(res["planned"]["run"], rc.restrict(ref, res["planned"]["run"]), what=f"planned rank {rank}")
        rc.compare(res["tp2"]["run"], ref, what=f"tp2 x dp2 rank {rank}")
        rc.compare(res["tp2_pp2_sp"]["run"], rc.restrict(ref, res["tp2_pp2_sp"]["run"]), what=f"tp2 pp2 sp {rank}")
    # the tied head weight is named as the model names it (wte.weight) on both pipeline ranks
    held = [set(res["planned"]["run"]["params"]) for res in results]
    assert "head.weight" not in set().union(*held) and all("wte.weight" in h for h in held)
    styles = {s["fqn"]: s["style"] for s in results[0]["tp2"]["plan"]["shardings"]}
    assert styles["blocks.0.attn.q"] == "colwise" and styles["blocks.0.attn.o"] == "rowwise"
    # the plan's styles were applied by FQN: weights sharded over tp by rows (colwise) / columns (rowwise)
    placed = results[0]["tp2"]["tp_placement"]
    assert placed["blocks.0.attn.q.weight"] == placed["blocks.1.mlp.fc1.weight"] == "shard 0"
    assert placed["blocks.1.attn.o.weight"] == placed["blocks.1.mlp.fc2.weight"] == "shard 1"
    assert placed["wte.weight"] == placed["blocks.0.ln1.weight"] == "replicate"


# --- traced chunks (one process) --------------------------------------------------------------------------


def _stages(model, cuts):
    """StagePlans holding units [lo, hi) of ``model``'s traced layout, each listing the units' module FQNs."""
    from planner.plan import StagePlan
    from runtime.model_adapters import adapter_for

    lay = adapter_for(model, traced=True).layout
    units = [list(lay.embed), *([f] for f in lay.layers), *([f] for f in lay.post)]
    return tuple(StagePlan(index=i, pp_rank=i % 2, modules=tuple(f for u in units[lo:hi] for f in u), ranks=())
                 for i, (lo, hi) in enumerate(cuts))


def _cut(model, cuts):
    from runtime.model_adapters import adapter_for
    from runtime.pipeline import PipelineChunk, cut_units

    adapter = adapter_for(model, traced=True)
    stages = _stages(model, cuts)
    ranges = cut_units(adapter.layout, stages, unit_of=adapter.unit_of)
    assert ranges == cuts
    return [PipelineChunk(model, adapter=adapter, lo=lo, hi=hi, stage=st) for st, (lo, hi) in zip(stages, ranges)]


@pytest.mark.parametrize("kind", ["gpt", "mlp", "vit"])
def test_traced_chunks_chained_equal_full_model(kind):
    from runtime.materialize import materialize
    from tests.models.gpt import GPT
    from tests.models.mlp import MLPStack
    from tests.models.vit import ViT

    gen = torch.Generator().manual_seed(0)
    if kind == "vit":  # nn.TransformerEncoder's layers; root-level class token and positions (on chunk 0)
        torch.manual_seed(0)
        model = ViT(image=16, patch=8, layers=3, hidden=32, heads=4, mlp=64, classes=3)
        nn.init.normal_(model.cls), nn.init.normal_(model.pos)
        x, cuts = torch.randn(2, 3, 16, 16, generator=gen), [(0, 2), (2, 4), (4, 6)]
    else:
        with torch.device("meta"):  # (not .to("meta"), which unties the head)
            if kind == "gpt":  # 3 layers, tied head: units <embedding>, blocks.0..2, ln_f, head
                model = GPT(layers=3, hidden=32, heads=4, vocab=50, max_seq=16)
            else:  # units <embedding> (inp), blocks.0..3, out
                model = MLPStack(in_features=8, width=16, hidden=32, layers=4, classes=5)
        model = materialize(model, device="cpu", seed=0)
        if kind == "gpt":
            x, cuts = torch.randint(0, 50, (2, 8), generator=gen), [(0, 2), (2, 4), (4, 6)]
        else:
            x, cuts = torch.randn(3, 8, generator=gen), [(0, 3), (3, 6)]
    chunks = _cut(model, cuts)
    h = x
    for c in chunks:
        h = c(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)
    names = [n for c in chunks for n, _ in c.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    if kind == "gpt":
        assert chunks[0].fqns == ("wte", "wpe", "blocks.0") and chunks[2].fqns == ("ln_f", "head")
        assert chunks[2].head.weight is chunks[0].wte.weight  # the tie survives the cut (one parameter object)
    if kind == "vit":
        assert chunks[0].fqns == ("patch", "encoder.layers.0") and chunks[0].pos is model.pos


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class _Skip(nn.Module):
    """U-Net-like: the embedding's output skips over the layers to the head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 2)
        self.blocks = nn.ModuleList(_Block(8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = e = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h + e)


class _Branchy(_Skip):
    """Python control flow on a tensor's value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h) if h.sum() > 0 else h
        return self.out(h)


class _Shared(_Skip):
    """Runs layer 0 twice (weight sharing across depth)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.inp(x))
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class _SharedNorm(_Skip):
    """One norm after layers 1 and 2: with a stage per layer, stages 1 and 2 would each hold it and train their
    copies apart (a weight shared with the embedding's stage is kept equal, as a tied head)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            h = b(h) if i == 0 else self.norm(b(h))
        return self.out(h)


class _TwoInputs(_Skip):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return super().forward(x * mask)


@pytest.mark.parametrize("model_cls, match", [
    (_Skip, r"not a chain of its layers: 2 values cross the cut between 'blocks.0' and 'blocks.1'"),
    (_Branchy, "torch.fx could not trace its forward"),
    (_Shared, "calls layer 'blocks.0' more than once"),
    (_TwoInputs, "needs argument 'mask' besides the input"),
    (_SharedNorm, "parameter 'norm.weight' is used by stage 1 and by stage 2"),
    (nn.Sequential, "no nn.ModuleList of repeated layers"),
])
def test_non_chain_forward_is_refused_naming_why_and_the_fix(model_cls, match):
    from costmodel.errors import UnsupportedModelError
    from runtime.pipeline import cut_model
    from runtime.manual_plan import manual_plan

    model = model_cls() if model_cls is not nn.Sequential else nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    plan = manual_plan(_Skip(), pp=3)  # cut_model reads only the stages: one layer per stage
    with pytest.raises(UnsupportedModelError, match=match) as err:
        cut_model(model, plan=plan)
    assert "pp=1" in str(err.value)


def test_head_counts_divided_on_colwise_parents():
    from costmodel.errors import ConfigError
    from runtime.tensor_parallel import _divide_heads

    class Attn(nn.Module):
        def __init__(self, heads: int) -> None:
            super().__init__()
            self.heads, self.n_kv_heads, self.causal = heads, 2, True
            self.q, self.k, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    attn, mlp = Attn(4), nn.Module()
    mlp.heads = 6  # not the parent of a colwise linear: left alone
    modules = {"a": attn, "a.q": attn.q, "a.k": attn.k, "a.o": attn.o, "m": mlp}
    _divide_heads(modules, {"a.q": "colwise", "a.k": "colwise", "a.o": "rowwise"}, 2)
    assert (attn.heads, attn.n_kv_heads, attn.causal, mlp.heads) == (2, 1, True, 6)  # once per module, not per q/k
    with pytest.raises(ConfigError, match="a.heads=3 not divisible by tp=2"):
        _divide_heads({"a": Attn(3), "a.q": nn.Linear(8, 8)}, {"a.q": "colwise"}, 2)


# --- the MLP pipelined on 2 ranks -------------------------------------------------------------------------

MLP_DIMS = dict(in_features=16, width=32, hidden=64, layers=4, classes=8)
MLP_BATCH = 8


def _mlp(device: str = "meta") -> nn.Module:
    from tests.models.mlp import MLPStack

    with torch.device(device):
        return MLPStack(**MLP_DIMS)


def _mlp_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)


def _mlp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(MLP_BATCH, MLP_DIMS["in_features"], generator=gen),
             torch.randint(0, MLP_DIMS["classes"], (MLP_BATCH,), generator=gen)) for _ in range(rc.STEPS)]


def _mlp_run(step, named_parameters, params) -> dict:
    opt = rc.make_optimizer(params)
    losses, grads = [], []
    for x, y in _mlp_batches():
        losses.append(step(x, y))
        grads.append({n: rc.full(p.grad) for n, p in named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": {n: rc.full(p) for n, p in named_parameters()}}


def _mlp_pp2_body(rank: int, world_size: int, tmp: str) -> dict:
    from costmodel.profiles import resolve_cluster
    from planner import plan_model
    from runtime import auto_wrap

    cluster = resolve_cluster("local", nodes=1, gpus_per_node=world_size)
    plan = None
    if rank == 0:  # the planner's own stages for the MLP (embedding group `inp`, head `out`), pinned to pp=2
        plan = plan_model(_mlp(), cluster, global_batch=MLP_BATCH, fix="pp=2,schedule=1f1b,mb=2",
                          example_inputs=(torch.zeros(MLP_BATCH, MLP_DIMS["in_features"]),))  # CPU, model on meta
    pm = auto_wrap(_mlp(), (torch.zeros(MLP_BATCH, MLP_DIMS["in_features"]),), loss_fn=_mlp_loss, plan=plan)
    return {"plan": pm.plan.to_dict(), "run": _mlp_run(pm.step, pm.named_parameters, pm.parameters())}


@pytest.mark.distributed
def test_mlp_pipelines_on_2_ranks_like_one_process():
    from runtime.materialize import materialize

    model = materialize(_mlp(), device="cpu", seed=0)

    def step(x, y):
        loss = _mlp_loss(model(x), y)
        loss.backward()
        return loss.detach()

    ref = _mlp_run(step, model.named_parameters, model.parameters())
    results = [part(2, "test_runtime_anymodel:_mlp_pp2_body", r) for r in range(2)]
    plan = results[0]["plan"]
    assert plan["degrees"]["pp"] == 2 and plan["schedule"]["num_microbatches"] == 4
    assert [s["modules"][0] for s in plan["stages"]] == ["inp", "blocks.2"]
    for rank, res in enumerate(results):
        assert res["plan"] == plan
        rc.compare(res["run"], rc.restrict(ref, res["run"]), what=f"mlp pp2 rank {rank}")
    assert set(results[0]["run"]["params"]) | set(results[1]["run"]["params"]) == set(ref["params"])


def test_planner_proposes_no_pipeline_for_a_non_chain_model():
    """The hand-written GPT with its embedding added again before the head: where the GPT gets pp2 x dp2 (the
    first test), this one gets no pipeline, and a pinned pp=2 is refused naming the boundary."""
    from costmodel.errors import UnsupportedModelError
    from costmodel.profiles import resolve_cluster
    from planner import plan_model
    from planner.workload import workload_from_module
    from tests.models.gpt import GPT

    class SkipGPT(GPT):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = e = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x + e))

    cluster = resolve_cluster("local", nodes=1, gpus_per_node=4)
    with torch.device("meta"):
        skip = SkipGPT(layers=2, hidden=rc.HIDDEN, heads=4, vocab=rc.VOCAB, max_seq=64)
    example = (torch.zeros(4, rc.SEQ, dtype=torch.long),)
    w, _ = workload_from_module(skip, example, name="skip")
    assert "cross the boundary between blocks 'blocks.0' and 'blocks.1'" in w.meta["pipeline_blocker"]
    w, _ = workload_from_module(rc.handwritten_gpt_model(), example, name="gpt")
    assert w.meta["pipeline_blocker"] == ""  # the GPT is a chain (its tied head reads a weight, not a tensor)
    assert plan_model(skip, cluster, global_batch=4, example_inputs=example).degrees.pp == 1
    with pytest.raises(UnsupportedModelError, match="not a chain a pipeline can cut.*--fix pp=1"):
        plan_model(skip, cluster, global_batch=4, example_inputs=example, fix="pp=2")
