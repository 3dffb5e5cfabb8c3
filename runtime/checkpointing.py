"""Activation checkpointing (recomputation) per transformer layer, keeping every parameter FQN unchanged.

Modes (``planner.plan.RECOMPUTE``):

- ``none``: autograd keeps every activation.
- ``full``: the whole layer runs under ``torch.utils.checkpoint`` (non-reentrant); only the layer input is kept
  and the layer forward runs again during backward (Megatron "full" recomputation, one extra forward).
- ``selective``: the layer runs under selective activation checkpointing: the outputs of every op are saved
  except those of the attention core (scaled-dot-product attention kernels and softmax), which are recomputed
  in backward (Korthikanti et al. 2022, "selective activation recomputation": the ``5as/h`` term of the
  activation memory goes away, the linear layers are not recomputed).

Per pipeline chunk (or the whole model at pp = 1) the plan's ``StagePlan`` says the mode and how many of the
chunk's transformer layers, from its first, run with it (``recompute_layers``; Megatron-LM's
``--recompute-num-layers``): ``apply_stage_recompute``.

The layer's ``forward`` is replaced on the instance (not wrapped in another module), so ``named_parameters``,
``state_dict`` keys, TP / FSDP plans keyed by FQN and the pipeline cut all see the same names as before.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from costmodel.errors import ConfigError, PlanMismatchError
from planner.plan import RECOMPUTE, StagePlan

logger = logging.getLogger(__name__)

_ORIG_FORWARD = "_autopar_orig_forward"
_MODE_ATTR = "_autopar_recompute"


def _attention_core_ops() -> frozenset[Any]:
    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_softmax",
        "_safe_softmax",
    )
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _selective_policy(ops: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE if op in ops else CheckpointPolicy.MUST_SAVE


def _context_fn() -> Any:
    policy = functools.partial(_selective_policy, _attention_core_ops())
    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward: Callable[..., Any], mode: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if mode == "full":
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_context_fn, **kwargs)

    return run


def set_recompute(module: nn.Module, mode: str) -> nn.Module:
    """Make ``module`` (one transformer layer) recompute per ``mode``; idempotent, ``none`` undoes it."""
    if mode not in RECOMPUTE:
        raise ConfigError(f"recompute={mode!r} is unknown; choose one of {RECOMPUTE}")
    if mode == "selective" and any(isinstance(getattr(m, "experts", None), nn.Module) for m in module.modules()):
        raise ConfigError(
            f"recompute='selective' cannot run on the MoE layer {type(module).__name__}: its router changes a "
            "tensor that selective checkpointing saved; use recompute='full' or 'none' (--fix recompute=full)"
        )
    orig = module.__dict__.get(_ORIG_FORWARD)
    if orig is not None:  # undo an earlier setting first
        del module.__dict__[_ORIG_FORWARD]
        module.__dict__.pop("forward", None)
    if mode == "none":
        module.__dict__.pop(_MODE_ATTR, None)
        return module
    forward = module.forward  # the bound class method
    module.__dict__[_ORIG_FORWARD] = forward
    module.__dict__["forward"] = _checkpointed(forward, mode)
    module.__dict__[_MODE_ATTR] = mode
    return module


def recompute_mode(module: nn.Module) -> str:
    return module.__dict__.get(_MODE_ATTR, "none")


def apply_activation_checkpointing(model: nn.Module, *, layer_fqns: Iterable[str], mode: str) -> nn.Module:
    """Set ``mode`` on each layer named in ``layer_fqns`` (module FQNs of ``model``); returns ``model``."""
    names = list(layer_fqns)
    for fqn in names:
        try:
            layer = model.get_submodule(fqn)
        except AttributeError:
            raise ConfigError(
                f"recompute: module {fqn!r} is not in {type(model).__name__}; pass FQNs from "
                "model.named_modules()"
            ) from None
        set_recompute(layer, mode)
    logger.debug("recompute=%s on %d layers", mode, len(names))
    return model


def transformer_layers(model: nn.Module) -> list[str]:
    """FQNs of the repeated layers, in order: the children of every outermost ``nn.ModuleList`` (what the planner
    groups as blocks; a ModuleList inside a layer is part of that layer)."""
    fqns: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not any(name.startswith(f + ".") for f in fqns):
            fqns += [f"{name}.{child}" if name else child for child, _ in m.named_children()]
    return fqns


def apply_stage_recompute(model: nn.Module, *, layer_fqns: Sequence[str], stage: StagePlan) -> list[str]:
    """Recompute the first ``stage.recompute_layers`` (-1, or more than there are: all) of the stage's transformer
    layers ``layer_fqns`` (in execution order) with ``stage.recompute``; the others keep their activations. The
    FQNs recomputed."""
    mode, count = stage.recompute, stage.recompute_layers
    if count < -1:
        raise PlanMismatchError(f"stage {stage.index}: recompute_layers={count} must be >= 0 (or -1: all)")
    if mode == "none" or count == 0:
        return []
    if not layer_fqns:
        raise ConfigError(
            f"recompute={mode} (stage {stage.index}): {type(model).__name__} has no nn.ModuleList of layers to "
            "recompute; re-plan with --fix recompute=none"
        )
    chosen = list(layer_fqns if count == -1 else layer_fqns[:count])
    apply_activation_checkpointing(model, layer_fqns=chosen, mode=mode)
    return chosen
