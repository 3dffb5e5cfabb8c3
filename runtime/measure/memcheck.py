"""Peak memory of a plan's ranks as the runtime would allocate it, measured on fake tensors in this process.

``check_plan(plan, model_factory=..., ranks="first,middle,last")`` measures each chosen rank: the default
process group is torch's ``"fake"`` backend at the plan's world size with this rank's number (collectives return
at once, nothing is sent), the model is built on the meta device (the caller's factory,
``cli.commands.validate.build_model_for``) and the plan applied by ``runtime.apply_plan`` as in a real run, with
two changes: the parameters are materialised as fake tensors (``to_empty`` under a ``FakeTensorMode``: storages
with sizes and no memory; the seeded init is skipped, values do not matter here) and DDP is built under the
same mode. Then one training step runs on fake token batches (``plan.global_batch`` x ``plan.model.seq_len``, in
the precision the runtime trains the plan's devices with: on GPUs FSDP2 under ``MixedPrecisionPolicy(bf16, fp32)``
and the other modes under bf16 autocast with fp32 parameters (``runtime.data_parallel.mixed_precision`` and
``compute_autocast`` as on CUDA, applied to these CPU tensors); on CPUs bf16 autocast with fp32 parameters, as
``autopar validate`` runs it) with the optimizer the
measurement wing uses (fused AdamW, ``runtime.measure.validate``) whose states exist from a step before (the
steady state of step two onwards):

- pp = 1: ``ParallelModel.step`` itself (micro-batches in turn, DDP's ``no_sync`` but on the last, the loss
  all-reduce), then ``optimizer.step()``;
- pp > 1: this rank's own actions of the plan's torch schedule (``pipeline_order_with_comms`` of the
  interleaved / zero-bubble runtime schedules, ``pipeline_order`` of GPipe / 1F1B) in their order on the
  runtime's ``PipelineStage`` objects: forward per micro-batch, the last stage's loss, full / input / weight
  backward through ``stage.backward_maybe_with_nosync`` (FSDP2's gradient sync off for all but the reduce, as
  torch's schedules run it), FSDP2 unshard / reshard, ``perform_reduce_grad``; sends and receives are no-ops
  whose buffers are allocated as ``PipelineStage`` allocates them (one activation and one gradient receive
  buffer per micro-batch and chunk, kept across steps; the input gradients kept to the step's end), of shape
  (micro-batch, seq / cp, hidden) in the hidden states' dtype (bf16 under FSDP2's bf16 parameters, else the
  parameters'); then the tied-embedding gradient all-reduce, the
  ZeRO-0 gradient averaging and ``optimizer.step()``.

The count is ``runtime.measure.live_bytes.LiveBytes``: live storages by category at the peak. The prediction
beside it is the plan's: ``StagePlan.predicted_memory_gb`` of the rank's pipeline rank, and by term only for
the rank the plan's ``memory_breakdown_gb`` describes (the fullest). A rank exceeds its device when the measured
live bytes plus the predicted allocator reserve (CUDA context and fragmentation margin on GPUs,
``costmodel.memory.allocator_reserve_bytes``) are more than the bytes PyTorch can allocate on it
(``Accelerator.memory_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from costmodel.errors import ConfigError
from planner.plan import Plan
from runtime.measure.live_bytes import CATEGORIES, LiveBytes, fsdp_comm_labels, label_gradients, track_grads

log = logging.getLogger(__name__)

PREDICTED_TERMS = {
    "parameters": ("weights",),
    "gradients": ("gradients",),
    "optimizer": ("optimizer",),
    "activations": ("activations", "logits", "weight_casts"),
    "temporaries": (),
    "comm_buffers": ("comm_buffers",),
    "other": (),
}
"""Which of the cost model's memory terms (``costmodel.memory``) each measured category is compared with; the
allocator reserve is not a tensor and is added to the measurement for the capacity check instead."""

RANK_CHOICES = ("first", "middle", "last", "all-distinct")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMemory:
    """One rank's measured peak beside the plan's prediction (bytes)."""

    rank: int
    coords: dict[str, int]
    """The rank's index on each mesh axis (pp, dp, ep, cp, tp)."""
    measured_peak: int
    measured: dict[str, int]
    """Live bytes by category (``live_bytes.CATEGORIES``) at the peak."""
    peak_where: str
    """The step phase the peak fell in (``forward 3F5``, ``backward 1B0``, ``optimizer``, ...)."""
    local_param_bytes: int
    """Bytes of the distinct storages holding this rank's local parameter shards."""
    local_param_numel_bytes: int
    """Elements x element size of the local shards (below ``local_param_bytes`` by FSDP2's shard padding)."""
    predicted_total: float
    """The plan's per-device memory of this pipeline rank, allocator reserve included."""
    predicted_reserve: float
    """The allocator reserve in it: the plan's ``allocator_reserve`` term (the fullest rank's) when this is that
    rank, else recomputed from the prediction's other terms."""
    predicted: dict[str, float] | None
    """The prediction by measured category (``PREDICTED_TERMS``) where the plan has it for this rank."""
    capacity: float
    """Bytes PyTorch can allocate on the rank's device."""
    reserve_for_measured: float
    """The allocator reserve the measured peak needs on the device (CUDA context + fragmentation on a GPU)."""
    seconds: float
    notes: tuple[str, ...] = ()

    @property
    def predicted_tensors(self) -> float:
        """The prediction without the allocator reserve: what live tensor bytes are compared with."""
        return self.predicted_total - self.predicted_reserve

    @property
    def error(self) -> float:
        """(predicted - measured) / measured of the live tensor bytes."""
        return (self.predicted_tensors - self.measured_peak) / max(self.measured_peak, 1)

    @property
    def exceeds(self) -> bool:
        return self.measured_peak + self.reserve_for_measured > self.capacity

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "coords": dict(self.coords), "measured_peak_bytes": self.measured_peak,
            "measured_bytes": dict(self.measured), "peak_where": self.peak_where,
            "local_param_bytes": self.local_param_bytes, "local_param_numel_bytes": self.local_param_numel_bytes,
            "predicted_total_bytes": self.predicted_total, "predicted_reserve_bytes": self.predicted_reserve,
            "predicted_tensor_bytes": self.predicted_tensors,
            "predicted_bytes": None if self.predicted is None else dict(self.predicted),
            "error": self.error, "capacity_bytes": self.capacity,
            "reserve_for_measured_bytes": self.reserve_for_measured, "exceeds_capacity": self.exceeds,
            "seconds": self.seconds, "notes": list(self.notes),
        }


# --- which ranks -----------------------------------------------------------------------------------------------


def rank_coords(plan: Plan, rank: int) -> dict[str, int]:
    """``rank``'s index on each mesh axis (row-major over ``plan.mesh``, tp innermost)."""
    out: dict[str, int] = {}
    rest = rank
    for name, size in reversed(list(zip(plan.mesh.axis_names, plan.mesh.axis_sizes))):
        out[name] = rest % size
        rest //= size
    return {name: out[name] for name in plan.mesh.axis_names}


def rank_of(plan: Plan, coords: dict[str, int]) -> int:
    r = 0
    for name, size in zip(plan.mesh.axis_names, plan.mesh.axis_sizes):
        r = r * size + coords.get(name, 0)
    return r


def distinct_ranks(plan: Plan, spec: str = "first,middle,last") -> list[int]:
    """Global ranks to measure. ``first`` / ``middle`` / ``last``: the first rank of the first, middle and last
    pipeline rank (every other axis at 0); ``all-distinct``: every pipeline rank, each with the first and the
    last shard of tp, ep and dp (where uneven shards or padding could differ); or explicit ranks ``0,5,9``."""
    world = plan.degrees.world_size
    words = [w.strip() for w in spec.split(",") if w.strip()]
    if not words:
        raise ConfigError(f"--ranks {spec!r} names no rank; give first,middle,last, all-distinct or rank numbers")
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
    pp = sizes["pp"]
    out: list[int] = []
    for w in words:
        if w == "all-distinct":
            for p in range(pp):
                for tp in sorted({0, sizes["tp"] - 1}):
                    for ep in sorted({0, sizes["ep"] - 1}):
                        for dp in sorted({0, sizes["dp"] - 1}):
                            out.append(rank_of(plan, {"pp": p, "tp": tp, "ep": ep, "dp": dp}))
        elif w in ("first", "middle", "last"):
            p = {"first": 0, "middle": pp // 2, "last": pp - 1}[w]
            out.append(rank_of(plan, {"pp": p}))
        else:
            try:
                r = int(w)
            except ValueError:
                raise ConfigError(f"--ranks: {w!r} is not one of {', '.join(RANK_CHOICES)} or a rank number") from None
            if not 0 <= r < world:
                raise ConfigError(f"--ranks: rank {r} is outside the plan's world of {world} ranks (0-{world - 1})")
            out.append(r)
    return sorted(set(out))


# --- the prediction ------------------------------------------------------------------------------------------


def _accelerators(plan: Plan, pp_rank: int) -> list[Any]:
    from costmodel.profiles import get_accelerator

    stage = next(s for s in sorted(plan.stages, key=lambda s: s.index) if s.pp_rank == pp_rank)
    return [get_accelerator(n) for n in (stage.gpu or plan.cluster.gpu).split("+")]


def _on_gpu(plan: Plan, pp_rank: int) -> bool:
    """Whether the plan runs ``pp_rank`` on GPUs (the runtime's CUDA path: ``_cuda_runtime``)."""
    return any(a.kind == "gpu" for a in _accelerators(plan, pp_rank))


def _capacity_and_reserve(plan: Plan, pp_rank: int) -> tuple[float, Callable[[float], float]]:
    from costmodel.memory import allocator_reserve_bytes

    capacity = min(a.memory_bytes for a in _accelerators(plan, pp_rank))
    return capacity, functools.partial(allocator_reserve_bytes, gpu=_on_gpu(plan, pp_rank))


def predicted_for(plan: Plan, pp_rank: int) -> tuple[float, float, dict[str, float] | None]:
    """(total, allocator reserve, by measured category or None) the plan predicts for ``pp_rank``'s devices."""
    stages = [s for s in plan.stages if s.pp_rank == pp_rank]
    total = stages[0].predicted_memory_gb * 1e9
    terms = {k: v * 1e9 for k, v in plan.prediction.memory_breakdown_gb.items()}
    worst = max(s.predicted_memory_gb for s in plan.stages)
    mine = stages[0].predicted_memory_gb == worst and terms and math.isclose(
        sum(terms.values()), total, rel_tol=1e-6)
    if mine:
        by_cat = {c: sum(terms.get(t, 0.0) for t in ts) for c, ts in PREDICTED_TERMS.items()}
        return total, terms.get("allocator_reserve", 0.0), by_cat
    _, reserve_fn = _capacity_and_reserve(plan, pp_rank)
    # total = subtotal + reserve(subtotal), reserve linear in subtotal: solve for the reserve
    r0, r1 = reserve_fn(0.0), reserve_fn(1.0) - reserve_fn(0.0)
    subtotal = (total - r0) / (1.0 + r1) if total > r0 else total
    return total, total - subtotal, None


# --- the runtime on fake tensors --------------------------------------------------------------------------------


@contextlib.contextmanager
def _cuda_runtime(on_gpu: bool) -> Iterator[None]:
    """On a GPU plan, the runtime's CUDA precision on these CPU fake tensors: FSDP2 shards under
    ``runtime.data_parallel.mixed_precision("cuda")`` (bf16 gathered parameters and compute, fp32 reduction)."""
    import runtime.data_parallel as rdp

    if not on_gpu:
        yield
        return
    saved = rdp.mixed_precision
    rdp.mixed_precision = lambda device_type: saved("cuda")
    try:
        yield
    finally:
        rdp.mixed_precision = saved


def _step_autocast(modules: list[nn.Module], on_gpu: bool) -> contextlib.AbstractContextManager:
    """The autocast a step runs under: on a GPU plan ``runtime.data_parallel.compute_autocast`` decides (bf16
    where FSDP2 does not cast), applied to these CPU tensors; on a CPU plan bf16 autocast with fp32 parameters,
    as ``autopar validate`` runs it."""
    from runtime.data_parallel import compute_autocast

    if on_gpu and isinstance(compute_autocast(modules, "cuda"), contextlib.nullcontext):
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)


@contextlib.contextmanager
def _fake_runtime(fake: Any, mt: LiveBytes) -> Iterator[None]:
    """``runtime.parallelize`` materialises as fake tensors (``to_empty`` under ``fake``) and DDP is built under
    ``fake`` (its buckets fake too); the rest of ``apply_plan`` runs as it is (mesh coordinates are real)."""
    import runtime.data_parallel as rdp
    import runtime.parallelize as rp
    from runtime.materialize import retie, tied_parameters

    saved = rp.materialize, rdp.DistributedDataParallel

    def materialize(model: nn.Module, *, device: Any = "cpu", seed: int = 0, init_fn: Any = None,
                    init_owner: Any = None) -> nn.Module:
        ties = tied_parameters(model)
        with fake:
            model.to_empty(device=device)
        retie(model, ties)
        return model

    class FakeDDP(saved[1]):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with fake, mt.phase("comm_buffers", mt.where):  # its gradient buckets
                super().__init__(*args, **kwargs)

    import runtime.expert_parallel as rep

    saved_ep = rep._ep_forward
    rp.materialize, rdp.DistributedDataParallel, rep._ep_forward = materialize, FakeDDP, _ep_forward_balanced
    try:
        with _no_packed_sequences():
            yield
    finally:
        rp.materialize, rdp.DistributedDataParallel = saved
        rep._ep_forward = saved_ep


@contextlib.contextmanager
def _no_packed_sequences() -> Iterator[None]:
    """transformers' mask builders look for packed sequences in the position ids
    (``masking_utils.find_packed_sequence_indices``) and, when they cannot read the values (fake tensors count as
    tracing), assume packing and build a (B, 1, T, T) boolean mask per call, i.e. per micro-batch and chunk. The
    runtime's position ids are ``arange(T)`` per row (an unpadded causal LM, ``runtime.model_adapters``; the model's
    own forward makes the same from ``cache_position``): on real tensors the check finds one sequence per row and
    SDPA runs ``is_causal`` with no mask. Under ``autopar check`` a fake position-id tensor is taken as that."""
    try:
        import transformers.masking_utils as mu
    except ImportError:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    saved = mu.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if isinstance(position_ids, FakeTensor):
            return None
        return saved(position_ids)

    mu.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = saved


def _ep_forward_balanced(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """``runtime.expert_parallel._ep_forward`` with the routing counts fake tensors cannot give (they are data):
    every ep rank sends and receives ``tokens x top-k / ep`` rows and each local expert takes an equal share
    (balanced routing, the load the router's auxiliary loss aims at); the same ops on the same shapes otherwise."""
    from runtime.expert_parallel import a2a_autograd, ep_experts, exchange_counts

    group, ep, local_e = self._autopar_ep_group, self._autopar_ep, self._autopar_local_experts
    n, k = top_k_index.shape
    rows = n * k
    split = [rows // ep + (1 if r < rows % ep else 0) for r in range(ep)]
    send, recv = split, [split[dist.get_rank(group) if group is not None else 0]] * ep
    exchange_counts(torch.tensor(send), group)  # issued as the runtime issues it; its (fake) answer is not data
    token = torch.arange(n, device=hidden_states.device).repeat_interleave(k)
    expert = top_k_index.reshape(-1)
    order = torch.argsort(expert, stable=True)
    token, expert = token[order], expert[order]
    weight = top_k_weights.reshape(-1)[order]
    x = hidden_states[token]
    recv_x = a2a_autograd(x.new_empty((sum(recv),) + tuple(x.shape[1:])), x, output_split_sizes=recv,
                          input_split_sizes=send, group=group)
    per = sum(recv) // local_e
    return ep_experts(self, hidden_states, recv_x, expert=expert, token=token, weight=weight, send=send, recv=recv,
                      rows_of=lambda j, _: torch.arange(j * per, (j + 1) * per, device=recv_x.device))


def _hidden_size(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"):
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            return v
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(emb, nn.Embedding):
        return emb.embedding_dim
    raise ConfigError(f"cannot tell the hidden size of {type(model).__name__} for the pipeline buffers")


def check_rank(plan: Plan, rank: int, *, model_factory: Callable[[], nn.Module],
               microbatches: str | int = "auto",
               step_mode: Callable[[Any], contextlib.AbstractContextManager] | None = None) -> RankMemory:
    """Measure ``rank`` of ``plan`` (the module docstring); the default process group must not be initialised.
    ``model_factory()`` builds the plan's model on the meta device (``cli.commands.validate.build_model_for``).
    ``step_mode(pm)``, given the rank's ``ParallelModel``, is entered around the step and the optimizer step
    (e.g. ``runtime.measure.comm_trace.CollectiveRecorder``: the collectives the rank issues)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.apply import apply_plan
    from runtime.measure.validate import _optimizer, _vocab_of, lm_loss
    from runtime.mesh import build_mesh

    if dist.is_initialized():
        raise ConfigError("check_rank needs a process without a default process group (it makes a fake one)")
    t0 = time.perf_counter()
    world = plan.degrees.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = model_factory()
        mesh = build_mesh(plan, device_type="cpu")
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        mt = LiveBytes()
        on_gpu = _on_gpu(plan, rank_coords(plan, rank)["pp"])
        with fake, mt, fsdp_comm_labels(mt), _fake_runtime(fake, mt), _cuda_runtime(on_gpu), \
                contextlib.ExitStack() as stepping:
            with unset_fake_temporarily(), mt.phase("other", "setup"):
                pm = apply_plan(model, plan, mesh=mesh, loss_fn=lm_loss, seed=0)
            params = list(pm.parameters())
            mt.relabel(params, "parameters")
            modules = pm.pipeline.modules if pm.pipeline is not None else [pm.module]
            hooks = track_grads(mt, params)
            opt = _optimizer(params)
            with mt.phase("optimizer", "optimizer states"):
                _init_optimizer_states(opt, params)
            for o in opt.optimizers:
                mt.relabel([v for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
                           "optimizer")
            if step_mode is not None:
                stepping.enter_context(step_mode(pm))
            notes: list[str] = []
            if plan.degrees.ep > 1:
                notes.append(f"expert routing balanced (each of ep={plan.degrees.ep} ranks gets tokens x top-k / ep "
                             "rows, each local expert an equal share): fake tensors carry no router decisions")
            vocab = _vocab_of(model)
            with _step_autocast(modules, on_gpu):
                if pm.pipeline is None:
                    mt.reset_peak()
                    ids = torch.randint(0, vocab, (plan.global_batch, max(plan.model.seq_len, 1) + 1))
                    with mt.phase("activations", "forward / backward"):
                        pm.step(ids[:, :-1], ids[:, 1:])
                else:  # under loss parallel where the last stage's logits are vocabulary-sharded, as the runtime
                    with pm.pipeline.loss_context():
                        notes += _replay_pipeline(pm, plan, mt, vocab=vocab, hidden=_hidden_size(model),
                                                  modules=modules, microbatches=microbatches)
            label_gradients(mt, params, modules)
            with mt.phase("temporaries", "optimizer step"):
                opt.step()
            for h in hooks:
                h.remove()
            local = mt.bytes_of(params)
            numel_bytes = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                              for p in params)
            measured = dict(mt.peak_by_category)
            peak, where = mt.peak, mt.peak_where
            del opt, pm, params, modules
    finally:
        dist.destroy_process_group()
    coords = rank_coords(plan, rank)
    total, reserve, by_cat = predicted_for(plan, coords["pp"])
    capacity, reserve_fn = _capacity_and_reserve(plan, coords["pp"])
    return RankMemory(
        rank=rank, coords=coords, measured_peak=peak, measured=measured, peak_where=where,
        local_param_bytes=local, local_param_numel_bytes=numel_bytes, predicted_total=total,
        predicted_reserve=reserve, predicted=by_cat, capacity=capacity,
        reserve_for_measured=reserve_fn(float(peak)), seconds=time.perf_counter() - t0, notes=tuple(notes),
    )


def _init_optimizer_states(opt: Any, params: list[nn.Parameter]) -> None:
    """One optimizer step on zero gradients: the states a step after the first holds, then no gradients."""
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def replayed_microbatches(plan: Plan, requested: str | int = "auto", pp_rank: int | None = None) -> int:
    """How many of the plan's micro-batches pipeline rank ``pp_rank`` replays (None: the first, which replays
    the most). ``all``: every one. ``auto``: all under GPipe (every forward is in flight before the first
    backward) and without a pipeline; 1F1B the rank's warm-up (``pp - pp_rank`` forwards) and 2 micro-batches of
    steady state; the interleaved / zero-bubble schedules ``2 pp`` (whole rounds of pp): a rank's warm-up is at
    most ``(v - 1) pp + 2 (pp - 1)`` of the ``2 pp v`` chunk forwards (``costmodel.pipeline.inflight_array``),
    which leaves at least ``(v - 1) pp + 2`` steady (backward, forward) pairs, the same argument as below.

    Why 1F1B's peak is reached by then: after the warm-up a 1F1B stage alternates one backward and one forward,
    so the micro-batches in flight go w, w - 1, w, ... (w the warm-up) and each (backward, forward) pair frees
    what the pair before it allocated; the one thing a pair keeps is the parameters' gradients, made by the first
    backward and accumulated in place from the second on. The second steady pair is therefore the first in the
    periodic state, every later pair repeats its bytes, and the cool-down (replayed: the last backward's gradient
    reduction) holds fewer micro-batches. ``tests/test_check.py`` compares the peaks of ``auto`` and ``all``.
    A number: at most that many (at least what the schedule needs)."""
    n, pp, name = plan.schedule.num_microbatches, plan.degrees.pp, plan.schedule.name
    if requested == "all" or pp == 1 or name == "gpipe":
        return n
    if requested == "auto":
        if name == "1f1b":
            return min(n, pp - (pp_rank or 0) + 2)
        want = 2 * pp
    else:
        try:
            want = int(requested)
        except ValueError:
            raise ConfigError(f"--microbatches {requested!r}: give auto, all or a number") from None
        want = max(want, pp)
    if n % pp == 0:
        want = -(-want // pp) * pp  # whole rounds of pp
    return min(n, want)


def _single_stage_actions(name: str, stage: Any, n_mb: int) -> list:
    """The order ``ScheduleGPipe`` / ``Schedule1F1B._step_microbatches`` run one stage's micro-batches in (their
    ``pipeline_order`` tables are for drawing and differ from the loop for the last stages)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType as C

    i = stage.stage_index
    if name == "gpipe":
        order = [(C.FORWARD, j) for j in range(n_mb)] + [(C.FULL_BACKWARD, j) for j in range(n_mb)]
    else:
        warmup = min(n_mb, stage.num_stages - i)
        order = [(C.FORWARD, j) for j in range(warmup)]
        f, b = warmup, 0
        while True:
            order.append((C.FULL_BACKWARD, b))
            b += 1
            if f == n_mb:
                break
            order.append((C.FORWARD, f))
            f += 1
        order += [(C.FULL_BACKWARD, j) for j in range(b, n_mb)]
    return [_Action(i, k, j) for k, j in order] + [_Action(i, C.REDUCE_GRAD, None)]


def _actions(runner: Any, plan: Plan, n_mb: int) -> list:
    """This rank's actions of the runtime's torch schedule for ``n_mb`` micro-batches, in the order it runs them:
    the lowered ``pipeline_order_with_comms`` of the multi-chunk runtime schedules (interleaved 1F1B,
    zero-bubble: with their FSDP unshard / reshard and gradient reduction actions; for fewer micro-batches than
    the plan's, the same schedule class made for ``n_mb``), the loop of GPipe / 1F1B otherwise."""
    sch = runner.schedule
    order = getattr(sch, "pipeline_order_with_comms", None)
    if order:
        if n_mb != plan.schedule.num_microbatches:
            sch = type(sch)(runner.stages, n_microbatches=n_mb, loss_fn=sch._loss_fn, scale_grads=False)
            order = sch.pipeline_order_with_comms
        return list(order[runner.pp_rank])
    if len(runner.stages) != 1:
        raise ConfigError(f"schedule {plan.schedule.name!r} with {len(runner.stages)} chunks on a rank: "
                          "the runtime would refuse it too")
    return _single_stage_actions(plan.schedule.name, runner.stages[0], n_mb)


def _replay_pipeline(pm: Any, plan: Plan, mt: LiveBytes, *, vocab: int, hidden: int, modules: list[nn.Module],
                     microbatches: str | int = "auto") -> list[str]:
    """This rank's pipeline actions for one step (the module docstring); notes on what was approximated."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining.schedules import _ComputationType as C

    from runtime.data_parallel import average_gradients

    runner = pm.pipeline
    stages = {s.stage_index: s for s in runner.stages}
    all_mb, mb = plan.schedule.num_microbatches, plan.schedule.microbatch_size
    n_mb = replayed_microbatches(plan, microbatches, runner.pp_rank)
    seq = max(plan.model.seq_len, 1) // plan.degrees.cp
    # the dtype of the hidden states crossing a stage: bf16 where FSDP2 gathers bf16 parameters, else the
    # parameters' (fp32 under autocast: the embedding's output and the residual stream stay fp32)
    fsdp_bf16 = any(isinstance(m, FSDPModule) and m._get_fsdp_state()._mp_policy.param_dtype == torch.bfloat16
                    for root in modules for m in root.modules())
    dtype = torch.bfloat16 if fsdp_bf16 else next(iter(pm.parameters())).dtype
    notes: list[str] = []
    if n_mb < all_mb:
        notes.append(f"replayed {n_mb} of the plan's {all_mb} micro-batches (warm-up, steady 1F1B, cool-down; "
                     f"the steady micro-batches between repeat the same bytes), receive buffers allocated for all {all_mb}; "
                     "--microbatches all replays every one")
    with mt.phase("comm_buffers", "pipeline receive buffers"):
        recv = {(i, j): torch.empty(mb, seq, hidden, dtype=dtype)
                for i, s in stages.items() if not s.is_first for j in range(all_mb)}
        grad_recv = {(i, j): torch.empty(mb, seq, hidden, dtype=dtype)
                     for i, s in stages.items() if not s.is_last for j in range(all_mb)}
    # this rank's batch (every micro-batch a view of it, as torch's split gives the schedule)
    ids = list(torch.randint(0, vocab, (all_mb * mb, seq)).split(mb))
    targets = list(torch.randint(0, vocab, (all_mb * mb, seq)).split(mb))
    loss_of = runner.schedule._loss_fn
    mt.reset_peak()
    fwd: dict[tuple[int, int], tuple] = {}
    losses: dict[tuple[int, int], torch.Tensor] = {}
    bwd_state: dict[tuple[int, int], tuple] = {}
    backwards: dict[int, int] = defaultdict(int)
    for a in _actions(runner, plan, n_mb):
        kind, i, j = a.computation_type, a.stage_index, a.microbatch_index
        st = stages[i]
        tag = f"{i}{kind.value if hasattr(kind, 'value') else kind}{'' if j is None else j}"
        if kind == C.FORWARD:
            with mt.phase("activations", f"forward {tag}"):
                args = (ids[j],) if st.is_first else (recv[i, j].requires_grad_(True),)
                out = st.forward_maybe_with_nosync(*args)
                outs = out if isinstance(out, tuple) else (out,)
                fwd[i, j] = (outs, list(args) if not st.is_first else [])
                if st.is_last:
                    losses[i, j] = loss_of(out, targets[j])
            del out, outs, args
        elif kind in (C.FULL_BACKWARD, C.BACKWARD_INPUT):
            outs, inputs = fwd.pop((i, j))
            if st.is_last:
                kw = {"stage_output": losses[i, j], "output_grads": None, "input_values": inputs}
            else:
                kw = {"stage_output": outs, "output_grads": (grad_recv[i, j],), "input_values": inputs}
            with mt.phase("temporaries", f"backward {tag}"):
                if kind == C.FULL_BACKWARD:
                    backwards[i] += 1
                    st.backward_maybe_with_nosync("full", kw, last_backward=backwards[i] == n_mb)
                elif st.is_first:
                    bwd_state[i, j] = (inputs, None, kw["stage_output"], kw["output_grads"])
                else:
                    so = kw["stage_output"]
                    kw["stage_output"] = (so,) if isinstance(so, torch.Tensor) else so
                    _, groups = st.backward_maybe_with_nosync("input", kw, last_backward=False)
                    bwd_state[i, j] = (inputs, groups, kw["stage_output"], kw["output_grads"])
            if st.is_last and not st.is_first:
                for t in outs:
                    if isinstance(t, torch.Tensor) and not t._is_view():
                        t.detach_()
            for t in inputs:
                if isinstance(t, torch.Tensor) and t.grad is not None:
                    mt.relabel(t.grad, "comm_buffers")  # the gradient sent back, kept to the step's end
            label_gradients(mt, (), [st.submod])
            del outs, inputs, kw
        elif kind == C.BACKWARD_WEIGHT:
            inputs, groups, so, og = bwd_state.pop((i, j))
            backwards[i] += 1
            last = backwards[i] == n_mb
            with mt.phase("temporaries", f"backward {tag}"):
                if i != 0:
                    st.backward_maybe_with_nosync("weight", {"stage_output": so, "param_groups": groups},
                                                  last_backward=last)
                else:
                    st.backward_maybe_with_nosync("full", {"stage_output": so, "output_grads": og,
                                                           "input_values": inputs}, last_backward=last)
            label_gradients(mt, (), [st.submod])
            del inputs, groups, so, og
        elif kind == C.UNSHARD:
            if isinstance(st.submod, FSDPModule):
                with mt.phase("comm_buffers", f"unshard {tag}"):
                    for m in st.submod.modules():
                        if isinstance(m, FSDPModule):
                            m.unshard()
        elif kind == C.RESHARD:
            if isinstance(st.submod, FSDPModule):
                for m in st.submod.modules():
                    if isinstance(m, FSDPModule):
                        m.reshard()
        elif kind == C.REDUCE_GRAD:
            with mt.phase("temporaries", f"reduce gradients {tag}"):
                st.perform_reduce_grad(1)
            label_gradients(mt, (), [st.submod])
        # SEND_F / RECV_F / SEND_B / RECV_B: no-ops (the receive buffers above are what they fill)
    with mt.phase("temporaries", "gradient sync"):
        runner._reduce_tied_grads()
        if pm.average_grads:
            average_gradients(pm.named_parameters(), mesh=pm.mesh, expert_params=pm.expert_params)
    if fwd:
        notes.append(f"{len(fwd)} forward(s) without a backward in the schedule")
    del losses, recv, grad_recv
    return notes


def _check_in_child(plan: Plan, rank: int, factory: Callable[[], nn.Module], microbatches: str | int) -> RankMemory:
    import traceback

    torch.set_num_threads(1)
    try:
        return check_rank(plan, rank, model_factory=factory, microbatches=microbatches)
    except Exception as e:  # noqa: BLE001 - torch's exceptions do not all pickle back to the parent
        raise RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}") from None


def check_plan(plan: Plan, *, model_factory: Callable[[], nn.Module], ranks: str = "first,middle,last",
               workers: int | None = None,
               microbatches: str | int = "auto",
               progress: Callable[[RankMemory], None] | None = None) -> list[RankMemory]:
    """``check_rank`` for each rank ``distinct_ranks(plan, ranks)`` names (``microbatches``:
    ``replayed_microbatches``), each in a fresh process (a process
    group, its meshes and the runtime's patches do not outlive a rank; ``model_factory`` must pickle by name),
    ``workers`` at a time (default: the CPU
    count, at most the ranks); results in rank order. A rank that fails raises ``runtime.measure.spawn.RankError``
    with its traceback."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    from runtime.measure.spawn import RankError

    chosen = distinct_ranks(plan, ranks)
    replayed_microbatches(plan, microbatches)  # a bad value is an error before anything runs
    for r in chosen:  # an unknown device is an error before anything is measured
        _capacity_and_reserve(plan, rank_coords(plan, r)["pp"])
    n = max(1, min(len(chosen), workers or os.cpu_count() or 1))
    out: dict[int, RankMemory] = {}
    with cf.ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn"), max_tasks_per_child=1) as pool:
        futures = {pool.submit(_check_in_child, plan, r, model_factory, microbatches): r for r in chosen}
        for fut in cf.as_completed(futures):
            r = futures[fut]
            try:
                out[r] = fut.result()
            except Exception as e:  # noqa: BLE001 - reported with the rank that failed
                for f in futures:
                    f.cancel()
                raise RankError(f"check: rank {r} failed: {type(e).__name__}: {e}") from e
            if progress is not None:
                progress(out[r])
    return [out[r] for r in chosen]
