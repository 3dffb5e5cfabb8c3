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
experts, the outer ``dp`` axis: FSDP2's reduce-scatter under ZeRO 1-3 (``shard_expert_data_parallel``; a gradient
divide factor of dp x ep would need PREMUL_SUM, which gloo lacks), ``sync_expert_grads`` under ZeRO 0. Every
other gradient is averaged over the batch mesh (dp x ep). Together: the gradient of the global mean loss, as one
process would compute it.

Combinations (``apply_expert_plan``):

- ZeRO 1-3: each experts module is its own FSDP2 unit over the outer ``dp`` axis (the ranks holding the same
  experts; parameters 2-D DTensors (dp, ep)); layers and root are sharded over dp x ep as without experts.
- tp > 1: the dense modules are tensor-parallel per the plan (``runtime.tensor_parallel``); the experts stay whole
  on their ep rank and are replicated over tp, as is the router: every tp rank routes the same (replicated)
  tokens and runs the same all-to-all within its own ep group (ranks with the same tp index), so expert and
  router gradients need no reduction over tp. Each rank holds expert parameters / ep (as the planner's ``expert``
  strategy counts them); the expert compute is repeated on the tp ranks. Under sequence parallel the MoE block
  gathers the sequence before the router and hands each tp rank its part back (``_gather_sequence_around``).
- pp > 1: each pipeline chunk gets TP, experts and FSDP2 as the whole model would; the ep all-to-all runs among
  the ranks of one pipeline stage (the ep axis is inside the pp axis), which run the same schedule.
- cp > 1 is refused.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single as a2a_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from costmodel.errors import ConfigError
from planner.plan import Plan
from runtime.context_parallel import check_context_parallel
from runtime.tensor_parallel import apply_tensor_parallel

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
    recv_e = torch.empty(sum(recv), dtype=expert.dtype, device=expert.device)
    dist.all_to_all_single(recv_e, (expert % local_e).contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    gate_up = self.gate_up_proj.to_local() if isinstance(self.gate_up_proj, DTensor) else self.gate_up_proj
    down = self.down_proj.to_local() if isinstance(self.down_proj, DTensor) else self.down_proj
    gate_up, down = _ScaleGrad.apply(gate_up, 1.0 / ep), _ScaleGrad.apply(down, 1.0 / ep)  # (docstring)
    out = torch.zeros_like(recv_x)
    for j in range(local_e):
        idx = (recv_e == j).nonzero().squeeze(1)
        gate, up = nn.functional.linear(recv_x[idx], gate_up[j]).chunk(2, dim=-1)
        out = out.index_add(0, idx, nn.functional.linear(self.act_fn(gate) * up, down[j]))
    back = out.new_empty((sum(send),) + tuple(out.shape[1:]))
    back = a2a_autograd(back, out, output_split_sizes=send, input_split_sizes=recv, group=group)
    contrib = back * weight[:, None].to(back.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, contrib.to(hidden_states.dtype))


def apply_expert_parallel(model: nn.Module, *, plan: Plan, mesh: DeviceMesh, strict: bool = True) -> list[str]:
    """Shard the experts of every module the plan marks ``expert`` over ``mesh["ep"]``; their FQNs.

    ``strict=False`` skips plan entries whose module is not in ``model`` (a pipeline chunk holds some layers).
    The experts stay whole on their ep rank and are replicated over tp (module docstring)."""
    ep_mesh = mesh["ep"]
    ep = ep_mesh.size()
    fqns = [m.fqn for m in plan.shardings if m.style == "expert"]
    if ep > 1 and not fqns:
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


def is_expert_param(name: str, expert_fqns: list[str]) -> bool:
    return any(name == f"{f}.{p}" for f in expert_fqns for p in EXPERT_PARAMS)


def sync_expert_grads(named_params: Any, *, mesh: DeviceMesh, expert_fqns: list[str]) -> None:
    """ZeRO 0: average gradients as one process would (module docstring). Expert gradients already hold the mean
    over ep (all-to-all backward, scaled by 1/ep): averaged over the outer ``dp`` axis; every other
    gradient (local shard of a TP DTensor, or a plain tensor) all-reduced over the batch mesh (dp x ep) and
    averaged. Nothing is reduced over tp: experts and router see the same tokens on every tp rank."""
    from runtime.mesh import batch_mesh

    dp_outer = mesh["dp"]
    batch = batch_mesh(mesh)
    for name, p in named_params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if is_expert_param(name, expert_fqns):
            if dp_outer.size() > 1:
                dist.all_reduce(g, group=dp_outer.get_group())
                g.div_(dp_outer.size())
        elif batch.size() > 1:
            dist.all_reduce(g, group=batch.get_group())
            g.div_(batch.size())


def _ep_model_class() -> type:
    from runtime.wrap import ParallelModel

    class ExpertParallelModel(ParallelModel):
        """A ``ParallelModel`` whose ``step`` also synchronises gradients for expert parallel under ZeRO 0
        (``sync_expert_grads``); under ZeRO 1-3 FSDP2 does it (``shard_expert_data_parallel``)."""

        def __init__(self, *, expert_fqns: list[str], manual_grad_sync: bool, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.expert_fqns = list(expert_fqns)
            """FQNs of this rank's experts modules (``style="expert"``)."""
            self.manual_grad_sync = manual_grad_sync
            """True under ZeRO 0: ``step`` averages the gradients (``sync_expert_grads``)."""

        def step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
            loss = super().step(inputs, targets)
            if self.manual_grad_sync:
                sync_expert_grads(self.named_parameters(), mesh=self.mesh, expert_fqns=self.expert_fqns)
            return loss

    return ExpertParallelModel


def shard_expert_data_parallel(model: nn.Module, *, plan: Plan, mesh: DeviceMesh, expert_fqns: list[str]) -> None:
    """ZeRO 1-3 with expert parallel, FSDP2 in place (ZeRO 1 runs as ZeRO 2, see ``runtime.data_parallel``).

    Each experts module first gets its own ``fully_shard`` over the outer ``dp`` axis: the ranks that hold the
    same experts (same ep index). Its parameters become 2-D DTensors (dp, ep); the reduce-scatter sums the
    gradients over dp and divides by dp (the forward already scaled them to the mean over ep). Then
    ``apply_data_parallel`` shards the rest (layers and root) over the batch mesh dp x ep and averages it there;
    the experts, already FSDP modules, are left to their own."""
    from torch.distributed.fsdp import fully_shard

    from runtime.data_parallel import apply_data_parallel

    dp_mesh = mesh["dp"]
    reshard = plan.zero_stage == 3
    for fqn in expert_fqns:
        fully_shard(model.get_submodule(fqn), mesh=dp_mesh, reshard_after_forward=reshard)
    apply_data_parallel(model, plan=plan, mesh=mesh)


def check_expert_plan(plan: Plan) -> None:
    """Refuse (ConfigError) the ep > 1 plans this runtime cannot run, naming the degrees and the fix."""
    d = plan.degrees
    if d.dp % d.ep:
        raise ConfigError(f"ep={d.ep} does not divide dp={d.dp}: ep is a sub-axis of the batch ranks; choose ep "
                          f"dividing {d.dp}")
    check_context_parallel(plan)  # cp runs without ep: the one place that says what cp runs with
    if plan.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={plan.zero_stage} must be 0, 1, 2 or 3")


def _dense_plan(plan: Plan) -> Plan:
    """The plan without its ``expert`` entries, for ``apply_tensor_parallel`` (which refuses them)."""
    import dataclasses

    return dataclasses.replace(plan, shardings=tuple(m for m in plan.shardings if m.style != "expert"))


@contextlib.contextmanager
def _moe_blocks_detached(model: nn.Module, *, plan: Plan, detach: bool) -> Iterator[list[nn.Module]]:
    """The MoE blocks (parents of the plan's experts modules) in ``model``, taken out of it for the duration.

    Under sequence parallel ``apply_tensor_parallel`` refuses replicated parameters among the sequence-sharded
    layers (their gradients would be per-rank partial sums); the MoE block is no such region: it runs on the
    gathered sequence (``_gather_sequence_around``), so it is hidden from that check."""
    taken: list[tuple[nn.Module, str, nn.Module]] = []
    for m in plan.shardings:
        if m.style != "expert":
            continue
        parent_fqn, _, leaf = m.fqn.rpartition(".")[0].rpartition(".")
        try:
            parent = model.get_submodule(parent_fqn)
        except AttributeError:
            continue  # not in this pipeline chunk
        block = parent._modules.get(leaf)
        if block is not None:
            taken.append((parent, leaf, block))
    try:
        if detach:
            for parent, leaf, _ in taken:
                parent._modules[leaf] = None
        yield [block for _, _, block in taken]
    finally:
        for parent, leaf, block in taken:
            parent._modules[leaf] = block


def _gather_sequence_around(blocks: list[nn.Module], *, tp_mesh: DeviceMesh) -> None:
    """Sequence parallel: each MoE block gathers the sequence-sharded tokens (B, T/tp, H) -> (B, T, H), routes and
    runs the experts on all of them (the same on every tp rank) and hands back this rank's part of the sequence.
    Backward: the whole-sequence output gradient is all-gathered (so expert and router gradients are the same on
    every tp rank, no reduction over tp), the input gradient sliced back."""
    from runtime.tensor_parallel import _gather_sequence_hook, _scatter

    for block in blocks:
        block.register_forward_pre_hook(_gather_sequence_hook(tp_mesh), with_kwargs=True)
        block.register_forward_hook(lambda _m, _args, out: _scatter(out, tp_mesh))


def _parallelize(
    module: nn.Module, *, plan: Plan, mesh: DeviceMesh, device: torch.device, seed: int, strict: bool,
    init_owner: nn.Module | None, loss_parallel_ok: bool | None,
) -> tuple[nn.Module, list[str]]:
    """TP on the dense modules, experts over ep, FSDP2 for ZeRO > 0, materialise: the module and its experts."""
    from runtime.materialize import materialize
    from runtime.mesh import batch_mesh

    is_meta = any(p.is_meta for p in module.parameters())
    if not is_meta:
        module.to(device)  # before sharding: DTensor and FSDP2 take this rank's part of the tensors in place
    sp = plan.sequence_parallel and plan.degrees.tp > 1
    with _moe_blocks_detached(module, plan=plan, detach=sp) as blocks:
        apply_tensor_parallel(module, plan=_dense_plan(plan), mesh=mesh, strict=strict,
                              loss_parallel_ok=loss_parallel_ok)
    if sp:
        _gather_sequence_around(blocks, tp_mesh=mesh["tp"])
    fqns = apply_expert_parallel(module, plan=plan, mesh=mesh, strict=strict)
    if plan.zero_stage > 0 and batch_mesh(mesh).size() > 1:
        shard_expert_data_parallel(module, plan=plan, mesh=mesh, expert_fqns=fqns)
    if is_meta:
        materialize(module, device=device, seed=seed, init_owner=init_owner)
    return module, fqns


def apply_expert_plan(model: nn.Module, plan: Plan, *, loss_fn: Any, seed: int = 0) -> Any:
    """Apply a plan with ``ep > 1``: experts sharded over ep (all-to-all dispatch), whole per ep rank and
    replicated over tp; the dense modules tensor-parallel per the plan (tp > 1, with or without sequence
    parallel); data parallel per the ZeRO stage (FSDP2 for ZeRO 1-3, gradients all-reduced by ``step`` for ZeRO
    0); pipelined per the plan's stages (pp > 1; the ep all-to-all runs among the ranks of one pipeline stage).
    Refused (``check_expert_plan``): cp > 1, ep not dividing dp. Returns a ``ParallelModel``
    (``ExpertParallelModel``)."""
    from planner.plan import check_plan_matches
    from runtime.checkpointing import apply_plan_recompute
    from runtime.mesh import build_mesh, init_distributed
    from runtime.wrap import fingerprint_of

    info = init_distributed()
    check_plan_matches(plan, fingerprint=fingerprint_of(model), world_size=dist.get_world_size())
    check_expert_plan(plan)
    mesh = build_mesh(plan, device_type=info.device_type)
    device = torch.device("cuda", torch.cuda.current_device()) if info.device_type == "cuda" else torch.device("cpu")
    cls = _ep_model_class()
    if plan.degrees.pp > 1:
        runner, fqns = _build_pipeline(model, plan, mesh=mesh, loss_fn=loss_fn, seed=seed, device=device)
        module = model
    else:
        runner = None
        apply_plan_recompute(model, plan=plan)
        module, fqns = _parallelize(model, plan=plan, mesh=mesh, device=device, seed=seed, strict=True,
                                    init_owner=None, loss_parallel_ok=None)
    return cls(module=module, plan=plan, mesh=mesh, loss_fn=loss_fn, pipeline=runner, expert_fqns=fqns,
               manual_grad_sync=plan.zero_stage == 0)


def _build_pipeline(
    model: nn.Module, plan: Plan, *, mesh: DeviceMesh, loss_fn: Any, seed: int, device: torch.device
) -> tuple[Any, list[str]]:
    """pp > 1: each local chunk gets TP, EP and FSDP2 as the whole model would (``_parallelize``); the
    ``PipelineRunner`` and the FQNs of this rank's experts modules."""
    from runtime.pipeline import build_pipeline

    if loss_fn is None:
        raise ConfigError("a pipelined plan (pp > 1) needs loss_fn: the last stage computes the loss")
    fqns: list[str] = []

    def wrap_chunk(chunk: nn.Module) -> nn.Module:
        # stage outputs cross the pipeline as plain tensors: gathered logits, not loss-parallel DTensors
        chunk, chunk_fqns = _parallelize(chunk, plan=plan, mesh=mesh, device=device, seed=seed, strict=False,
                                         init_owner=model, loss_parallel_ok=False)
        fqns.extend(chunk_fqns)
        return chunk

    runner = build_pipeline(model, plan=plan, mesh=mesh, loss_fn=loss_fn, sync_dp_grads=False, wrap_chunk=wrap_chunk)
    return runner, fqns
