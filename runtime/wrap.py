"""``ParallelModel`` (the wrapper training code talks to), ``apply_plan`` and ``auto_wrap``.

    pm = auto_wrap(model, example_inputs, loss_fn=loss_fn, plan="plan.json")   # under torchrun
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for inputs, targets in batches:
        loss = pm.step(inputs, targets)     # forward + backward over the plan's micro-batches
        opt.step(); opt.zero_grad()

``loss_fn(logits, targets) -> mean loss`` of one micro-batch (logits (B, T, V), what the pipeline's last stage
emits too, so the same script runs every plan). ``step`` accepts the global batch (``plan.global_batch`` rows,
identical on every rank: each rank takes its data-parallel slice) or this rank's slice (global_batch / dp rows).
It returns the global mean loss on every rank, with gradients averaged over data-parallel ranks.
With context parallel (cp > 1) ``step`` also takes the whole sequence (B, T) of input ids and targets and keeps this
rank's T / cp tokens (``runtime.context_parallel``); the loss is the mean over all tokens of all cp ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from costmodel.errors import ConfigError
from planner.plan import Plan, check_plan_matches, load_plan, model_fingerprint
from runtime.checkpointing import apply_plan_recompute
from runtime.context_parallel import ContextParallel, apply_context_parallel, check_context_parallel
from runtime.data_parallel import apply_data_parallel, unwrap
from runtime.materialize import materialize
from runtime.mesh import batch_rank_and_size, build_mesh, grad_mesh, init_distributed
from runtime.tensor_parallel import apply_tensor_parallel

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def fingerprint_of(model: nn.Module) -> str:
    return model_fingerprint((n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters())


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: a tensor, an HF ``ModelOutput`` (``.logits``) or a tuple's first item."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConfigError(f"cannot find logits in a model output of type {type(output).__name__}")


class ParallelModel:
    """A model with a plan applied; see the module docstring."""

    def __init__(
        self,
        *,
        module: nn.Module,
        plan: Plan,
        mesh: DeviceMesh,
        loss_fn: LossFn | None,
        pipeline: Any = None,
        context: ContextParallel | None = None,
    ) -> None:
        self.module = module
        """The parallelized module (DDP wrapper for ZeRO 0 without TP); for pp > 1 the full model's skeleton."""
        self._plan = plan
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.pipeline = pipeline
        """``runtime.pipeline.PipelineRunner`` when pp > 1."""
        self.context = context
        """``runtime.context_parallel.ContextParallel`` when cp > 1: splits each sequence over the cp ranks."""
        self.dp_rank, self.dp_size = batch_rank_and_size(mesh)
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
        )

    @property
    def plan(self) -> Plan:
        return self._plan

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        if self.pipeline is not None:
            yield from self.pipeline.named_parameters()
        else:
            yield from unwrap(self.module).named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def _modules_for_state(self) -> list[nn.Module]:
        return self.pipeline.modules if self.pipeline is not None else [unwrap(self.module)]

    def state_dict(self) -> dict[str, Any]:
        """This rank's model state (DTensor shards under the model's FQNs), for torch.distributed.checkpoint."""
        out: dict[str, Any] = {}
        for m in self._modules_for_state():
            out.update(get_model_state_dict(m, options=StateDictOptions(full_state_dict=False)))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for m in self._modules_for_state():
            keys = set(get_model_state_dict(m).keys())
            set_model_state_dict(m, {k: v for k, v in state_dict.items() if k in keys})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            raise ConfigError("a pipelined model runs through step(); call it outside the pipeline")
        if self.context is not None and "position_ids" not in kwargs:
            raise ConfigError(
                f"with cp={self.context.size} each rank holds T / {self.context.size} tokens of a sequence: call "
                "step(), or pass this rank's tokens (context.shard_batch) with **context.model_kwargs(ids)"
            )
        return self.module(*args, **kwargs)

    @functools.cached_property
    def _grad_group(self) -> DeviceMesh:
        """``runtime.mesh.grad_mesh`` of the mesh, flattened once rather than on every step."""
        return grad_mesh(self.mesh)

    def step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """Forward + backward over the plan's micro-batches; the global mean loss (0-d tensor) on every rank."""
        if self.loss_fn is None:
            raise ConfigError("ParallelModel.step needs loss_fn: pass loss_fn= to apply_plan / auto_wrap")
        inputs, targets = self._local_batch(inputs, targets)
        if self.context is not None:
            inputs, targets = self.context.shard_batch(inputs, targets)  # (B, T / cp) each: this rank's tokens
        inputs, targets = _to(inputs, self._device), targets.to(self._device)
        if self.pipeline is not None:
            return self.pipeline.step(inputs, targets)
        n_mb = self._plan.schedule.num_microbatches
        rows = targets.shape[0]
        if rows % n_mb:
            raise ConfigError(f"local batch {rows} does not split into num_microbatches={n_mb}")
        mb_inputs = _split(inputs, n_mb)
        mb_targets = targets.chunk(n_mb)
        total = torch.zeros((), dtype=torch.float32, device=self._device)  # NCCL reduces device tensors only
        for i in range(n_mb):
            last = i == n_mb - 1
            sync = self.module.no_sync() if isinstance(self.module, DistributedDataParallel) and not last else contextlib.nullcontext()
            with sync:
                total += self._micro_step(mb_inputs[i], mb_targets[i], n_mb)
        group = self._grad_group  # the batch ranks, times cp (each holds a per-token mean over equal counts)
        if group.size() > 1:
            dist.all_reduce(total, group=group.get_group())
            total /= group.size()
        return total

    def _micro_step(self, inputs: Any, targets: torch.Tensor, n_mb: int) -> torch.Tensor:
        if self.context is not None:  # cp: the global position ids of this rank's tokens
            out = self.module(inputs, **self.context.model_kwargs(inputs))
        else:
            out = self.module(*inputs) if isinstance(inputs, tuple) else self.module(inputs)
        logits = logits_of(out)
        ctx = loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext()
        with ctx:
            loss = self.loss_fn(logits, targets) / n_mb
            loss.backward()
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return value.detach().float()

    def _local_batch(self, inputs: Any, targets: torch.Tensor) -> tuple[Any, torch.Tensor]:
        global_rows = self._plan.global_batch
        rows = targets.shape[0]
        if rows == global_rows and self.dp_size > 1:
            local = global_rows // self.dp_size
            lo, hi = self.dp_rank * local, (self.dp_rank + 1) * local
            return _slice(inputs, lo, hi), targets[lo:hi]
        if rows * self.dp_size == global_rows:
            return inputs, targets
        raise ConfigError(
            f"step got a batch of {rows} rows; the plan expects the global batch {global_rows} or this rank's "
            f"share {global_rows // self.dp_size} (dp={self.dp_size})"
        )


def _to(inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    return tuple(x.to(device) for x in inputs)


def _slice(inputs: Any, lo: int, hi: int) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs[lo:hi]
    if isinstance(inputs, (tuple, list)):
        return tuple(_slice(x, lo, hi) for x in inputs)
    raise ConfigError(f"inputs must be a tensor or a tuple of tensors, got {type(inputs).__name__}")


def _split(inputs: Any, n: int) -> list[Any]:
    if isinstance(inputs, torch.Tensor):
        return list(inputs.chunk(n))
    parts = [x.chunk(n) for x in inputs]
    return [tuple(p[i] for p in parts) for i in range(n)]


def apply_plan(
    model: nn.Module,
    plan: Plan,
    *,
    mesh: DeviceMesh | None = None,
    loss_fn: LossFn | None = None,
    seed: int = 0,
) -> ParallelModel:
    """Apply ``plan`` to ``model`` on the running process group: TP/SP, then CP (attention over the cp ranks), then
    DP/ZeRO over dp x cp (or the pipeline with per-chunk TP/DP), then materialise a meta-device model as local
    shards (seeded per module FQN)."""
    info = init_distributed()
    check_plan_matches(plan, fingerprint=fingerprint_of(model), world_size=dist.get_world_size())
    d = plan.degrees
    check_context_parallel(plan)  # cp runs with tp and dp; refused with pp or ep
    if d.ep > 1:
        from runtime.expert_parallel import apply_expert_plan  # experts over ep, all-to-all dispatch

        return apply_expert_plan(model, plan, loss_fn=loss_fn, seed=seed)
    mesh = mesh if mesh is not None else build_mesh(plan, device_type=info.device_type)
    device = torch.device("cuda", torch.cuda.current_device()) if info.device_type == "cuda" else torch.device("cpu")
    is_meta = any(p.is_meta for p in model.parameters())
    if not is_meta:
        model.to(device)
    if d.pp > 1:
        return _apply_pipelined(model, plan, mesh=mesh, loss_fn=loss_fn, seed=seed, device=device, is_meta=is_meta)
    apply_plan_recompute(model, plan=plan)
    module = apply_tensor_parallel(model, plan=plan, mesh=mesh)
    context = apply_context_parallel(module, plan=plan, mesh=mesh)
    dp = grad_mesh(mesh).size()  # gradients are averaged over dp x cp
    uses_ddp = dp > 1 and plan.zero_stage == 0 and not any(isinstance(p, DTensor) for p in module.parameters())
    if is_meta and uses_ddp:
        materialize(module, device=device, seed=seed)
    module = apply_data_parallel(module, plan=plan, mesh=mesh)
    if is_meta and not uses_ddp:
        materialize(unwrap(module), device=device, seed=seed)
    return ParallelModel(module=module, plan=plan, mesh=mesh, loss_fn=loss_fn, context=context)


def _apply_pipelined(
    model: nn.Module, plan: Plan, *, mesh: DeviceMesh, loss_fn: LossFn | None, seed: int, device: torch.device,
    is_meta: bool,
) -> ParallelModel:
    from runtime.pipeline import build_pipeline

    if loss_fn is None:
        raise ConfigError("a pipelined plan (pp > 1) needs loss_fn: the last stage computes the loss")
    fsdp = plan.zero_stage > 0 and batch_rank_and_size(mesh)[1] > 1

    def wrap_chunk(chunk: nn.Module) -> nn.Module:
        # stage outputs cross the pipeline as plain tensors: gather logits instead of loss-parallel DTensors
        chunk = apply_tensor_parallel(chunk, plan=plan, mesh=mesh, strict=False, loss_parallel_ok=False)
        if fsdp:
            chunk = apply_data_parallel(chunk, plan=plan, mesh=mesh)
        if is_meta:
            materialize(chunk, device=device, seed=seed, init_owner=model)
        return chunk

    runner = build_pipeline(
        model, plan=plan, mesh=mesh, loss_fn=loss_fn, sync_dp_grads=not fsdp, wrap_chunk=wrap_chunk
    )
    return ParallelModel(module=model, plan=plan, mesh=mesh, loss_fn=loss_fn, pipeline=runner)


def auto_wrap(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn,
    plan: Plan | str | Path | None = None,
    cluster: Any = None,
    seed: int = 0,
) -> ParallelModel:
    """Load (path), take (Plan) or make (None: ``planner.plan_model`` for ``cluster``, default this machine with
    the running world size) a plan on rank 0, broadcast it so every rank applies the same one, check it belongs to
    this model and world size, and apply it. ``example_inputs``: one global batch (its shape sets the batch and
    sequence length the planner plans for)."""
    info = init_distributed()
    payload: list[Any] = [None]
    if info.rank == 0:
        try:
            resolved = _resolve_plan(model, example_inputs, plan=plan, cluster=cluster, world_size=info.world_size)
            payload = [("ok", resolved.to_dict())]
        except Exception as e:  # noqa: BLE001 - sent to every rank, re-raised there with its type
            payload = [("err", type(e).__name__, str(e))]
    if info.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if payload[0][0] == "err":
        _, kind, msg = payload[0]
        err_type = _error_type(kind)
        text = msg if err_type is not RuntimeError else f"planning on rank 0 raised {kind}: {msg}"
        raise err_type(text if info.rank == 0 else f"(from rank 0) {text}")
    agreed = Plan.from_dict(payload[0][1])
    check_plan_matches(agreed, fingerprint=fingerprint_of(model), world_size=info.world_size)
    log.info("auto_wrap: plan degrees %s, zero %d, schedule %s", agreed.degrees, agreed.zero_stage, agreed.schedule)
    return apply_plan(model, agreed, loss_fn=loss_fn, seed=seed)


def _error_type(name: str) -> type[Exception]:
    import costmodel.errors as errors

    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, errors.AutoparError) else RuntimeError


def _resolve_plan(model: nn.Module, example_inputs: Any, *, plan: Any, cluster: Any, world_size: int) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return load_plan(plan)
    if plan is not None:
        raise ConfigError(f"plan= must be a Plan, a plan file path or None, got {type(plan).__name__}")
    return _plan_for(model, example_inputs, cluster=cluster, world_size=world_size)


def _plan_for(model: nn.Module, example_inputs: Any, *, cluster: Any, world_size: int) -> Plan:
    """Plan with the planner's public entry. The model goes to the planner as its HF config.json (the planner
    rebuilds the same class from it, with the same parameter names: the fingerprint check confirms)."""
    import tempfile

    try:
        from planner import plan_model
    except ImportError as e:
        raise ConfigError(f"planner.plan_model is not available ({e}); pass plan=PATH from `autopar plan`") from None
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        raise ConfigError(
            f"auto_wrap can plan only Hugging Face models (with .config); for {type(model).__name__} "
            "run `autopar plan` and pass plan=PATH"
        )
    ids = example_inputs[0] if isinstance(example_inputs, (tuple, list)) else example_inputs
    if not isinstance(cluster, (str, type(None))):
        cluster_obj = cluster
    else:
        from costmodel.profiles import resolve_cluster

        cluster_obj = resolve_cluster(cluster or "local", nodes=1, gpus_per_node=world_size)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        config.to_json_file(str(path))
        plan = plan_model(str(path), cluster_obj, global_batch=int(ids.shape[0]), seq=int(ids.shape[1]))
    name = f"{type(model).__name__} (auto_wrap)"  # not the temporary config path
    return dataclasses.replace(plan, model=dataclasses.replace(plan.model, name=name))
