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
  adds them, weighted by the router, into the output. The router (``gate``) and everything else stay replicated.

Gradients: the all-to-all backward delivers to each expert the gradient of every ep rank's local loss, a sum over
the ep group; ``ExpertParallelModel.step`` then all-reduces expert gradients over the outer ``dp`` axis and divides
by dp x ep, and averages every other gradient over the batch mesh (dp x ep): together the gradient of the global
mean loss, as one process would compute it.
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


def _dispatch(x: torch.Tensor, counts: torch.Tensor, group: Any) -> tuple[torch.Tensor, list[int], list[int]]:
    """Send ``x`` rows (grouped by destination, ``counts[r]`` rows to rank r); the received rows and the splits."""
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send, recv = counts.tolist(), recv_counts.tolist()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    return a2a_autograd(out, x, output_split_sizes=recv, input_split_sizes=send, group=group), send, recv


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
    recv_e = torch.empty(sum(recv), dtype=expert.dtype, device=expert.device)
    dist.all_to_all_single(recv_e, (expert % local_e).contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    gate_up = self.gate_up_proj.to_local() if isinstance(self.gate_up_proj, DTensor) else self.gate_up_proj
    down = self.down_proj.to_local() if isinstance(self.down_proj, DTensor) else self.down_proj
    out = torch.zeros_like(recv_x)
    for j in range(local_e):
        idx = (recv_e == j).nonzero().squeeze(1)
        gate, up = nn.functional.linear(recv_x[idx], gate_up[j]).chunk(2, dim=-1)
        out = out.index_add(0, idx, nn.functional.linear(self.act_fn(gate) * up, down[j]))
    back = out.new_empty((sum(send),) + tuple(out.shape[1:]))
    back = a2a_autograd(back, out, output_split_sizes=send, input_split_sizes=recv, group=group)
    contrib = back * weight[:, None].to(back.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, contrib.to(hidden_states.dtype))


def apply_expert_parallel(model: nn.Module, *, plan: Plan, mesh: DeviceMesh) -> list[str]:
    """Shard the experts of every module the plan marks ``expert`` over ``mesh["ep"]``; their FQNs."""
    ep_mesh = mesh["ep"]
    ep = ep_mesh.size()
    fqns = [m.fqn for m in plan.shardings if m.style == "expert"]
    if ep > 1 and not fqns:
        raise ConfigError(f"plan has ep={ep} but marks no module with style 'expert'")
    for fqn in fqns:
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
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
    log.info("expert parallel: %d expert modules over ep=%d", len(fqns), ep)
    return fqns


def is_expert_param(name: str, expert_fqns: list[str]) -> bool:
    return any(name == f"{f}.{p}" for f in expert_fqns for p in EXPERT_PARAMS)


def _ep_model_class() -> type:
    from runtime.wrap import ParallelModel

    class ExpertParallelModel(ParallelModel):
        """A ``ParallelModel`` whose ``step`` also synchronises gradients for expert parallel (module docstring)."""

        expert_fqns: list[str] = []

        def step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
            from runtime.mesh import batch_mesh

            loss = super().step(inputs, targets)
            dp_outer, ep = self.mesh["dp"], self.mesh["ep"].size()
            batch_group = batch_mesh(self.mesh).get_group() if self.dp_size > 1 else None
            for name, p in self.named_parameters():
                if p.grad is None:
                    continue
                if is_expert_param(name, self.expert_fqns):
                    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    if dp_outer.size() > 1:
                        dist.all_reduce(g, group=dp_outer.get_group())
                    g.div_(dp_outer.size() * ep)
                elif batch_group is not None:
                    dist.all_reduce(p.grad, group=batch_group)
                    p.grad.div_(self.dp_size)
            return loss

    return ExpertParallelModel


def apply_expert_plan(model: nn.Module, plan: Plan, *, loss_fn: Any, seed: int = 0) -> Any:
    """Apply a plan with ``ep > 1`` (and tp = pp = cp = 1, ZeRO 0): experts sharded over ep, the rest replicated
    with gradients averaged over dp x ep; a ``ParallelModel`` (``ExpertParallelModel``)."""
    from planner.plan import check_plan_matches
    from runtime.materialize import materialize
    from runtime.mesh import build_mesh, init_distributed
    from runtime.wrap import fingerprint_of

    info = init_distributed()
    check_plan_matches(plan, fingerprint=fingerprint_of(model), world_size=dist.get_world_size())
    d = plan.degrees
    if d.tp > 1 or d.pp > 1 or d.cp > 1 or plan.zero_stage > 0:
        raise ConfigError(
            f"expert parallel runs with tp=pp=cp=1 and ZeRO 0 in this runtime; the plan has tp={d.tp} pp={d.pp} "
            f"cp={d.cp} zero={plan.zero_stage}: re-plan with --fix tp=1,pp=1,zero=0"
        )
    mesh = build_mesh(plan, device_type=info.device_type)
    device = torch.device("cuda", torch.cuda.current_device()) if info.device_type == "cuda" else torch.device("cpu")
    fqns = apply_expert_parallel(model, plan=plan, mesh=mesh)
    if any(p.is_meta for p in model.parameters()):
        materialize(model, device=device, seed=seed)
    else:
        model.to(device)
    pm = _ep_model_class()(module=model, plan=plan, mesh=mesh, loss_fn=loss_fn)
    pm.expert_fqns = fqns
    return pm
