"""Expert parallel for Mixtral-style MoE layers: experts sharded over the plan's ``ep`` mesh axis, tokens
dispatched to the ranks that own their experts with all-to-all and combined back.

A module the plan marks ``style="expert"`` (e.g. ``model.layers.0.mlp.experts``, a transformers
``MixtralExperts`` with fused ``gate_up_proj`` (E, 2F, H) and ``down_proj`` (E, H, F)) gets:

- its expert parameters as DTensors ``Shard(0)`` over ``mesh["ep"]`` (rank ``r`` holds experts
  ``r*E/ep .. (r+1)*E/ep - 1``; parameter FQNs unchanged, so checkpoints reshard);
- a forward that, per rank (each ``ep`` rank has its own tokens: the batch is split over ``dp`` x ``ep``), sorts
  the (token, expert) assignments of the replicated router by expert, exchanges the counts
  (``all_to_all_single``), sends the token rows to the owners (``torch.distributed.nn.functional
  .all_to_all_single``, differentiable, works on gloo), runs the local experts, sends the results back and
  adds them, weighted by the router, into the output. The router (``gate``) stays replicated.

Gradients: the all-to-all backward delivers to each expert the gradient of every ep rank's local loss, a sum over
the ep group; the forward scales the expert weights' gradient by 1/ep (``_ScaleGrad``), so each expert holds the
mean over its ep group, and what is left is the plain data-parallel average over the ranks that hold the same
experts, the outer ``dp`` axis: FSDP2's reduce-scatter under ZeRO 1-3 (``runtime.data_parallel`` makes each experts
module its own FSDP2 unit over ``dp``, parameters 2-D DTensors (dp, ep); a gradient divide factor of dp x ep would
need PREMUL_SUM, which gloo lacks), ``runtime.data_parallel.average_gradients`` under ZeRO 0. Every other gradient
is averaged over the batch mesh (dp x ep). Together: the gradient of the global mean loss, as one process would
compute it.

With tp > 1 the experts stay whole on their ep rank and are replicated over tp, as is the router: every tp rank
routes the same (replicated) tokens and runs the same all-to-all within its own ep group (ranks with the same tp
index), so expert and router gradients need no reduction over tp. Each rank holds expert parameters / ep (as the
planner's ``expert`` strategy counts them); the expert compute is repeated on the tp ranks. Under sequence parallel
the MoE block runs on the gathered sequence (``runtime.tensor_parallel``). In a pipeline the ep all-to-all runs
among the ranks of one pipeline stage (the ep axis is inside the pp axis), which run the same schedule.
``runtime.parallelize`` applies it all; ``check_expert_plan`` refuses ep not dividing dp (cp with ep:
``runtime.context_parallel.check_context_parallel``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single as a2a_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from costmodel.errors import ConfigError
from planner.plan import Plan

log = logging.getLogger(__name__)

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def _check_experts(fqn: str, module: nn.Module, ep: int) -> int:
    for name in EXPERT_PARAMS:
        if not isinstance(getattr(module, name, None), nn.Parameter):
            raise ConfigError(
                f"module {fqn!r} ({type(module).__name__}) has no expert parameter {name!r}: style 'expert' "
                "supports Mixtral-style experts (fused gate_up_proj (E, 2F, H) and down_proj (E, H, F))"
            )
    experts = module.gate_up_proj.shape[0]
    if experts % ep:
        raise ConfigError(f"module {fqn!r}: {experts} experts do not split over ep={ep}; choose ep dividing {experts}")
    return experts


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """The first routing all-to-all: ``counts[r]`` rows this rank sends to ep rank r -> the rows each sends here."""
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    return recv_counts


def _dispatch(x: torch.Tensor, counts: torch.Tensor, group: Any) -> tuple[torch.Tensor, list[int], list[int]]:
    """Send ``x`` rows (grouped by destination, ``counts[r]`` rows to rank r); the received rows and the splits."""
    send, recv = counts.tolist(), exchange_counts(counts, group).tolist()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    return a2a_autograd(out, x, output_split_sizes=recv, input_split_sizes=send, group=group), send, recv


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _ep_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    group, ep, local_e = self._autopar_ep_group, self._autopar_ep, self._autopar_local_experts
    n, k = top_k_index.shape
    token = torch.arange(n, device=hidden_states.device).repeat_interleave(k)
    expert = top_k_index.reshape(-1)
    order = torch.argsort(expert, stable=True)
    token, expert = token[order], expert[order]
    weight = top_k_weights.reshape(-1)[order]
    counts = torch.bincount(expert // local_e, minlength=ep)
    recv_x, send, recv = _dispatch(hidden_states[token], counts, group)
    return ep_experts(self, hidden_states, recv_x, expert=expert, token=token, weight=weight, send=send, recv=recv,
                      rows_of=lambda j, recv_e: (recv_e == j).nonzero().squeeze(1))


def ep_experts(self: nn.Module, hidden_states: torch.Tensor, recv_x: torch.Tensor, *, expert: torch.Tensor,
               token: torch.Tensor, weight: torch.Tensor, send: list[int], recv: list[int],
               rows_of: Any) -> torch.Tensor:
    """The part of the expert-parallel forward after the token all-to-all: the local expert ids exchanged, each
    local expert run on its received rows (``rows_of(j, recv_e)``: their indices), the results sent back and
    combined into the tokens' hidden states with their routing weights."""
    group, ep, local_e = self._autopar_ep_group, self._autopar_ep, self._autopar_local_experts
    recv_e = torch.empty(sum(recv), dtype=expert.dtype, device=expert.device)
    dist.all_to_all_single(recv_e, (expert % local_e).contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    gate_up = self.gate_up_proj.to_local() if isinstance(self.gate_up_proj, DTensor) else self.gate_up_proj
    down = self.down_proj.to_local() if isinstance(self.down_proj, DTensor) else self.down_proj
    gate_up, down = _ScaleGrad.apply(gate_up, 1.0 / ep), _ScaleGrad.apply(down, 1.0 / ep)  # (docstring)
    out = torch.zeros_like(recv_x)
    for j in range(local_e):
        idx = rows_of(j, recv_e)
        gate, up = nn.functional.linear(recv_x[idx], gate_up[j]).chunk(2, dim=-1)
        out = out.index_add(0, idx, nn.functional.linear(self.act_fn(gate) * up, down[j]).to(out.dtype))
    back = out.new_empty((sum(send),) + tuple(out.shape[1:]))
    back = a2a_autograd(back, out, output_split_sizes=send, input_split_sizes=recv, group=group)
    contrib = back * weight[:, None].to(back.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, contrib.to(hidden_states.dtype))


def use_grouped_gemm_experts(model: nn.Module) -> bool:
    """Switch a Hugging Face MoE model built with ``experts_implementation="batched_mm"`` (what ``planner.models``
    builds, because torch.export traces it) to ``"grouped_mm"`` for training; True if it did. ``batched_mm`` gathers
    one copy of an expert's weights per (token, expert) pair and its backward makes their gradient: a 2-layer
    Mixtral (hidden 256, 8 experts, top-2, 512 tokens) peaks at 3.8 GB of live tensors that way and at 72 MB with
    ``grouped_mm``, with losses equal and gradients within 2e-8. The cost model prices the grouped GEMM
    (``planner.saved``); the expert-parallel forward below runs its own per-expert GEMMs either way."""
    get = getattr(model, "get_experts_implementation", None)
    if get is None or get().get("") != "batched_mm":
        return False
    model.set_experts_implementation("grouped_mm")
    log.info("experts: batched_mm -> grouped_mm (weights read in place, no per-token weight copies)")
    return True


def apply_expert_parallel(model: nn.Module, *, plan: Plan, mesh: DeviceMesh, strict: bool = True) -> list[str]:
    """Shard the experts of every module the plan marks ``expert`` over ``mesh["ep"]``; their FQNs.

    ``strict=False`` skips plan entries whose module is not in ``model`` (a pipeline chunk holds some layers).
    The experts stay whole on their ep rank and are replicated over tp (module docstring); at ep = 1 they stay
    as they are (replicated)."""
    ep_mesh = mesh["ep"]
    ep = ep_mesh.size()
    if ep == 1:
        return []
    fqns = [m.fqn for m in plan.shardings if m.style == "expert"]
    if not fqns:
        raise ConfigError(f"plan has ep={ep} but marks no module with style 'expert'")
    done = []
    for fqn in fqns:
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            if not strict:
                continue
            raise ConfigError(f"plan shards experts of {fqn!r}, which is not in {type(model).__name__}") from None
        experts = _check_experts(fqn, module, ep)
        for name in EXPERT_PARAMS:
            param = getattr(module, name)
            dt = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(dt, requires_grad=param.requires_grad))
        module._autopar_ep_group = ep_mesh.get_group()
        module._autopar_ep = ep
        module._autopar_local_experts = experts // ep
        module.forward = _ep_forward.__get__(module, type(module))
        done.append(fqn)
    log.info("expert parallel: %d expert modules over ep=%d", len(done), ep)
    return done


def expert_param_names(expert_fqns: list[str]) -> frozenset[str]:
    """The parameter names of the experts modules ``expert_fqns``."""
    return frozenset(f"{f}.{p}" for f in expert_fqns for p in EXPERT_PARAMS)


def check_expert_plan(plan: Plan) -> None:
    """Refuse (ConfigError) the ep > 1 plans this runtime cannot run, naming the degrees and the fix."""
    d = plan.degrees
    if d.dp % d.ep:
        raise ConfigError(f"ep={d.ep} does not divide dp={d.dp}: ep is a sub-axis of the batch ranks; choose ep "
                          f"dividing {d.dp}")
