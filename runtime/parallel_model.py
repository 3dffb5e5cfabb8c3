"""``ParallelModel``: the object training code talks to once a plan is applied (``runtime.apply_plan``).

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

Checkpoints and resume (``auto_wrap(..., checkpoint_dir=D, checkpoint_every=N)``, or
``pm.checkpoint_to(D, every_steps=N)``):

    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for step in range(pm.resume(opt), total_steps):    # loads the latest complete checkpoint; its step (0: none)
        loss = pm.step(*batch(step)); opt.step(); opt.zero_grad()
    pm.close()                                         # saves the last step and waits for the async save

One ``step`` is one optimizer step. ``step`` counts them (``steps_done``); when ``steps_done`` is a positive
multiple of N at the start of a step, it first saves model + optimizer + ``steps_done`` (``runtime.checkpoint``:
async DCP, complete or invisible), i.e. the state after the previous ``opt.step()``.

Failures: when a collective of ``step`` fails because another rank died or hung (the process group times out:
``runtime.mesh.init_distributed``), ``step`` raises ``RankFailureError`` naming that rank and the step
(``runtime.failures``).
"""

from __future__ import annotations

import contextlib
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
from planner.plan import Plan
from runtime.checkpoint import Checkpointer
from runtime.context_parallel import ContextParallel
from runtime.data_parallel import average_gradients, compute_autocast, set_microbatch_sync, unwrap
from runtime.failures import diagnose, is_comm_failure
from runtime.mesh import batch_rank_and_size, grad_mesh
from runtime.pipeline import PipelineRunner

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
log = logging.getLogger(__name__)


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
        pipeline: PipelineRunner | None = None,
        context: ContextParallel | None = None,
        average_grads: bool = False,
        expert_params: frozenset[str] = frozenset(),
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
        self.average_grads = average_grads
        """True where no DDP / FSDP wrapper averages the gradients (ZeRO 0 with a pipeline or experts): ``step``
        does it (``runtime.data_parallel.average_gradients``)."""
        self.expert_params = expert_params
        """Names of this rank's expert parameters (``style="expert"``), averaged over ``dp`` only."""
        self.dp_rank, self.dp_size = batch_rank_and_size(mesh)
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
        )
        self.steps_done = 0
        """Optimizer steps completed (``step`` calls, plus the resumed checkpoint's step): the data position."""
        self.checkpointer: Checkpointer | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._saved_step = 0

    # --- checkpoints ----------------------------------------------------------------------------------------

    def checkpoint_to(self, directory: str | Path, *, every_steps: int, async_save: bool = True, keep: int = 2) -> None:
        """Save under ``directory`` every ``every_steps`` steps, keeping the newest ``keep`` (collective)."""
        self.checkpointer = Checkpointer(directory, every_steps=every_steps, async_save=async_save, keep=keep)

    def resume(self, optimizer: torch.optim.Optimizer) -> int:
        """Load the latest complete checkpoint (any plan, any world size: DCP reshards) into the model and
        ``optimizer``, which later saves hold too; returns ``steps_done``, the step to continue at (0 without a
        checkpoint). Collective."""
        if self.checkpointer is None:
            raise ConfigError("resume() needs a checkpoint directory: auto_wrap(..., checkpoint_dir=DIR, "
                              "checkpoint_every=N) or pm.checkpoint_to(DIR, every_steps=N)")
        self._optimizer = optimizer
        self.steps_done = self._saved_step = self.checkpointer.load_latest(self, optimizer)
        if self.steps_done:
            log.info("resumed at step %d from %s", self.steps_done, self.checkpointer.directory)
        return self.steps_done

    def _maybe_save(self) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        if self._optimizer is None:
            raise ConfigError("checkpoint_dir is set but no optimizer is known: call pm.resume(optimizer) before "
                              "the first step, so checkpoints hold the optimizer state")
        ckpt.poll()
        if self.steps_done > self._saved_step and self.steps_done % ckpt.every_steps == 0:
            ckpt.save(self, self._optimizer, step=self.steps_done)
            self._saved_step = self.steps_done

    def close(self) -> None:
        """Save the last completed step (if not saved yet) and wait until the checkpoint is on disk and marked
        complete. Collective; call once after the training loop."""
        ckpt = self.checkpointer
        if ckpt is None:
            return
        if self._optimizer is not None and self.steps_done > self._saved_step:
            ckpt.save(self, self._optimizer, step=self.steps_done)
            self._saved_step = self.steps_done
        ckpt.wait()

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
        """Forward + backward over the plan's micro-batches; the global mean loss (0-d tensor) on every rank.
        Saves a checkpoint first when one is due; ``RankFailureError`` when another rank died or hung."""
        if self.loss_fn is None:
            raise ConfigError("ParallelModel.step needs loss_fn: pass loss_fn= to apply_plan / auto_wrap")
        try:
            self._maybe_save()
            loss = self._step(inputs, targets)
        except Exception as e:
            if not is_comm_failure(e) or not dist.is_initialized() or dist.get_world_size() == 1:
                raise
            failure = diagnose(e, step=self.steps_done + 1)
            if failure is None:
                raise
            raise failure from e
        self.steps_done += 1
        return loss

    def _step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        inputs, targets = self._local_batch(inputs, targets)
        if self.context is not None:
            inputs, targets = self.context.shard_batch(inputs, targets)  # (B, T / cp) each: this rank's tokens
        inputs, targets = _to(inputs, self._device), targets.to(self._device)
        modules = self.pipeline.modules if self.pipeline is not None else [self.module]
        with compute_autocast(modules, self._device.type):
            if self.pipeline is not None:
                loss = self.pipeline.step(inputs, targets)
            else:
                loss = self._local_step(inputs, targets)
        if self.average_grads:
            average_gradients(self.named_parameters(), mesh=self.mesh, expert_params=self.expert_params)
        return loss

    def _local_step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """Without a pipeline: the micro-batches in turn (DDP syncs on the last, FSDP2 per ``gradient_sync``); the loss
        averaged over dp x cp."""
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
            set_microbatch_sync(self.module, self._plan, last=last)  # FSDP2: ZeRO 1 accumulates, 2 / 3 reduce
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
