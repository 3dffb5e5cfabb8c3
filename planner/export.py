"""Translate a plan into the settings of other training frameworks.

``export_plan(plan, target)`` returns the target's equivalent settings as text (Megatron-LM command-line
flags, a torchtitan TOML fragment, a DeepSpeed JSON config) and the list of what the target cannot express,
each naming the plan's choice and what the export does instead. Nothing is silently dropped: every plan
field either appears in the text or in ``unsupported``.

Layer counts per pipeline chunk come from the stages' module FQNs: a module whose FQN ends in an integer
index (``model.layers.17``) is one transformer layer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

import tomli_w

from costmodel.errors import ConfigError
from planner.plan import Plan

TARGETS = ("megatron", "torchtitan", "deepspeed")
_LAYER_RE = re.compile(r"(?:^|\.)(\d+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportResult:
    target: str
    text: str
    """The settings, ready to paste (flags, TOML or JSON)."""
    unsupported: list[str] = field(default_factory=list)
    """What the target cannot express, and what the export does instead."""


def export_plan(plan: Plan, target: str) -> ExportResult:
    """``target`` in ``TARGETS``; ConfigError listing them otherwise."""
    exporters: dict[str, Callable[[Plan], ExportResult]] = {
        "megatron": _megatron,
        "torchtitan": _torchtitan,
        "deepspeed": _deepspeed,
    }
    if target not in exporters:
        raise ConfigError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    return exporters[target](plan)


def layers_per_stage(plan: Plan) -> list[int]:
    """Transformer layers in each pipeline chunk, in chunk order."""
    return [sum(1 for m in st.modules if _LAYER_RE.search(m)) for st in plan.stages]


def _layer_index(fqn: str) -> int | None:
    m = _LAYER_RE.search(fqn)
    return int(m.group(1)) if m else None


def _recompute(plan: Plan) -> tuple[str, bool]:
    """(the plan's recomputation if uniform else the heaviest used, whether it differs between stages)."""
    kinds = {st.recompute for st in plan.stages}
    for k in ("full", "selective", "none"):
        if k in kinds:
            return k, len(kinds) > 1
    return "none", False


def _common_notes(plan: Plan, heaviest: str, mixed: bool) -> list[str]:
    notes = []
    if mixed:
        per = ", ".join(f"chunk {st.index}: {st.recompute}" for st in plan.stages)
        notes.append(f"recomputation differs between pipeline chunks ({per}); exported as {heaviest!r} everywhere")
    sharded = [m for m in plan.shardings if m.style not in ("replicate", "colwise", "rowwise", "vocab_embedding",
                                                             "vocab_head", "sequence_parallel", "expert")]
    if sharded:
        notes.append(f"module shardings {[m.fqn for m in sharded]} have styles the target has no setting for")
    return notes


# --- Megatron-LM ------------------------------------------------------------------------------------------


def _megatron(plan: Plan) -> ExportResult:
    d, s = plan.degrees, plan.schedule
    flags: list[str] = [
        f"--tensor-model-parallel-size {d.tp}",
        f"--pipeline-model-parallel-size {d.pp}",
    ]
    notes: list[str] = []
    if d.cp > 1:
        flags.append(f"--context-parallel-size {d.cp}")
    if d.ep > 1:
        flags.append(f"--expert-model-parallel-size {d.ep}")
    per_chunk = layers_per_stage(plan)
    total_layers = sum(per_chunk) or plan.model.num_layers
    if s.virtual_stages > 1:
        if len(set(per_chunk)) == 1:
            flags.append(f"--num-layers-per-virtual-pipeline-stage {per_chunk[0]}")
        else:
            notes.append(f"interleaved chunks have uneven layer counts {per_chunk}; Megatron needs equal chunks: "
                         f"exported {total_layers // len(per_chunk)} layers per virtual stage")
            flags.append(f"--num-layers-per-virtual-pipeline-stage {max(1, total_layers // len(per_chunk))}")
    elif d.pp > 1 and len(set(per_chunk)) > 1:
        notes.extend(_megatron_uneven(per_chunk, flags))
    if s.name == "gpipe":
        notes.append("schedule gpipe: Megatron runs 1F1B (same bubble, less activation memory)")
    elif s.name == "zero-bubble":
        notes.append("schedule zero-bubble: Megatron-LM has no zero-bubble schedule; it runs 1F1B "
                     "(larger bubble than planned)")
    if plan.sequence_parallel:
        flags.append("--sequence-parallel")
    heaviest, mixed = _recompute(plan)
    if heaviest == "selective":
        flags.append("--recompute-granularity selective")
    elif heaviest == "full":
        flags += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    flags += [f"--micro-batch-size {s.microbatch_size}", f"--global-batch-size {plan.global_batch}",
              f"--num-layers {total_layers}", f"--seq-length {plan.model.seq_len}", "--bf16"]
    if plan.zero_stage in (1, 2):
        flags.append("--use-distributed-optimizer")
        if plan.zero_stage == 1:
            notes.append("zero_stage=1: Megatron's distributed optimizer also shards gradients (ZeRO-2-like): "
                         "memory is lower than planned, traffic the same")
    elif plan.zero_stage == 3:
        flags.append("--use-torch-fsdp2")
        notes.append("zero_stage=3: exported as --use-torch-fsdp2 (Megatron-core FSDP2 path); "
                     "check that your Megatron version has it")
    notes += _common_notes(plan, heaviest, mixed)
    header = (f"# {plan.model.name} on {plan.cluster.name}: world size {d.world_size} = "
              f"tp {d.tp} x cp {d.cp} x pp {d.pp} x dp {d.dp} (Megatron derives dp)\n")
    return ExportResult(target="megatron", text=header + " \\\n".join(flags) + "\n", unsupported=notes)


def _megatron_uneven(per_chunk: list[int], flags: list[str]) -> list[str]:
    """Megatron can set the first and last stage's layers; the middle ones must then be equal."""
    first, *middle, last = per_chunk
    if len(set(middle)) <= 1:
        flags += [f"--decoder-first-pipeline-num-layers {first}", f"--decoder-last-pipeline-num-layers {last}"]
        return []
    even = sum(per_chunk) // len(per_chunk)
    return [f"uneven stage cuts {per_chunk}: Megatron only sets the first and last stage; exported an even "
            f"split ({even} layers per stage)"]


# --- torchtitan -------------------------------------------------------------------------------------------

_TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                    "zero-bubble": "InterleavedZeroBubble"}


def _torchtitan(plan: Plan) -> ExportResult:
    d, s = plan.degrees, plan.schedule
    notes: list[str] = []
    replicate, shard = (d.dp, 1) if plan.zero_stage == 0 else (1, d.dp)
    par: dict[str, object] = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": d.tp,
        "context_parallel_degree": d.cp,
        "pipeline_parallel_degree": d.pp,
        "expert_parallel_degree": d.ep,
    }
    if plan.zero_stage in (1, 2):
        par["fsdp_reshard_after_forward"] = "never"
        notes.append(f"zero_stage={plan.zero_stage}: torchtitan shards with FSDP2; exported as FSDP without "
                     "resharding after forward (ZeRO-2-like; parameters stay gathered until backward)")
    if d.pp > 1:
        par["pipeline_parallel_schedule"] = _TITAN_SCHEDULES[s.name]
        par["pipeline_parallel_microbatch_size"] = s.microbatch_size
        splits = _split_points(plan)
        if splits:
            par["pipeline_parallel_split_points"] = splits
    if s.name == "zero-bubble" and s.virtual_stages == 1:
        notes.append("zero-bubble with one chunk per rank: torchtitan's zero-bubble schedules are interleaved; "
                     "exported InterleavedZeroBubble, which needs 2+ chunks per rank")
    if d.tp > 1 and not plan.sequence_parallel:
        notes.append("sequence_parallel=false: torchtitan's tensor parallelism always shards norms over the "
                     "sequence (less activation memory than planned)")
    heaviest, mixed = _recompute(plan)
    ac: dict[str, object] = {"mode": heaviest}
    if heaviest == "selective":
        ac["selective_ac_option"] = "op"
    training = {"local_batch_size": s.microbatch_size * s.num_microbatches, "global_batch_size": plan.global_batch,
                "seq_len": plan.model.seq_len, "mixed_precision_param": "bfloat16"}
    notes += _common_notes(plan, heaviest, mixed)
    sections = {"parallelism": par, "activation_checkpoint": ac, "training": training}
    text = f"# {plan.model.name} on {plan.cluster.name}: {d.world_size} ranks\n\n" + tomli_w.dumps(sections)
    return ExportResult(target="torchtitan", text=text, unsupported=notes)


def _split_points(plan: Plan) -> list[str]:
    """torchtitan split points: the first layer of every chunk after the first (``layers.N``)."""
    points = []
    for st in plan.stages[1:]:
        idx = [i for i in map(_layer_index, st.modules) if i is not None]
        if idx:
            points.append(f"layers.{min(idx)}")
    return points


# --- DeepSpeed --------------------------------------------------------------------------------------------


def _deepspeed(plan: Plan) -> ExportResult:
    d, s = plan.degrees, plan.schedule
    notes: list[str] = []
    cfg: dict[str, object] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": s.microbatch_size,
        "gradient_accumulation_steps": s.num_microbatches,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": plan.zero_stage, "overlap_comm": True, "contiguous_gradients": True},
    }
    if d.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": d.tp}
        if plan.sequence_parallel:
            notes.append("sequence_parallel=true: DeepSpeed AutoTP has no Megatron-style sequence parallelism "
                         "(activations of norms stay replicated: more memory than planned)")
    if d.pp > 1:
        notes.append(f"pp={d.pp}: DeepSpeed pipelines are built in code, "
                     f"deepspeed.pipe.PipelineModule(layers=..., num_stages={d.pp}); its schedule is 1F1B"
                     + (f", not {s.name}" if s.name != "1f1b" else ""))
        if s.virtual_stages > 1:
            notes.append(f"virtual_stages={s.virtual_stages}: DeepSpeed has no interleaved pipeline schedule")
    if d.cp > 1:
        notes.append(f"cp={d.cp}: DeepSpeed's sequence parallelism is Ulysses (all-to-all), set in code with "
                     f"sequence_parallel_size={d.cp}; it is not ring context parallelism")
    if d.ep > 1:
        notes.append(f"ep={d.ep}: set deepspeed.moe.layer.MoE(ep_size={d.ep}) in the model code")
    heaviest, mixed = _recompute(plan)
    if heaviest != "none":
        cfg["activation_checkpointing"] = {"partition_activations": d.tp > 1, "contiguous_memory_optimization": False,
                                           "number_checkpoints": None, "synchronize_checkpoint_boundary": False}
        notes.append(f"recompute={heaviest}: DeepSpeed checkpoints whole layers the model wraps in "
                     "deepspeed.checkpointing.checkpoint" + ("; selective recomputation is not expressible"
                                                             if heaviest == "selective" else ""))
    notes += _common_notes(plan, heaviest, mixed)
    return ExportResult(target="deepspeed", text=json.dumps(cfg, indent=2) + "\n", unsupported=notes)
