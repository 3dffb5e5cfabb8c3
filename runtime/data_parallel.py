"""Data parallelism per the plan's ZeRO stage, over the batch axis of the mesh ("dp", times "ep"; times "cp" under
context parallel, whose ranks hold parts of the same sequences: ``runtime.mesh.grad_mesh``).

- ZeRO 3: FSDP2 ``fully_shard`` on every transformer layer (the children of the model's ModuleLists) and on the
  root, ``reshard_after_forward=True``: parameters, gradients and optimizer state sharded (Rajbhandari et al. 2020).
- ZeRO 2 and ZeRO 1: ``fully_shard(..., reshard_after_forward=False)``: the optimizer state is sharded and the
  parameters stay gathered from the first forward to the last backward of a step (one all-gather per step).
  FSDP2 keeps the parameters sharded *between* steps. The two differ in gradient accumulation over the plan's
  micro-batches (``gradient_sync``): ZeRO 2 reduce-scatters every micro-batch's gradients into the sharded
  gradient (m reduce-scatters a step, gradients sharded); ZeRO 1 accumulates the unsharded gradients and
  reduce-scatters once, after the last micro-batch (one reduce-scatter a step, full gradients held until
  then), as torch's pipelining does by default. With one micro-batch they are the same.
- ZeRO 3 reduce-scatters every micro-batch and reshards after forward and after backward.
- Mixed precision: on CUDA, FSDP2 ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (as
  torchtitan trains) for ``fully_shard`` and ``replicate`` alike: fp32 sharded parameters, gradients and optimizer
  states, bf16 gathered parameters and compute, gradients reduced in fp32 (``mixed_precision``); the modes
  without that policy (DDP, no wrapper) keep fp32 parameters and compute under bf16 autocast on CUDA
  (``compute_autocast``). On CPU (whose bf16 is emulated) none: parameters are gathered and gradients reduced in
  the parameters' own dtype.
- ZeRO 0: ``DistributedDataParallel`` when no parameter is a DTensor; with tensor parallel (DTensor parameters,
  which DDP cannot bucket) FSDP2's replicate (``torch.distributed._composable.replicate_with_fsdp.replicate``:
  parameters replicated over dp, gradients all-reduced; on CUDA under ``mixed_precision`` as ZeRO 1-3, so the tp
  collectives move the bf16 the plan priced). In a pipeline and with expert parallel ZeRO 0 has no
  wrapper: ``ParallelModel.step`` calls ``average_gradients`` after the backward (``averages_by_hand``).
- Expert parallel (``expert_fqns``): each experts module first gets its own ``fully_shard`` over the outer ``dp``
  axis (the ranks holding the same experts: their gradients already hold the mean over ep, see
  ``runtime.expert_parallel``), the rest is sharded over dp x ep as without experts.
Gradients are averaged over the batch ranks in every case, so a per-rank mean loss gives the global-mean gradient.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from costmodel.errors import ConfigError
from planner.plan import Plan
from runtime.mesh import grad_mesh

log = logging.getLogger(__name__)


def averages_by_hand(plan: Plan, mesh: DeviceMesh, *, pipelined: bool) -> bool:
    """True where no wrapper averages the gradients and ``average_gradients`` must: ZeRO 0 over more than one
    batch rank in a pipeline (the stages run their own backward) or with expert parallel (expert gradients
    average over ``dp`` only)."""
    return plan.zero_stage == 0 and grad_mesh(mesh).size() > 1 and (pipelined or plan.degrees.ep > 1)


def wraps_with_ddp(model: nn.Module, *, plan: Plan, mesh: DeviceMesh) -> bool:
    """True when ``apply_data_parallel`` will wrap ``model`` in DDP (which needs materialised parameters)."""
    return (plan.zero_stage == 0 and grad_mesh(mesh).size() > 1
            and not any(isinstance(p, DTensor) for p in model.parameters()))


def mixed_precision(device_type: str) -> MixedPrecisionPolicy | None:
    """The FSDP2 mixed-precision policy the runtime shards with on ``device_type``: bf16 parameters for compute
    and the all-gather, fp32 gradient reduction on CUDA (torchtitan's TrainingConfig defaults); None on CPU."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def compute_autocast(modules: Iterable[nn.Module], device_type: str) -> contextlib.AbstractContextManager:
    """The autocast a step runs under: on CUDA, bf16 for modules whose compute no FSDP2 ``MixedPrecisionPolicy``
    casts (DDP, no data-parallel wrapper: fp32 parameters), as torchtitan's
    ``maybe_enable_amp`` does, so they compute in the bf16 the plan priced; none on CPU (emulated bf16: the
    measurement wing chooses the dtype there) or where FSDP2 (``fully_shard`` or ``replicate`` under
    ``mixed_precision``) casts the parameters itself."""
    if device_type != "cuda":
        return contextlib.nullcontext()
    for root in modules:
        for m in root.modules():
            if isinstance(m, FSDPModule) and m._get_fsdp_state()._mp_policy.param_dtype is not None:
                return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.bfloat16)


def gradient_sync(plan: Plan) -> tuple[bool, bool]:
    """How FSDP2 treats a micro-batch's backward that is not the step's last: ``(reduce, reshard)``, whether it
    reduce-scatters the gradients (ZeRO 2 / 3; ZeRO 1 accumulates them unsharded) and whether it reshards the
    parameters afterwards (ZeRO 3). The last backward of a step always does both."""
    return plan.zero_stage >= 2, plan.zero_stage == 3


def set_microbatch_sync(module: nn.Module, plan: Plan, *, last: bool) -> None:
    """Set ``gradient_sync`` on the FSDP2 modules of ``module`` for the coming backward (``last``: the step's
    last micro-batch, which reduces and reshards)."""
    if not isinstance(module, FSDPModule):
        return
    reduce, reshard = gradient_sync(plan)
    module.set_requires_gradient_sync(reduce or last)
    module.set_reshard_after_backward(reshard or last)
    module.set_is_last_backward(reduce or last)


def apply_data_parallel(model: nn.Module, *, plan: Plan, mesh: DeviceMesh,
                        expert_fqns: Iterable[str] = (), mp_policy: MixedPrecisionPolicy | None | str = "auto",
                        blocks: Iterable[nn.Module] | None = None) -> nn.Module:
    """Wrap ``model`` for data parallelism over the batch axis; returns the module to call (DDP may wrap it).

    ``mp_policy``: the FSDP2 mixed precision of ZeRO 1-3 and of ZeRO 0's replicate; ``"auto"``: ``mixed_precision`` of the mesh's device.
    ``blocks``: the modules that get their own FSDP2 unit (None: ``transformer_blocks(model)``; a pipeline chunk
    passes its layers, which sit in plain containers there, not in a ModuleList)."""
    dp_mesh = grad_mesh(mesh)  # the batch axes, times cp when context parallel
    if dp_mesh.size() == 1:
        return model
    zero = plan.zero_stage
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={zero} must be 0, 1, 2 or 3")
    if wraps_with_ddp(model, plan=plan, mesh=mesh):
        if any(p.is_meta for p in model.parameters()):
            raise ConfigError("DDP (zero_stage=0) needs materialised parameters: call runtime.materialize first")
        log.info("data parallel: DDP over %d ranks", dp_mesh.size())
        return DistributedDataParallel(model, process_group=dp_mesh.get_group())
    policy = mixed_precision(mesh.device_type) if isinstance(mp_policy, str) else mp_policy
    kw = {"mp_policy": policy} if policy is not None else {}
    if zero == 0:  # the same policy as ZeRO 1-3: the bf16 compute (and tp collectives) the plan priced
        for block in transformer_blocks(model) if blocks is None else blocks:
            replicate(block, mesh=dp_mesh, **kw)
        replicate(model, mesh=dp_mesh, **kw)
        log.info("data parallel: FSDP2 replicate (DDP semantics) over %d ranks with DTensor parameters%s",
                 dp_mesh.size(), ", bf16 parameters / fp32 reduction" if policy is not None else "")
        return model
    reshard = zero == 3
    for fqn in expert_fqns:  # the experts' own unit over the ranks that hold them (module docstring)
        fully_shard(model.get_submodule(fqn), mesh=mesh["dp"], reshard_after_forward=reshard, **kw)
    for block in transformer_blocks(model) if blocks is None else blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, **kw)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, **kw)
    log.info("data parallel: FSDP2 zero=%d over %d ranks%s", zero, dp_mesh.size(),
             ", bf16 parameters / fp32 reduction" if policy is not None else "")
    return model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers: children of every ModuleList, in registration order."""
    return [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 and replicate modify in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES
"""DDP's first gradient bucket (1 MiB: the last layers' gradients, reduced early)."""
BUCKET_BYTES = 25 * 2**20
"""DDP's other buckets (``bucket_cap_mb=25``, its default, in MiB)."""


def gradient_buckets(numel: int, element_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` element ranges of a flat gradient of ``numel`` elements in DDP's bucket sizes: the first
    ``FIRST_BUCKET_BYTES``, then ``BUCKET_BYTES`` each (the step model counts the same:
    ``costmodel.step.ddp_buckets``)."""
    first, rest = FIRST_BUCKET_BYTES // element_size, BUCKET_BYTES // element_size
    out, start = [], 0
    while start < numel:
        end = min(numel, start + (first if not out else rest))
        out.append((start, end))
        start = end
    return out


def average_gradients(named_params: Iterable[tuple[str, nn.Parameter]], *, mesh: DeviceMesh,
                      expert_params: frozenset[str] = frozenset()) -> None:
    """Average the gradients in place as one process would, where no wrapper does (``averages_by_hand``).

    Expert gradients (names in ``expert_params``) already hold the mean over ep (the all-to-all backward, scaled
    by 1/ep): averaged over the outer ``dp`` axis. Every other gradient (the local shard of a TP DTensor, or a
    plain tensor) over the batch ranks (``grad_mesh``). Nothing over tp: every tp rank computed the same.
    Each group's gradients, last parameter first (the order DDP fills its buckets in), are all-reduced as one
    flat sequence cut into DDP's buckets (``gradient_buckets``): one collective per bucket, not per tensor.
    A gradient replicated over tp where its parameter is sharded (DTensor's embedding backward makes a
    vocabulary-parallel embedding's gradient whole on every tp rank) is cut to the parameter's shard first, a
    local slice: what is reduced, and kept for the optimizer, is the rank's shard, as the step model prices it."""
    groups: dict[str, tuple[DeviceMesh, list[torch.Tensor]]] = {"dense": (grad_mesh(mesh), []),
                                                                "expert": (mesh["dp"], [])}
    for name, p in named_params:
        if p.grad is not None:
            if (isinstance(p.grad, DTensor) and isinstance(p, DTensor) and p.grad.placements != p.placements
                    and all(pl.is_replicate() for pl in p.grad.placements)):
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            groups["expert" if name in expert_params else "dense"][1].append(g)
    for group, grads in groups.values():
        if group.size() > 1:
            for dtype in dict.fromkeys(g.dtype for g in grads):
                _all_reduce_bucketed([g for g in reversed(grads) if g.dtype == dtype], group)


def _all_reduce_bucketed(grads: list[torch.Tensor], group: DeviceMesh) -> None:
    """Mean over ``group`` of ``grads`` (one dtype, contiguous), one all-reduce per bucket of their flat
    concatenation, copied back."""
    flat = [g.view(-1) for g in grads]
    offsets = [0]
    for f in flat:
        offsets.append(offsets[-1] + f.numel())
    for lo, hi in gradient_buckets(offsets[-1], grads[0].element_size()):
        parts = [(i, max(lo, offsets[i]) - offsets[i], min(hi, offsets[i + 1]) - offsets[i])
                 for i in range(len(flat)) if offsets[i] < hi and offsets[i + 1] > lo]
        bucket = torch.cat([flat[i][a:b] for i, a, b in parts])
        dist.all_reduce(bucket, group=group.get_group())
        bucket.div_(group.size())
        pos = 0
        for i, a, b in parts:
            flat[i][a:b].copy_(bucket[pos:pos + b - a])
            pos += b - a
