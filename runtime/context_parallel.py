"""Context parallel (cp): every cp rank holds a slice of each sequence; attention all-gathers K and V.

Why not ``torch.distributed.tensor.experimental.context_parallel``: in torch 2.13 it is ring attention that
replaces the CUDA SDPA kernels (flash, memory-efficient, cuDNN) only. On CPU, SDPA dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu``, which it does not handle: on 2 gloo ranks it raises
``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered``. So the runtime runs the all-gather form of context parallelism (Llama 3 paper,
Dubey et al. 2024, Sec. 3.3.2) itself, the same on every backend:

- Split (load-balanced): the T tokens of a sequence are cut into ``2 cp`` chunks of ``T / (2 cp)``; cp rank r
  holds chunks r and ``2 cp - 1 - r``, so under the causal mask every rank has the same attention work (why the
  planner's ``cp_choices`` asks for ``2 cp | T``). Input ids, targets and position ids are split alike; the
  position ids are the global ones, so rotary and learned position embeddings see each token's true position.
- Attention: the local K and V (after rotary) are all-gathered over the cp group, one collective per layer (K and V
  stacked), not overlapped with compute. Each of the rank's two query chunks attends to the keys up to its own end
  with a lower-right-aligned causal mask (SDPA with ``causal_lower_right``: no work on keys after the chunk, and
  fused kernels stay usable on CUDA); sliding-window models use an explicit mask ``key_pos <= query_pos`` and
  ``query_pos - key_pos < window`` over all T keys. The gathered K / V are kept for the backward (no second
  gather). The gather's backward sums every rank's gradient of the gathered K / V and keeps this rank's slice: a
  reduce-scatter on NCCL (and the fake backend, which stands in for an accelerator cluster), an all-reduce and a
  slice on gloo, whose reduce-scatter is the slower (2 CPU ranks, torch 2.13: 51 ms against 8.9 ms for the
  all-reduce of 8 MB). The step model prices the same (``planner.search.strategies._cp_collectives``).
- Loss: each rank's ``loss_fn`` is the mean over its ``T / cp`` tokens (equal counts), so the mean over the cp
  ranks is the mean over all tokens. Gradients of replicated parameters are averaged over the dp x cp ranks (DDP /
  FSDP2 over ``runtime.mesh.grad_mesh``, the gradient and ZeRO group the cost model counts).
- Hook: one stateless function is registered with transformers' attention registry (``AttentionInterface``, its
  documented extension point) under ``CP_ATTENTION``; the model's config selects it and each attention module
  (found by ``runtime.model_adapters``) carries its ``CPAttention`` (group, layout). Other models are untouched.
  transformers builds no causal mask for an implementation without a mask function: this one builds its own.

Runs with tp (heads split inside each cp rank) and dp (any ZeRO stage). Refused: cp with pp > 1 (pipeline chunks
do not carry position ids yet) and with ep > 1 (expert parallel runs with cp = 1); see ``check_context_parallel``.
The loss must be a per-token mean (cross entropy as usual) for the cp average to equal the global mean.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right as _causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes
from torch.distributed.device_mesh import DeviceMesh

from costmodel.errors import ConfigError
from planner.plan import Plan
from runtime.model_adapters import ModelAdapter, adapter_for

log = logging.getLogger(__name__)

CP_ATTENTION = "autopar_cp"
"""The attention implementation name a cp model's config selects."""
_CONTEXT_ATTR = "_autopar_cp"


def causal_lower_right(seq_q: int, seq_kv: int) -> Any:
    """SDPA's lower-right causal bias, made with any ``TorchDispatchMode`` set aside: ``CausalBias`` is a tensor
    subclass built from an empty tensor, which under an active mode (the measurement wing's live-bytes counter and
    collective recorder) already has a plain Python object, so the subclass could not be made."""
    with _disable_current_modes():
        return _causal_lower_right(seq_q, seq_kv)


def check_context_parallel(plan: Plan) -> None:
    """Raise ConfigError for a cp plan this runtime cannot run (the numbers and the fix in the message)."""
    d = plan.degrees
    if d.cp == 1:
        return
    if d.pp > 1:
        raise ConfigError(
            f"plan has cp={d.cp} with pp={d.pp}: context parallel runs without pipeline parallel in this runtime "
            f"(pipeline chunks do not pass global position ids); re-plan with --fix pp=1 or --fix cp=1"
        )
    if d.ep > 1:
        raise ConfigError(
            f"plan has cp={d.cp} with ep={d.ep}: context parallel runs without expert parallel in this runtime; "
            "re-plan with --fix ep=1 or --fix cp=1"
        )
    seq = plan.model.seq_len
    if seq and seq % (2 * d.cp):
        raise ConfigError(
            f"plan has cp={d.cp} but seq_len={seq} does not split into 2 cp = {2 * d.cp} equal chunks (the "
            f"load-balanced causal split); choose cp with {2 * d.cp} | {seq} or another sequence length"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class CPLayout:
    """Which token positions each cp rank holds (load-balanced split, see the module docstring)."""

    cp: int
    rank: int

    def check(self, seq_len: int) -> None:
        if seq_len % (2 * self.cp):
            raise ConfigError(
                f"sequence length {seq_len} does not split into 2 cp = {2 * self.cp} equal chunks for cp={self.cp}; "
                f"use a sequence length divisible by {2 * self.cp}"
            )

    def positions(self, seq_len: int, *, rank: int | None = None, device: Any = None) -> torch.Tensor:
        """(seq_len / cp,) global positions held by ``rank`` (default this rank), in local order."""
        self.check(seq_len)
        r = self.rank if rank is None else rank
        chunk = seq_len // (2 * self.cp)
        first = torch.arange(r * chunk, (r + 1) * chunk, device=device)
        second = torch.arange((2 * self.cp - 1 - r) * chunk, (2 * self.cp - r) * chunk, device=device)
        return torch.cat((first, second))

    def gathered_positions(self, seq_len: int, *, device: Any = None) -> torch.Tensor:
        """(seq_len,) global positions of the all-gathered keys (rank 0's tokens first)."""
        return torch.cat([self.positions(seq_len, rank=r, device=device) for r in range(self.cp)])

    def shard(self, x: torch.Tensor, *, seq_len: int, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` along ``dim`` (which has ``seq_len`` entries)."""
        if x.shape[dim] != seq_len:
            raise ConfigError(f"cp split: dim {dim} of a {tuple(x.shape)} tensor is not the sequence of {seq_len}")
        return x.index_select(dim, self.positions(seq_len, device=x.device))


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over ``group``; backward: sum the gradients of all ranks, keep this rank's part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:  # noqa: D102
        ctx.group, ctx.dim = group, dim
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: D102
        group, dim = ctx.group, ctx.dim
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if dist.get_backend(group) == "gloo":  # its reduce-scatter is slower than its all-reduce (module doc)
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad.chunk(world, dim=dim)[rank].contiguous(), None, None
        parts = [p.contiguous() for p in grad.chunk(world, dim=dim)]
        out = torch.empty_like(parts[rank])
        dist.reduce_scatter(out, parts, group=group)
        return out, None, None


def gather_sequence(x: torch.Tensor, *, group: Any, dim: int) -> torch.Tensor:
    """Autograd-aware all-gather of ``x`` along ``dim`` over ``group`` (rank order)."""
    return _GatherSequence.apply(x, group, dim)


class CPAttention:
    """The per-model context of ``cp_attention``: the cp process group and the split."""

    def __init__(self, *, group: Any, layout: CPLayout) -> None:
        self.group = group
        self.layout = layout


def cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: local queries (B, H, Tq, D) against the K / V of all cp ranks.

    Returns ((B, Tq, H, D), None) as transformers' sdpa function does. ``attention_mask`` is ignored (None for an
    unpadded batch): the causal mask comes from the token positions of the split.
    """
    ctx = getattr(module, _CONTEXT_ATTR, None)
    if not isinstance(ctx, CPAttention):
        raise ConfigError(
            f"{type(module).__name__} runs the {CP_ATTENTION!r} attention but was not prepared by "
            "runtime.context_parallel.apply_context_parallel; apply the cp plan to this model"
        )
    if attention_mask is not None and attention_mask.dtype == torch.bool and not bool(attention_mask.all()):
        raise ConfigError("context parallel runs unpadded causal LM batches only: drop the padding attention mask")
    kv = gather_sequence(torch.stack((key, value)), group=ctx.group, dim=3)  # (2, B, Hkv, T, D), rank order
    out = attend_gathered(
        query, kv, layout=ctx.layout, scaling=scaling, dropout=dropout, sliding_window=sliding_window
    )
    return out.transpose(1, 2).contiguous(), None


def attend_gathered(
    query: torch.Tensor,
    kv: torch.Tensor,
    *,
    layout: CPLayout,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries (B, H, T / cp, D) to the gathered ``kv`` (2, B, Hkv, T, D) in rank
    order (what the all-gather returns); (B, H, T / cp, D). Pure: no communication."""
    seq_len = query.shape[2] * layout.cp
    if sliding_window is not None:  # explicit mask over all T keys
        key, value = _repeat_kv(kv[0], kv[1], heads=query.shape[1])
        q_pos = layout.positions(seq_len, device=query.device)[:, None]  # (Tq, 1)
        k_pos = layout.gathered_positions(seq_len, device=query.device)[None, :]  # (1, T)
        mask = (k_pos <= q_pos) & (q_pos - k_pos < sliding_window)  # (Tq, T), True = attend
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    kv = _sequence_order(kv, cp=layout.cp)
    key, value = _repeat_kv(kv[0], kv[1], heads=query.shape[1])
    chunk, r = seq_len // (2 * layout.cp), layout.rank
    outs = []
    for q_chunk, end in ((query[:, :, :chunk], (r + 1) * chunk), (query[:, :, chunk:], (2 * layout.cp - r) * chunk)):
        # the chunk's last query is at position end - 1: it sees keys [0, end), lower-right aligned
        outs.append(F.scaled_dot_product_attention(
            q_chunk, key[:, :, :end], value[:, :, :end], attn_mask=causal_lower_right(chunk, end),
            dropout_p=dropout, scale=scaling,
        ))
    return torch.cat(outs, dim=2)


def _sequence_order(kv: torch.Tensor, *, cp: int) -> torch.Tensor:
    """(2, B, H, T, D) gathered in rank order (rank r: chunks r, 2 cp - 1 - r) -> chunks in sequence order."""
    two, b, h, t, d = kv.shape
    parts = kv.view(two, b, h, cp, 2, t // (2 * cp), d)  # (.., rank, which half, chunk tokens, D)
    ordered = torch.cat((parts[:, :, :, :, 0], parts[:, :, :, :, 1].flip(3)), dim=3)  # chunks 0..cp-1, cp..2cp-1
    return ordered.reshape(two, b, h, t, d)


def _repeat_kv(key: torch.Tensor, value: torch.Tensor, *, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: repeat each kv head for its query heads."""
    if key.shape[1] == heads:
        return key, value
    rep = heads // key.shape[1]
    return key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention)  # idempotent: same name, same function


class ContextParallel:
    """What ``ParallelModel.step`` needs for cp: split a batch, the model's position keyword arguments."""

    def __init__(self, *, layout: CPLayout, adapter: ModelAdapter, group: Any) -> None:
        self.layout = layout
        self.adapter = adapter
        self.group = group

    @property
    def size(self) -> int:
        return self.layout.cp

    def shard_batch(self, inputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) input ids and (B, T) targets -> this rank's (B, T / cp) of each."""
        if isinstance(inputs, (tuple, list)):
            if len(inputs) != 1:
                raise ConfigError(
                    f"context parallel takes input ids only (unpadded causal LM), got a tuple of {len(inputs)} "
                    "inputs; pass step(input_ids, targets)"
                )
            inputs = inputs[0]
        if inputs.dim() != 2 or tuple(targets.shape[:2]) != tuple(inputs.shape):
            raise ConfigError(
                f"context parallel expects (B, T) input ids and (B, T) targets, got {tuple(inputs.shape)} and "
                f"{tuple(targets.shape)}"
            )
        seq_len = inputs.shape[1]
        return self.layout.shard(inputs, seq_len=seq_len), self.layout.shard(targets, seq_len=seq_len)

    def model_kwargs(self, local_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The global position ids of this rank's tokens, as the model's forward takes them."""
        seq_len = local_ids.shape[1] * self.layout.cp
        positions = self.layout.positions(seq_len, device=local_ids.device).unsqueeze(0)  # (1, T / cp)
        return self.adapter.cp_model_kwargs(positions)


def apply_context_parallel(model: nn.Module, *, plan: Plan, mesh: DeviceMesh) -> ContextParallel | None:
    """Route ``model``'s attention through ``cp_attention`` over ``mesh["cp"]``; None when cp = 1.

    Touches no parameter (meta-device models are fine); call before data parallel wraps the model.
    """
    check_context_parallel(plan)
    cp = plan.degrees.cp
    if cp == 1:
        return None
    if mesh["cp"].size() != cp:
        raise ConfigError(
            f"mesh cp axis has {mesh['cp'].size()} ranks but the plan has cp={cp}: build the mesh from the plan"
        )
    adapter = adapter_for(model, purpose="context parallelism")
    attention = adapter.attention_modules(model)
    if not attention:
        raise ConfigError(f"found no attention modules in {type(model).__name__} to run context parallel")
    layout = CPLayout(cp=cp, rank=mesh["cp"].get_local_rank())
    context = CPAttention(group=mesh["cp"].get_group(), layout=layout)
    _register_attention()
    for module in attention:
        setattr(module, _CONTEXT_ATTR, context)
    model.config._attn_implementation = CP_ATTENTION
    log.info("context parallel: cp=%d, this rank holds sequence chunks %d and %d of %d", cp, layout.rank,
             2 * cp - 1 - layout.rank, 2 * cp)
    return ContextParallel(layout=layout, adapter=adapter, group=context.group)
