"""Materialise a (possibly meta-device, possibly sharded) model deterministically.

Every parameter and buffer is initialised from a seed derived from ``(seed, module FQN)``, independent of rank,
world size and parallelization. For each module the full tensors of its *direct* parameters are built on CPU in a
shallow clone (one module at a time, so the transient peak is one module's full parameters, never the model), the
model's own init rule is run on the clone (Hugging Face ``PreTrainedModel._init_weights`` when the root has it,
else ``reset_parameters()``, else the caller's ``init_fn``), and each rank keeps only its local shard: for a
DTensor parameter (TP, FSDP2, or both) the chunk ``distribute_tensor(full, mesh, placements, src_data_rank=None)``
assigns to this rank (no communication: every rank computes the same full tensor), copied into the storage that
``to_empty`` allocated for the local shard. The single-process reference built with the same seed gets the same
values, so a parallel run can be compared with it number for number.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from costmodel.errors import ConfigError

log = logging.getLogger(__name__)

InitFn = Callable[[str, nn.Module], None]


def module_seed(seed: int, fqn: str) -> int:
    """The RNG seed of one module: a hash of the run seed and the module's FQN."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def materialize(
    model: nn.Module,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    init_fn: InitFn | None = None,
    init_owner: nn.Module | None = None,
) -> nn.Module:
    """Allocate only the local shards of ``model`` on ``device`` and fill them deterministically; returns ``model``.

    ``init_fn(module_fqn, clone)`` initialises the direct parameters / buffers of a CPU clone of a module that
    neither the model's ``_init_weights`` nor ``reset_parameters`` initialises. ``init_owner``: the full model
    whose ``_init_weights`` to use when ``model`` is a piece of it (a pipeline chunk keeps the model's FQNs).
    """
    device = torch.device(device)
    ties = tied_parameters(model)
    model.to_empty(device=device)  # allocates each module's parameters separately: ties are lost here
    retie(model, ties)
    hf_init = getattr(init_owner if init_owner is not None else model, "_init_weights", None)
    done: set[int] = set()
    for fqn, module in model.named_modules():
        tensors = {
            **{k: v for k, v in module._parameters.items() if v is not None},
            **{k: v for k, v in module._buffers.items() if v is not None},
        }
        todo = {k: v for k, v in tensors.items() if id(v) not in done}
        if not todo:
            continue
        full = _init_module_full(fqn, module, seed=seed, hf_init=hf_init, init_fn=init_fn)
        with torch.no_grad():
            for name, t in todo.items():
                _copy_local_shard(t, full[name].to(device))
                done.add(id(t))
    return model


def _init_module_full(
    fqn: str, module: nn.Module, *, seed: int, hf_init: Callable | None, init_fn: InitFn | None
) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors for the direct parameters and buffers of ``module``."""
    # copy.copy without type(module).__new__: FSDP2's module class re-runs __init__ there (fails for modules
    # whose __init__ takes arguments, e.g. an FSDP-wrapped MixtralExperts)
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone._modules = {}
    clone._parameters = {
        k: None if v is None else nn.Parameter(_nan_like(v), requires_grad=v.requires_grad)
        for k, v in module._parameters.items()
    }
    clone._buffers = {k: None if v is None else _nan_like(v) for k, v in module._buffers.items()}
    attempts: list[Callable[[], None]] = []
    if hf_init is not None:
        attempts.append(lambda: hf_init(clone))
    if hasattr(clone, "reset_parameters"):
        attempts.append(clone.reset_parameters)
    if init_fn is not None:
        attempts.append(lambda: init_fn(fqn, clone))
    for attempt in attempts:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(seed, fqn))
            with torch.no_grad():
                attempt()
        missing = _uninitialised(clone)
        if not missing:
            break
    else:
        raise ConfigError(
            f"module {fqn or '(root)'} ({type(module).__name__}): no init rule set {_uninitialised(clone)}; "
            "give it reset_parameters() or pass init_fn=... to materialize"
        )
    out = {k: v.detach() for k, v in clone._parameters.items() if v is not None}
    out.update({k: v for k, v in clone._buffers.items() if v is not None})
    return out


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    shape = tuple(t.shape)  # the global shape for a DTensor
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=t.dtype)
    return torch.zeros(shape, dtype=t.dtype)


def _uninitialised(clone: nn.Module) -> list[str]:
    names = []
    for k, v in [*clone._parameters.items(), *clone._buffers.items()]:
        if v is not None and (v.dtype.is_floating_point or v.dtype.is_complex) and torch.isnan(v).any():
            names.append(k)
    return names


def _copy_local_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def tied_parameters(model: nn.Module) -> list[tuple[str, str]]:
    """(owner FQN, alias FQN) pairs of parameters shared between modules (tied embeddings)."""
    seen: dict[int, str] = {}
    ties = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            ties.append((seen[id(p)], name))
        else:
            seen[id(p)] = name
    return ties


def retie(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    """Make each alias the owner's parameter object again; refuse ties whose shardings differ."""
    for owner, alias in ties:
        src = model.get_parameter(owner)
        dst = model.get_parameter(alias)
        if src is dst:
            continue
        src_p = getattr(src, "placements", None)
        dst_p = getattr(dst, "placements", None)
        if src_p != dst_p or tuple(src.shape) != tuple(dst.shape):
            raise ConfigError(
                f"tied parameters {owner} ({src_p}) and {alias} ({dst_p}) got different shardings; give both "
                "modules matching styles (vocab_embedding + vocab_head) or untie them"
            )
        mod_fqn, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(mod_fqn), attr, src)


def local_numel(model: nn.Module) -> int:
    """Elements this rank stores for the model's parameters (local shards only)."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
