"""Activation checkpointing (runtime/checkpointing.py) as the plan asks: the mode's numbers and what it recomputes,
and ``StagePlan.recompute_layers`` (the first k of a stage's transformer layers); unit tests in one process (the
pipelined and data-parallel cases run in tests/test_runtime_pp.py and tests/test_runtime_dp.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from costmodel.errors import ConfigError, PlanMismatchError
from planner.plan import Plan
from runtime_cases import count_attention_calls
from test_runtime_pp import ATOL, RTOL, batches, lm_loss, tiny_model


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_recompute_same_numbers_and_recomputes_what_it_says(family):
    from runtime.checkpointing import apply_activation_checkpointing, recompute_mode
    from runtime.model_adapters import adapter_for

    ids, tgt = batches(2)[0]
    results = {}
    for mode in ("none", "selective", "full"):
        model = tiny_model(family)
        layers = adapter_for(model).layout.layers
        apply_activation_checkpointing(model, layer_fqns=layers, mode=mode)
        assert recompute_mode(model.get_submodule(layers[0])) == mode
        names = [n for n, _ in model.named_parameters()]  # FQNs unchanged by checkpointing
        loss = lm_loss(model(ids).logits, tgt)
        with _OpCounter() as ops:
            loss.backward()
        results[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, ops.counts, names)
    for mode in ("selective", "full"):
        torch.testing.assert_close(results[mode][0], results["none"][0], rtol=0, atol=0)
        torch.testing.assert_close(results[mode][1], results["none"][1], rtol=RTOL, atol=ATOL)
        assert results[mode][3] == results["none"][3]
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    n_layers = len(adapter_for(tiny_model(family)).layout.layers)
    none, sel, full = (results[m][2] for m in ("none", "selective", "full"))
    # attention core re-run in backward once per layer under selective and full, never without recompute
    assert none.get(sdpa, 0) == 0 and sel.get(sdpa, 0) == n_layers and full.get(sdpa, 0) == n_layers
    # the linear layers' forward matmuls are recomputed only under full recomputation
    assert full.get("mm", 0) + full.get("addmm", 0) > sel.get("mm", 0) + sel.get("addmm", 0)
    assert sel.get("mm", 0) + sel.get("addmm", 0) == none.get("mm", 0) + none.get("addmm", 0)


def test_recompute_mode_is_checked():
    from runtime.checkpointing import set_recompute

    with pytest.raises(ConfigError, match="recompute='some'"):
        set_recompute(torch.nn.Linear(2, 2), "some")


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_plan_recompute_without_a_pipeline_sets_every_layer(mode):
    """pp = 1: the plan's single stage's recomputation on every transformer layer (what runtime.parallelize sets)."""
    from runtime.checkpointing import apply_stage_recompute, recompute_mode, transformer_layers
    from runtime.manual_plan import manual_plan
    from runtime.model_adapters import adapter_for

    model = tiny_model("llama")
    layers = adapter_for(model).layout.layers
    assert transformer_layers(model) == list(layers)
    apply_stage_recompute(model, layer_fqns=layers, stage=manual_plan(model, recompute=mode).stages[0])
    assert [recompute_mode(model.get_submodule(fqn)) for fqn in layers] == [mode] * len(layers)


def test_recompute_layers_checkpoints_the_first_k_layers_of_the_stage():
    """pp = 1, 4 layers, recompute_layers=2: layers 0-1 run under checkpoint (their attention runs again in backward),
    layers 2-3 keep their activations; -1 and counts above the stage's layers mean all of them; loss and gradients
    equal the model without recomputation."""
    from runtime.checkpointing import apply_stage_recompute, recompute_mode, transformer_layers
    from runtime.manual_plan import manual_plan

    ids, tgt = batches(2)[0]
    got = {}
    for k in (-1, 0, 2, 5):
        model = tiny_model("llama")
        stage = manual_plan(model, recompute="full", recompute_layers=k).stages[0]
        layers = transformer_layers(model)
        done = apply_stage_recompute(model, layer_fqns=layers, stage=stage)
        calls = count_attention_calls({f: model.get_submodule(f) for f in layers}, "llama")
        loss = lm_loss(model(ids).logits, tgt)
        loss.backward()
        got[k] = (done, [recompute_mode(model.get_submodule(f)) for f in layers], [calls[f] for f in layers],
                  loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert got[-1][:3] == got[5][:3] == (layers, ["full"] * 4, [2, 2, 2, 2])
    assert got[0][:3] == ([], ["none"] * 4, [1, 1, 1, 1])
    assert got[2][:3] == (layers[:2], ["full", "full", "none", "none"], [2, 2, 1, 1])
    for k in (-1, 2):
        torch.testing.assert_close(got[k][3], got[0][3], rtol=0, atol=0)
        torch.testing.assert_close(got[k][4], got[0][4], rtol=RTOL, atol=ATOL)


def test_plan_file_without_recompute_layers_recomputes_every_layer_of_the_stage():
    from runtime.checkpointing import apply_stage_recompute
    from runtime.manual_plan import manual_plan

    model = tiny_model("llama")
    plan = manual_plan(model, pp=2, recompute="selective", recompute_layers=1, num_microbatches=2)
    data = plan.to_dict()
    assert [st["recompute_layers"] for st in data["stages"]] == [1, 1]
    assert Plan.from_dict(data) == plan
    for st in data["stages"]:
        del st["recompute_layers"]  # a plan file written before the field existed
    assert [st.recompute_layers for st in Plan.from_dict(data).stages] == [-1, -1]
    data["stages"][0]["recompute_layers"] = -2
    with pytest.raises(PlanMismatchError, match="recompute_layers=-2 must be >= 0"):
        Plan.from_dict(data)
    bad = dataclasses.replace(plan.stages[0], recompute_layers=-2)
    with pytest.raises(PlanMismatchError, match="recompute_layers=-2 must be >= 0"):
        apply_stage_recompute(model, layer_fqns=["model.layers.0"], stage=bad)


def test_selective_recompute_is_refused_on_moe_layers():
    from runtime.checkpointing import set_recompute
    from runtime_cases import mixtral_model

    layer = mixtral_model().model.layers[0]
    with pytest.raises(ConfigError, match="selective.*MoE.*recompute=full"):
        set_recompute(layer, "selective")
    set_recompute(layer, "full")  # full recomputation runs on MoE layers
