"""Pipeline parallelism: cut a model at the plan's module FQNs and run the plan's schedule.

``build_pipeline(model, *, plan, mesh, loss_fn) -> PipelineRunner``; ``runner.step(inputs, targets) -> loss``
runs forward and backward over the plan's micro-batches with ``torch.distributed.pipelining`` and returns the
global mean loss on every rank (mean over micro-batches, broadcast over the pipeline axis, averaged over the
data-parallel axis); gradients are accumulated into ``.grad`` of the local chunks' parameters (call
``optimizer.zero_grad()`` between steps as usual).

Cutting. ``StagePlan.modules`` lists module FQNs in execution order; chunk ``i`` runs on pipeline rank
``i % pp`` (torch's loop placement for multi-chunk schedules). Each FQN maps onto a unit of the model-family
layout (``runtime.model_adapters``): the embedding (all its modules together), one transformer layer, or one
module after the layers. Chunks must hold contiguous, ordered, non-overlapping runs of units that together
cover the model; embedding or head modules a plan does not name are added to the first / last chunk. A chunk is
an ``nn.Module`` that *references* the original submodules at their original FQNs (nothing is copied), so
``chunk.named_parameters()`` gives the model's own parameter names, and TP / FSDP / materialisation keyed by FQN
apply to chunks as to the model.

Schedules (``ScheduleSpec.name``): ``gpipe`` -> ``ScheduleGPipe``, ``1f1b`` -> ``Schedule1F1B`` (both one chunk
per rank), ``interleaved-1f1b`` -> ``ScheduleInterleaved1F1B``, ``zero-bubble`` -> ``ScheduleInterleavedZeroBubble``
(ZB-H1 for one chunk per rank, split input / weight backward; runs on gloo). ``ScheduleZBVZeroBubble`` needs the
V placement (chunk ``i`` and ``2p-1-i`` on one rank), which the plan's loop placement does not describe, so it is
not used.

Gradient accumulation with FSDP2 chunks (``_Stage``): ZeRO 2 / 3 reduce-scatter every micro-batch's gradients
(ZeRO 3 also reshards after each backward); ZeRO 1 keeps torch's own behaviour, gradient sync and resharding off
until the last micro-batch, so the unsharded gradients accumulate and are reduced once
(``runtime.data_parallel.gradient_sync``).

Sequence parallel (``plan.sequence_parallel`` with tp > 1): activations cross chunk boundaries as whole
sequences (B, T, H), replicated over tp; each chunk shards the sequence before its first layer and gathers it
after its last module unless that is the LM head (whose colwise input layout gathers it). The TP hooks of
``runtime.tensor_parallel`` for the first layer do not fire in a chunk (its layer container is no ModuleList).

Tied embeddings (OPT / GPT-2 tie ``lm_head.weight`` to the token embedding): when the embedding and the head are
on different pipeline ranks, both hold the weight; it is made equal once (broadcast from the embedding's rank on
the first step) and its gradient is summed over the two ranks after each step (Megatron's embedding group). Both
ranks name it as the model does (``named_parameters()`` gives a tied weight once, under the embedding's FQN).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as pl
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

from costmodel.errors import ConfigError, PlanMismatchError, UnsupportedModelError
from planner.plan import Plan, StagePlan
from runtime.data_parallel import gradient_sync, set_microbatch_sync, unwrap
from runtime.mesh import batch_mesh
from runtime.model_adapters import Layout, ModelAdapter, TracedAdapter, adapter_for
from runtime.traced_units import graft_attrs

logger = logging.getLogger(__name__)


# --- cutting ----------------------------------------------------------------------------------------------


def _unit_of(fqn: str, layout: Layout) -> int:
    if fqn in layout.embed:
        return 0
    units = layout.units
    for i, unit in enumerate(units[1:], start=1):
        if fqn == unit:
            return i
        if fqn.startswith(unit + "."):
            raise PlanMismatchError(
                f"stage module {fqn!r} is part of {unit!r}: pipeline cuts are at whole layers; "
                f"name {unit!r} instead"
            )
    raise PlanMismatchError(
        f"stage module {fqn!r} is not a unit of this {layout.family} model; expected one of "
        f"{layout.embed + (layout.layers[0], '...', layout.layers[-1]) + layout.post}"
    )


def cut_units(layout: Layout, stages: tuple[StagePlan, ...], *,
              unit_of: Callable[[str], int] | None = None) -> list[tuple[int, int]]:
    """Per stage (in index order) the half-open unit range ``[lo, hi)`` it runs; checks the plan's cuts.
    ``unit_of(fqn)``: the unit of a stage module (default: by the family layout's FQNs)."""
    n_units = len(layout.units)
    find = unit_of if unit_of is not None else (lambda f: _unit_of(f, layout))
    ranges: list[tuple[int, int]] = []
    for st in sorted(stages, key=lambda s: s.index):
        # aux modules (rotary embedding) go to every chunk with layers; a plan may list them anywhere
        ids = sorted({find(f) for f in st.modules if f not in layout.aux})
        if not ids:
            raise PlanMismatchError(f"stage {st.index} has no modules: every pipeline chunk needs at least one")
        if ids != list(range(ids[0], ids[-1] + 1)):
            raise PlanMismatchError(
                f"stage {st.index} modules are not contiguous (units {ids}): a chunk runs consecutive layers"
            )
        ranges.append((ids[0], ids[-1] + 1))
    # Embedding / head modules the plan does not name go to the first / last chunk.
    if ranges[0][0] == 1:
        ranges[0] = (0, ranges[0][1])
    if ranges[-1][1] < n_units and ranges[-1][1] >= len(layout.layers) + 1:
        ranges[-1] = (ranges[-1][0], n_units)
    expect = 0
    for i, (lo, hi) in enumerate(ranges):
        if lo != expect:
            what = "overlaps the previous one" if lo < expect else f"leaves out {layout.units[expect:lo]}"
            raise PlanMismatchError(f"stage {i} starts at unit {layout.units[lo]!r} and {what}")
        expect = hi
    if expect != n_units:
        raise PlanMismatchError(f"the stages leave out {layout.units[expect:]}: assign them to the last stage")
    return ranges


class PipelineChunk(nn.Module):
    """Units ``[lo, hi)`` of a model; its submodules are the model's own, at their original FQNs."""

    def __init__(self, model: nn.Module, *, adapter: ModelAdapter, lo: int, hi: int, stage: StagePlan) -> None:
        super().__init__()
        layout = adapter.layout
        self.stage = stage
        """The plan's entry for this chunk (its recomputation is applied by ``runtime.parallelize``)."""
        units = layout.units[lo:hi]
        self._adapter = adapter
        self.has_embedding = lo == 0
        self.layer_fqns = tuple(u for u in units if u in layout.layers)
        self.post_fqns = tuple(u for u in units if u in layout.post)
        self.has_head = hi == len(layout.units)
        self.sp_mesh: Any | None = None
        """The tp DeviceMesh under sequence parallelism (set by ``build_pipeline``): see ``forward``."""
        self.logits_mesh: Any | None = None
        """The tp DeviceMesh when the chunk's head returns this rank's vocabulary shard of the logits (set by
        ``runtime.parallelize``): the loss runs loss-parallel over it (``build_pipeline``)."""
        self._traced = adapter.traced if isinstance(adapter, TracedAdapter) else None
        self._lo, self._hi = lo, hi
        if self._traced is not None:
            # the modules the chunk's traced nodes call or read, outermost first (a read attribute's module
            # may sit inside another one this chunk holds: grafting it again is a no-op)
            self._nodes = self._traced.chunk_nodes(lo, hi)
            mods, attrs = self._traced.chunk_references(self._nodes)
            fqns = sorted(mods, key=lambda f: f.count("."))
            self.fqns = tuple(f for f in fqns if not any(f.startswith(o + ".") for o in fqns if o != f))
            graft_attrs(self, model, attrs)
        else:
            fqns = list(layout.embed if self.has_embedding else ())
            fqns += [*self.layer_fqns, *self.post_fqns]
            if self.layer_fqns:
                fqns += list(layout.aux)
            self.fqns = tuple(fqns)
        for fqn in self.fqns:
            _graft(self, fqn, model.get_submodule(fqn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._traced is not None:
            return self._traced_forward(x)
        # Sequence parallel: activations cross chunk boundaries whole (B, T, H); a chunk shards the sequence
        # over tp before its first layer (after the embedding) and gathers it after its last module, unless
        # that is the LM head, whose ColwiseParallel input (Shard(1)) gathers it itself.
        sp = self.sp_mesh is not None and bool(self.layer_fqns or self.post_fqns)
        hidden = self._adapter.embed(self, x) if self.has_embedding else x  # (B, T, H)
        context = self._adapter.layer_context(self, hidden) if self.layer_fqns else {}  # from the full T
        if sp:
            hidden = _to_sequence_shard(hidden, self.sp_mesh)  # (B, T/tp, H)
        for fqn in self.layer_fqns:
            hidden = self._adapter.run_layer(self.get_submodule(fqn), hidden, context)
        for fqn in self.post_fqns:
            hidden = self.get_submodule(fqn)(hidden)
        if sp and not self.has_head:
            hidden = _from_sequence_shard(hidden, self.sp_mesh)  # (B, T, H)
        if hidden._base is not None:
            # OPT layers return a view; FSDP2 warns that a chunk output view loses its pre-backward hook
            # under an in-place op. One copy per micro-batch and chunk keeps that off the table.
            hidden = hidden.clone()
        return hidden  # (B, T, H), or logits (B, T, V) after the head

    def _traced_forward(self, x: Any) -> Any:
        """The traced nodes of the chunk's units (``runtime.traced_units``); sequence parallel as in ``forward``:
        the hidden states sharded as the first layer / post unit gets them, gathered again at the chunk's end
        unless it returns the model's output."""
        sp = self.sp_mesh is not None and bool(self.layer_fqns or self.post_fqns)
        mesh = self.sp_mesh
        out = self._traced.run(
            self, self._nodes, self._lo, self._hi, x,
            on_entry=(lambda h: _to_sequence_shard(h, mesh)) if sp else None,
            on_exit=(lambda h: _from_sequence_shard(h, mesh)) if sp else None,
        )
        if isinstance(out, torch.Tensor) and out._base is not None:
            out = out.clone()  # as in forward: a view output loses FSDP2's pre-backward hook under in-place ops
        return out


def _to_sequence_shard(x: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    if x.shape[1] % tp_mesh.size():
        raise ConfigError(
            f"sequence parallel: sequence length {x.shape[1]} is not divisible by tp={tp_mesh.size()}; "
            "pad the sequence or plan without sequence_parallel"
        )
    # backward: all-gather of the sequence-sharded gradients (DTensor redistribute)
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(1)]).to_local()


def _from_sequence_shard(x: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    # backward: the (replicated) gradient of the whole sequence is sliced back to this rank's part
    return DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False).redistribute(tp_mesh, [Replicate()]).to_local()


def _graft(root: nn.Module, fqn: str, module: nn.Module) -> None:
    *parents, leaf = fqn.split(".")
    node = root
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = nn.Module()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


def cut_model(model: nn.Module, *, plan: Plan) -> list[PipelineChunk]:
    """All chunks of the plan, in stage-index order."""
    adapter = adapter_for(model, traced=True)
    ranges = cut_units(adapter.layout, plan.stages, unit_of=getattr(adapter, "unit_of", None))
    stages = sorted(plan.stages, key=lambda s: s.index)
    chunks = [PipelineChunk(model, adapter=adapter, lo=lo, hi=hi, stage=st) for st, (lo, hi) in zip(stages, ranges)]
    _check_shared_params(chunks, pp=plan.degrees.pp, model_name=type(model).__name__)
    return chunks


def _check_shared_params(chunks: list[PipelineChunk], *, pp: int, model_name: str) -> None:
    """Refuse a parameter that chunks on two pipeline ranks use, unless the first is the embedding's chunk (a tied
    head: ``TiedParam`` keeps the two copies equal). Any other copy would train apart from its twin (a norm shared
    by every layer, say)."""
    first: dict[int, tuple[int, str]] = {}
    for idx, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            owner = first.setdefault(id(p), (idx, name))
            if owner[0] != 0 and owner[0] % pp != idx % pp:
                raise UnsupportedModelError(
                    f"pipeline parallelism cannot run {model_name}: parameter {owner[1]!r} is used by stage "
                    f"{owner[0]} and by stage {idx} ({name!r}) on another pipeline rank, and only the embedding's "
                    "weight may be shared across ranks (a tied head); plan with pp=1 (--fix pp=1) or give each "
                    "layer its own module"
                )


# --- schedules --------------------------------------------------------------------------------------------


def make_schedule(stages: list[Any], *, name: str, num_microbatches: int, loss_fn: Callable[..., Any]) -> Any:
    """The torch schedule object for the plan's schedule name (see the module docstring)."""
    multi = {"interleaved-1f1b": pl.ScheduleInterleaved1F1B, "zero-bubble": pl.ScheduleInterleavedZeroBubble}
    single = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B}
    try:
        if name in multi:
            return multi[name](stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
        if name in single:
            if len(stages) != 1:
                raise ConfigError(
                    f"schedule {name!r} runs one chunk per rank but this rank has {len(stages)} "
                    "(virtual_stages > 1): use schedule 'interleaved-1f1b' or virtual_stages=1"
                )
            return single[name](stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    except ValueError as e:  # torch's own checks (e.g. 1F1B needs num_microbatches >= pp)
        raise ConfigError(f"schedule {name!r} with {num_microbatches} micro-batches: {e}") from None
    raise ConfigError(f"schedule {name!r} is unknown; choose gpipe, 1f1b, interleaved-1f1b or zero-bubble")


@dataclass(frozen=True, kw_only=True, slots=True)
class _Groups:
    pp: Any
    pp_rank: int
    dp: Any | None
    dp_size: int


def _groups(mesh: Any, plan: Plan) -> _Groups:
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names:
        raise ConfigError(f"mesh axes {names} have no 'pp' axis; build the mesh from plan.mesh")
    pp_size = mesh.size(names.index("pp"))
    if pp_size != plan.degrees.pp:
        raise PlanMismatchError(f"mesh pp axis has {pp_size} ranks but the plan has pp={plan.degrees.pp}")
    # the loss is averaged over the batch ranks (dp, times ep: with experts the ep all-to-all runs among the ranks
    # of one pipeline stage, which run the same schedule, micro-batch for micro-batch)
    batch = batch_mesh(mesh)
    dp_group = batch.get_group() if batch.size() > 1 else None
    return _Groups(pp=mesh.get_group("pp"), pp_rank=mesh.get_local_rank("pp"), dp=dp_group, dp_size=batch.size())


def default_mesh(plan: Plan, *, device_type: str = "cpu") -> Any:
    """A DeviceMesh laid out as the plan says (all five axes, size-1 ones included)."""
    return init_device_mesh(device_type, tuple(plan.mesh.axis_sizes), mesh_dim_names=tuple(plan.mesh.axis_names))


def _check_stage_ranks(plan: Plan) -> None:
    pp = plan.degrees.pp
    for st in plan.stages:
        if st.pp_rank != st.index % pp:
            raise PlanMismatchError(
                f"stage {st.index} is placed on pp rank {st.pp_rank}, but chunk i runs on pp rank i % pp = "
                f"{st.index % pp} (loop placement): re-plan or fix the plan's stages"
            )


# --- the runner -------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TiedParam:
    """A parameter of the embedding (chunk 0) that a chunk on another pp rank also uses (a tied LM head)."""

    embed_name: str
    head_chunk: int
    head_name: str


def _tied_params(chunks: list[PipelineChunk], plan: Plan) -> list[TiedParam]:
    pp = plan.degrees.pp
    first = {id(p): n for n, p in chunks[0].named_parameters()}
    tied = []
    for idx, chunk in enumerate(chunks[1:], start=1):
        if idx % pp == 0:
            continue  # on the embedding's rank: one parameter object, autograd sums the two uses
        for name, p in chunk.named_parameters():
            if id(p) in first:
                tied.append(TiedParam(embed_name=first[id(p)], head_chunk=idx, head_name=name))
    return tied


def _tied_group(mesh: Any, tied: list[TiedParam], plan: Plan) -> Any | None:
    """Process group {embedding rank, head rank} of this rank's pipeline (None if nothing is tied)."""
    if not tied:
        return None
    head_pp_ranks = sorted({t.head_chunk % plan.degrees.pp for t in tied})
    if len(head_pp_ranks) != 1:
        raise ConfigError(f"tied embedding used on several pp ranks {head_pp_ranks}; untie the LM head")
    names = tuple(mesh.mesh_dim_names)
    grid = mesh.mesh.movedim(names.index("pp"), 0).reshape(plan.degrees.pp, -1)  # (pp, rest) global ranks
    pairs = [[int(grid[0, j]), int(grid[head_pp_ranks[0], j])] for j in range(grid.shape[1])]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def _input_ids(inputs: Any) -> torch.Tensor:
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, (tuple, list)) and len(inputs) == 1 and isinstance(inputs[0], torch.Tensor):
        return inputs[0]
    if isinstance(inputs, dict) and isinstance(inputs.get("input_ids"), torch.Tensor):
        return inputs["input_ids"]
    raise ConfigError(
        f"pipeline inputs must be a token-id tensor (B, T), a 1-tuple of it or {{'input_ids': ...}}; "
        f"got {type(inputs).__name__}"
    )


class PipelineRunner:
    """The local chunks of a pipeline and the schedule that runs them; see ``build_pipeline``."""

    def __init__(
        self,
        *,
        plan: Plan,
        chunks: dict[int, PipelineChunk],
        stages: list[Any],
        schedule: Any,
        groups: _Groups,
        tied: list[TiedParam],
        tied_group: Any | None,
        device: torch.device,
    ) -> None:
        self.plan = plan
        self.chunks = chunks
        """Local chunks by stage index (``pp_rank``, ``pp_rank + pp``, ...)."""
        self.stages = stages
        self.schedule = schedule
        self.pp_rank = groups.pp_rank
        self._groups = groups
        self._tied = tied
        self._tied_group = tied_group
        self._tied_synced = False
        self._device = device
        n_stages = len(plan.stages)
        self.has_first = 0 in chunks
        self.has_last = n_stages - 1 in chunks
        self.logits_mesh = _logits_mesh(chunks.get(n_stages - 1))
        """The tp mesh of vocabulary-sharded logits on the last stage (None: whole logits, or not this rank's)."""

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What the schedule's steps run under: ``loss_parallel`` where the last stage's logits are
        vocabulary-sharded (its forward and backward ops need it), else nothing."""
        return loss_parallel() if self.logits_mesh is not None else contextlib.nullcontext()

    @property
    def modules(self) -> list[PipelineChunk]:
        return [self.chunks[i] for i in sorted(self.chunks)]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The local chunks' parameters under the model's own FQNs, each once; a tied head weight under the
        embedding's name (the name ``model.named_parameters()`` gives it, as without a pipeline)."""
        seen: set[int] = set()
        owner = {(t.head_chunk, t.head_name): t.embed_name for t in self._tied}
        for idx in sorted(self.chunks):
            for name, p in self.chunks[idx].named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield owner.get((idx, name), name), p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """Forward + backward over the plan's micro-batches; the global mean loss (a 0-d tensor) on every rank."""
        n_mb = self.plan.schedule.num_microbatches
        input_ids = _input_ids(inputs)
        if input_ids.shape[0] % n_mb:
            raise ConfigError(
                f"local batch {input_ids.shape[0]} does not split into num_microbatches={n_mb}: give each "
                f"data-parallel rank a multiple of {n_mb} sequences (microbatch_size="
                f"{self.plan.schedule.microbatch_size})"
            )
        if self._tied and not self._tied_synced:
            self._broadcast_tied()
            self._tied_synced = True
        args = (input_ids.to(self._device),) if self.has_first else ()
        target = targets.to(self._device) if self.has_last else None
        losses: list[torch.Tensor] = []
        with self.loss_context():
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        loss = torch.zeros((), dtype=torch.float32, device=self._device)
        if self.has_last:
            # each micro-batch loss was divided by n_mb for the backward (see build_pipeline): sum = mean
            loss = torch.stack([x.detach().float() for x in losses]).sum()
        dist.all_reduce(loss, group=self._groups.pp)  # only the last stage contributes
        self._reduce_tied_grads()
        if self._groups.dp is not None:
            dist.all_reduce(loss, group=self._groups.dp)
            loss /= self._groups.dp_size
        return loss

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def _tied_local(self) -> list[nn.Parameter]:
        out = []
        for t in self._tied:
            if self.has_first:
                out.append(self.chunks[0].get_parameter(t.embed_name))
            elif t.head_chunk in self.chunks:
                out.append(self.chunks[t.head_chunk].get_parameter(t.head_name))
        return out

    def _broadcast_tied(self) -> None:
        src = dist.get_global_rank(self._tied_group, 0) if self._tied_group is not None else 0
        for p in self._tied_local():
            dist.broadcast(self._local(p.data), src=src, group=self._tied_group)

    def _reduce_tied_grads(self) -> None:
        for p in self._tied_local():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
                # a vocab-parallel embedding's weight gradient comes back Replicate / Partial, not Shard(0) like
                # the weight (and the head's): both ranks must all-reduce same-sized local shards
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            dist.all_reduce(self._local(p.grad), group=self._tied_group)


class _Stage(PipelineStage):
    """``PipelineStage`` whose FSDP2 chunk accumulates gradients as the plan's ZeRO stage says
    (``runtime.data_parallel.gradient_sync``). Torch's own stage turns gradient sync and resharding off for
    every backward and reduces once at the end (``perform_reduce_grad``): kept for ZeRO 1 (unsharded
    gradients accumulate). For ZeRO 2 / 3 each micro-batch's backward reduce-scatters into the sharded
    gradient (ZeRO 3 reshards after it too), so no unsharded gradient outlives its layer's backward."""

    def __init__(self, *args: Any, plan: Plan, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plan = plan

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        reduce, _ = gradient_sync(self._plan)
        if not (reduce and isinstance(self.submod, FSDPModule) and backward_type == "full"):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        set_microbatch_sync(self.submod, self._plan, last=last_backward)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


def _check_fsdp_schedule(local: dict[int, nn.Module], plan: Plan) -> None:
    fsdp = any(isinstance(m, FSDPModule) for c in local.values() for m in c.modules())
    if fsdp and plan.schedule.name == "zero-bubble":
        # Measured (torch 2.13, gloo, pp2 x dp2 ZeRO-3, tiny Llama): the first step's loss matches the
        # single-process model, later ones do not (so the gradients are wrong); with 1F1B they match. The cause
        # (split weight-gradient pass x FSDP2 gradient reduce-scatter) was not isolated further.
        raise ConfigError(
            f"schedule 'zero-bubble' with FSDP (zero_stage={plan.zero_stage}, dp={plan.degrees.dp}) gives wrong "
            "gradients in this torch version: use 'interleaved-1f1b' or '1f1b', or zero_stage=0"
        )


def _logits_mesh(chunk: nn.Module | None) -> Any | None:
    """The last chunk's ``logits_mesh`` (under a DDP wrapper, the chunk's); None without that chunk."""
    return None if chunk is None else getattr(unwrap(chunk), "logits_mesh", None)


def _device_of(mesh: Any) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def build_pipeline(
    model: nn.Module,
    *,
    plan: Plan,
    mesh: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    parallelize_chunk: Callable[[PipelineChunk], nn.Module] | None = None,
) -> PipelineRunner:
    """Cut ``model`` per ``plan.stages`` and build this rank's stages and the plan's schedule.

    ``mesh``: the DeviceMesh with a ``pp`` axis (and ``dp``), as ``default_mesh(plan)`` builds; None builds that.
    ``loss_fn(logits (B, T, V), targets (B, T)) -> mean loss`` of one micro-batch.
    ``parallelize_chunk``: applied to each local chunk before its stage is built (``runtime.parallelize``:
    recomputation, TP, experts, FSDP, materialisation); it must return a module with the same forward.
    Gradients are left as each chunk's backward (and its FSDP wrapper, if any) leaves them: under ZeRO 0 over
    several batch ranks the caller averages them (``runtime.data_parallel.average_gradients``).
    """
    _check_stage_ranks(plan)
    if mesh is None:
        mesh = default_mesh(plan, device_type="cuda" if dist.get_backend() == "nccl" else "cpu")
    groups = _groups(mesh, plan)
    all_chunks = cut_model(model, plan=plan)
    tied = _tied_params(all_chunks, plan)
    tied_group = _tied_group(mesh, tied, plan)
    pp = plan.degrees.pp
    device = _device_of(mesh)
    local = {i: c for i, c in enumerate(all_chunks) if i % pp == groups.pp_rank}
    if plan.sequence_parallel and plan.degrees.tp > 1:
        for chunk in local.values():
            chunk.sp_mesh = mesh["tp"]
    if parallelize_chunk is not None:
        local = {i: parallelize_chunk(c) for i, c in local.items()}
    _check_fsdp_schedule(local, plan)
    stages = [
        _Stage(local[i], stage_index=i, num_stages=len(all_chunks), device=device, group=groups.pp, plan=plan)
        for i in sorted(local)
    ]
    n_mb = plan.schedule.num_microbatches

    logits_mesh = _logits_mesh(local.get(len(all_chunks) - 1))

    def mb_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Scale here, not with the schedule's scale_grads (which divides all of .grad, earlier
        # accumulation included): the mean over micro-batches of equal size is the full-batch mean.
        if logits_mesh is None:
            return loss_fn(output, target) / n_mb
        # this rank's vocabulary shard of the logits: the loss-parallel cross-entropy over the tp ranks (under
        # PipelineRunner.loss_context), as ParallelModel runs it without a pipeline
        loss = loss_fn(DTensor.from_local(output, logits_mesh, [Shard(output.dim() - 1)], run_check=False), target)
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss) / n_mb

    schedule = make_schedule(stages, name=plan.schedule.name, num_microbatches=n_mb, loss_fn=mb_loss)
    logger.info(
        "pp rank %d: stages %s, schedule %s, %d micro-batches, tied %s",
        groups.pp_rank, sorted(local), type(schedule).__name__, n_mb, [t.embed_name for t in tied],
    )
    return PipelineRunner(
        plan=plan, chunks=local, stages=stages, schedule=schedule, groups=groups, tied=tied, tied_group=tied_group,
        device=device,
    )
