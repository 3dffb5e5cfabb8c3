"""Tensor and sequence parallelism from a Plan's ``ModuleSharding`` list, with DTensor ``parallelize_module``.

Style -> what is applied on the plan's "tp" mesh axis (Megatron-LM, Shoeybi et al. 2019; SP: Korthikanti et al.
2022):

- ``colwise``: ``ColwiseParallel`` (weight Shard(0)); input Replicate, or Shard(-2) (the sequence dim) when
  sequence parallel is on and the linear sits directly in the sequence-sharded stream (OPT's fc1).
- ``rowwise``: ``RowwiseParallel`` (weight Shard(1)); output all-reduced (Replicate), or reduce-scattered to
  Shard(-2) under sequence parallel.
- ``vocab_embedding``: ``RowwiseParallel`` on ``nn.Embedding`` (weight Shard(0): each rank owns a vocabulary slice,
  the masked partial lookups are all-reduced).
- ``vocab_head``: ``ColwiseParallel`` with logits left Shard(-1) as a DTensor for the loss-parallel cross-entropy
  (``torch.distributed.tensor.parallel.loss_parallel``); in a pipeline stage as this rank's local vocabulary shard,
  which the stage's loss wraps back into that DTensor (``runtime.pipeline.build_pipeline``). Whether that works on the backend in use is checked at
  apply time on the real tp mesh (``loss_parallel_works``); if not, the logits are all-gathered (Replicate) and a
  warning is logged. On gloo/CPU in torch 2.13 it works (tests/test_runtime_tp.py checks both paths).
- ``sequence_parallel``: ``SequenceParallel(sequence_dim=-2)`` on norms: parameters Replicate DTensors, activations
  sharded over the sequence; only meaningful with ``plan.sequence_parallel`` (otherwise treated as replicate).
- ``replicate``: nothing.
- ``expert``: skipped here (``runtime.expert_parallel`` shards the experts over ep). Under sequence parallel the
  MoE block holding them (the expert module's parent: router and experts, replicated over tp) runs on the whole
  sequence: a pre-hook gathers it, a hook hands each tp rank its part back.

Two things parallelize_module does not do and transformer code needs:
- attention modules that reshape with an explicit head count (OPT: ``view(bsz, -1, self.num_heads, head_dim)``)
  would silently fold heads into the sequence: the head counts (``num_heads``, ``num_key_value_heads``, ``n_head``,
  ``heads``, ...: ``HEAD_COUNT_ATTRS``) are divided by tp on the parent of colwise linears (Llama / Mixtral and
  ``tests/models/gpt.py`` reshape with ``-1`` and need nothing).
- under sequence parallel a "region" (the parent of colwise linears that owns no sequence-parallel norm:
  attention, Llama's MLP) reads its input's sequence length, so its ``hidden_states`` input is all-gathered by a
  forward pre-hook (DTensor Shard(1) -> Replicate, the backward is the matching reduce-scatter); the sequence is
  scattered at the input of the first transformer layer (``layers.0``) and gathered again by the head (the
  vocab_head's colwise input layout, or a pre-hook on a replicated ``lm_head``). A pipeline chunk
  (runtime.pipeline) holds its layers in plain containers, not the ModuleList, so no ``layers.0`` hook is added
  there: the chunk's forward shards and gathers the sequence itself.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from costmodel.errors import ConfigError, PlanMismatchError
from planner.plan import ModuleSharding, Plan
from runtime.materialize import retie, tied_parameters

log = logging.getLogger(__name__)

_TP_STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head", "sequence_parallel")


def apply_tensor_parallel(
    model: nn.Module,
    *,
    plan: Plan,
    mesh: DeviceMesh,
    strict: bool = True,
    loss_parallel_ok: bool | None = None,
    local_logits: bool = False,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh["tp"]`` per ``plan.shardings``; returns the model (unchanged at tp=1).

    ``strict=False`` skips plan entries whose module is not in ``model`` (a pipeline stage holds a subset).
    ``loss_parallel_ok=None`` probes the backend; True / False forces the loss-parallel / gathered-logits path.
    ``local_logits``: a loss-parallel head returns this rank's vocabulary shard as a plain tensor (a pipeline
    stage's output; the loss wraps it back into a DTensor: ``runtime.pipeline``) rather than a DTensor.
    Works on meta-device models (materialise afterwards with ``runtime.materialize``).
    """
    tp = plan.degrees.tp
    if tp == 1:
        return model
    if mesh["tp"].size() != tp:
        raise PlanMismatchError(f"mesh tp axis has {mesh['tp'].size()} ranks but the plan has tp={tp}: build the "
                                "mesh from the plan (runtime.build_mesh)")
    return shard_modules(model, shardings=plan.shardings, tp_mesh=mesh["tp"], sequence_parallel=plan.sequence_parallel,
                         strict=strict, loss_parallel_ok=loss_parallel_ok, local_logits=local_logits)


def shard_modules(
    model: nn.Module,
    *,
    shardings: tuple[ModuleSharding, ...],
    tp_mesh: DeviceMesh,
    sequence_parallel: bool = False,
    strict: bool = True,
    loss_parallel_ok: bool | None = None,
    local_logits: bool = False,
) -> nn.Module:
    """What ``apply_tensor_parallel`` does, on a 1-D ``tp_mesh`` of any size (1 included: the calibration times
    DTensor's dispatch on one rank this way)."""
    tp = tp_mesh.size()
    styles = _styles_present(model, shardings, strict=strict)
    sp = sequence_parallel
    if "vocab_head" in styles.values() and loss_parallel_ok is None:
        loss_parallel_ok = loss_parallel_works(tp_mesh)
        if not loss_parallel_ok:
            log.warning("loss-parallel cross-entropy failed on backend of mesh %s: gathering logits", tp_mesh)
    modules = dict(model.named_modules())
    _check_divisible(modules, styles, tp)
    moe_blocks = _moe_blocks(modules, shardings)
    if sp:
        _check_sp_region_covered(model, modules, styles, exempt=moe_blocks)
    ties = tied_parameters(model)
    _divide_heads(modules, styles, tp)
    regions = _sp_regions(modules, styles) if sp else set()
    layer_plan = {
        fqn: _style_object(style, sp=sp, in_region=_parent(fqn) in regions, loss_parallel_ok=bool(loss_parallel_ok),
                           local_logits=local_logits)
        for fqn, style in styles.items()
        if style in _TP_STYLES and (style != "sequence_parallel" or sp)
    }
    parallelize_module(model, tp_mesh, layer_plan)
    if sp:
        _hook_sequence(model, modules, styles, regions=regions, moe_blocks=moe_blocks, tp_mesh=tp_mesh)
    retie(model, ties)
    log.info("tensor parallel tp=%d sp=%s: %d modules sharded", tp, sp, len(layer_plan))
    return model


def _hook_sequence(model: nn.Module, modules: dict[str, nn.Module], styles: dict[str, str], *, regions: set[str],
                   moe_blocks: list[str], tp_mesh: DeviceMesh) -> None:
    """Sequence parallel hooks: gather before each region and MoE block, scatter at the first layer and after each
    MoE block, gather before a replicated LM head (module docstring)."""
    for fqn in sorted(regions):
        modules[fqn].register_forward_pre_hook(_gather_sequence_hook(tp_mesh), with_kwargs=True)
    for fqn in moe_blocks:
        modules[fqn].register_forward_pre_hook(_gather_sequence_hook(tp_mesh), with_kwargs=True)
        modules[fqn].register_forward_hook(lambda _m, _args, out: _scatter(out, tp_mesh))
    first = _first_layer(modules, styles)
    if first is not None:
        modules[first].register_forward_pre_hook(_scatter_sequence_hook(tp_mesh), with_kwargs=True)
    head = modules.get("lm_head")
    if head is not None and styles.get("lm_head", "replicate") not in ("vocab_head", "colwise"):
        # a replicated head reads the whole sequence: gather it (the vocab_head's colwise input does that)
        head.register_forward_pre_hook(_gather_sequence_hook(tp_mesh), with_kwargs=True)


def loss_parallel_works(tp_mesh: DeviceMesh) -> bool:
    """Run a tiny vocab-sharded cross-entropy (forward + backward) on ``tp_mesh`` and compare with the dense one.
    True without a probe on the ``fake`` backend (``autopar check``), whose collectives compute nothing: it stands
    in for an accelerator cluster, where NCCL runs loss parallel."""
    if dist.get_backend(tp_mesh.get_group()) == "fake":
        return True
    gen = torch.Generator().manual_seed(0)
    vocab = 4 * tp_mesh.size()
    logits = torch.randn(6, vocab, generator=gen)
    target = torch.randint(0, vocab, (6,), generator=gen)
    device = tp_mesh.device_type
    try:
        dl = distribute_tensor(logits.to(device), tp_mesh, [Shard(1)]).requires_grad_(True)
        with loss_parallel():
            loss = F.cross_entropy(dl, target.to(device))
            loss.backward()
        got = loss.full_tensor() if isinstance(loss, DTensor) else loss
        ref = logits.clone().requires_grad_(True)
        want = F.cross_entropy(ref, target)
        want.backward()
        return bool(
            torch.allclose(got.cpu(), want, atol=1e-5) and torch.allclose(dl.grad.full_tensor().cpu(), ref.grad, atol=1e-5)
        )
    except Exception as e:  # noqa: BLE001 - any failure means: fall back to gathered logits
        log.warning("loss_parallel probe raised %s: %s", type(e).__name__, e)
        return False


# --- plan -> styles ---------------------------------------------------------------------------------------


def _styles_present(model: nn.Module, shardings: tuple[ModuleSharding, ...], *, strict: bool) -> dict[str, str]:
    """Module FQN -> style of the plan's entries in ``model``; ``expert`` entries are left to expert parallel."""
    modules = dict(model.named_modules())
    styles: dict[str, str] = {}
    for m in shardings:
        if m.style == "expert":
            continue
        if m.fqn not in modules:
            if strict:
                raise PlanMismatchError(
                    f"plan shards module {m.fqn!r} ({m.style}) but the model has no such module: "
                    "re-plan for this model"
                )
            continue
        styles[m.fqn] = m.style
    return styles


def holds_vocab_head(model: nn.Module, shardings: tuple[ModuleSharding, ...]) -> bool:
    """Whether one of ``model``'s modules is a ``vocab_head`` in ``shardings``."""
    return "vocab_head" in _styles_present(model, shardings, strict=False).values()


def _style_object(style: str, *, sp: bool, in_region: bool, loss_parallel_ok: bool, local_logits: bool = False) -> Any:
    seq = Shard(-2)
    if style == "colwise":
        return ColwiseParallel(input_layouts=seq if sp and not in_region else Replicate())
    if style == "rowwise":
        return RowwiseParallel(output_layouts=seq if sp else Replicate())
    if style == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "vocab_head":
        if loss_parallel_ok:
            return ColwiseParallel(
                input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1), use_local_output=local_logits
            )
        return ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
    if style == "sequence_parallel":
        return SequenceParallel(sequence_dim=-2, use_local_output=True)
    raise ConfigError(f"no tensor-parallel rule for style {style!r}")


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _check_divisible(modules: dict[str, nn.Module], styles: dict[str, str], tp: int) -> None:
    for fqn, style in styles.items():
        mod = modules[fqn]
        if style in ("colwise", "vocab_head", "rowwise"):
            if not isinstance(mod, nn.Linear):
                raise ConfigError(f"module {fqn} is {type(mod).__name__}, style {style!r} needs nn.Linear")
            n = mod.in_features if style == "rowwise" else mod.out_features
            if n % tp:
                raise ConfigError(f"module {fqn}: {n} features not divisible by tp={tp}; choose tp dividing {n}")
        if style == "vocab_embedding":
            if not isinstance(mod, nn.Embedding):
                raise ConfigError(f"module {fqn} is {type(mod).__name__}, style vocab_embedding needs nn.Embedding")
            if mod.num_embeddings % tp:
                raise ConfigError(
                    f"module {fqn}: vocabulary {mod.num_embeddings} not divisible by tp={tp}; pad the vocabulary"
                )


HEAD_COUNT_ATTRS = ("num_heads", "num_key_value_heads", "num_attention_heads", "num_kv_heads", "n_head", "n_heads",
                    "n_kv_heads", "heads", "kv_heads")
"""Attribute names of head counts an attention module may reshape with (HF: ``num_heads`` /
``num_key_value_heads``; nanoGPT ``n_head``; hand-written models ``heads``)."""


def _divide_heads(modules: dict[str, nn.Module], styles: dict[str, str], tp: int) -> None:
    """Local head counts on attention modules that reshape with an explicit head count: on the parent of colwise
    linears (q / k / v), each integer ``HEAD_COUNT_ATTRS`` attribute it has is divided by tp, once per module."""
    for parent in sorted({_parent(f) for f, style in styles.items() if style == "colwise"}):
        attn = modules.get(parent)
        for attr in HEAD_COUNT_ATTRS:
            n = getattr(attn, attr, None)
            if isinstance(n, int) and not isinstance(n, bool):
                if n % tp:
                    raise ConfigError(f"{parent}.{attr}={n} not divisible by tp={tp}; choose tp dividing {n}")
                setattr(attn, attr, n // tp)


# --- sequence parallel ------------------------------------------------------------------------------------


def _sp_regions(modules: dict[str, nn.Module], styles: dict[str, str]) -> set[str]:
    """Parents of colwise linears that own no sequence-parallel module: their input must be gathered."""
    sp_parents = {_parent(f) for f, s in styles.items() if s == "sequence_parallel"}
    return {_parent(f) for f, s in styles.items() if s == "colwise" and _parent(f) not in sp_parents}


def _first_layer(modules: dict[str, nn.Module], styles: dict[str, str]) -> str | None:
    """``<layers>.0`` of the ModuleList holding the sequence-parallel layers, if this module holds it."""
    for fqn, style in styles.items():
        if style != "sequence_parallel":
            continue
        parts = fqn.split(".")
        for i in range(len(parts) - 1, 0, -1):
            owner = ".".join(parts[:i])
            if isinstance(modules.get(owner), nn.ModuleList):
                first = f"{owner}.0"
                return first if first in modules else None
    return None


def _moe_blocks(modules: dict[str, nn.Module], shardings: tuple[ModuleSharding, ...]) -> list[str]:
    """FQNs of the MoE blocks in ``modules``: the parents of the plan's ``expert`` modules."""
    return sorted({_parent(m.fqn) for m in shardings if m.style == "expert" and _parent(m.fqn) in modules})


def _check_sp_region_covered(model: nn.Module, modules: dict[str, nn.Module], styles: dict[str, str], *,
                             exempt: list[str]) -> None:
    """Under SP every parameter of a layer sees only local tokens: it must be TP-sharded or SequenceParallel, or
    sit in an ``exempt`` module that runs on the gathered sequence (a MoE block)."""
    first = _first_layer(modules, styles)
    if first is None:
        return
    owner = _parent(first)
    covered = [f for f, s in styles.items() if s in _TP_STYLES] + list(exempt)
    for name, _ in model.named_parameters():
        if not name.startswith(owner + "."):
            continue
        mod_fqn = _parent(name)
        if not any(mod_fqn == c or mod_fqn.startswith(c + ".") for c in covered):
            raise ConfigError(
                f"sequence parallel: parameter {name} is in the sequence-sharded layers but its module has no "
                "colwise / rowwise / sequence_parallel style, so its gradient would be a per-rank partial sum; "
                "plan without sequence_parallel or shard that module"
            )


def _gather_sequence_hook(tp_mesh: DeviceMesh):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (_gather(args[0], tp_mesh), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": _gather(kwargs["hidden_states"], tp_mesh)}
        raise ConfigError(f"{type(module).__name__}: no hidden_states input to gather for sequence parallel")

    return hook


def _scatter_sequence_hook(tp_mesh: DeviceMesh):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (_scatter(args[0], tp_mesh), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": _scatter(kwargs["hidden_states"], tp_mesh)}
        raise ConfigError(f"{type(module).__name__}: no hidden_states input to shard for sequence parallel")

    return hook


def _gather(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    # (B, T/tp, H) local -> (B, T, H) local; backward: reduce-scatter of the partial input gradients
    return DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False).redistribute(tp_mesh, [Replicate()]).to_local()


def _scatter(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    if x.shape[1] % tp_mesh.size():
        raise ConfigError(
            f"sequence parallel: sequence length {x.shape[1]} not divisible by tp={tp_mesh.size()}; "
            "pad the sequence or plan without sequence_parallel"
        )
    # (B, T, H) replicated -> (B, T/tp, H) local chunk; backward: all-gather
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(1)]).to_local()
