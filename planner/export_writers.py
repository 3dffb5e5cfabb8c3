"""The settings each export target starts from: one writer per target, ``(plan, dims, memory) -> (text, file
name, notes)``, the notes saying what runs differently there than the plan priced.

- Megatron-LM: a ``torchrun ... pretrain_gpt.py`` script with the model shape, the parallel layout, batch,
  recomputation, ZeRO and overlap flags, the precision's flags (``--fp8-format hybrid --fp8-recipe ...``,
  ``--fp4-recipe nvfp4``; profiles/targets/megatron.toml) and ``--tp-comm-overlap`` when the plan priced it
  (every flag is one of ``megatron/training/arguments.py``'s; the test
  checks them against ``tests/data/megatron_arguments_flags.txt``).
- torchtitan 0.3.0: a config-registry module (``--module <file> --config autopar_job``) that starts from the
  llama3 registry job and sets the model shape, parallelism, batch and activation checkpointing.
- DeepSpeed: the JSON config of ``deepspeed.initialize``; pipelines, tp and experts it sets in code are notes.
"""

from __future__ import annotations

import json
from typing import Callable

from costmodel.errors import ConfigError
from costmodel.targets import load_target
from planner.export_check import MemoryCheck, layers_per_stage, heaviest_recompute, recompute_per_chunk
from planner.models import ModelDims
from planner.plan import Plan

Writer = Callable[[Plan, ModelDims, MemoryCheck], tuple[str, str, list[str]]]


def _launch(plan: Plan, script: str) -> str:
    c = plan.cluster
    rdzv = " --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500" if c.nodes > 1 else ""
    return f"torchrun --nnodes {c.nodes} --nproc-per-node {c.gpus_per_node}{rdzv} {script}"


def _summary(plan: Plan) -> str:
    d, s = plan.degrees, plan.schedule
    v = f" x {s.virtual_stages} chunks" if s.virtual_stages > 1 else ""
    return (f"{plan.model.name} on {plan.cluster.name} ({d.world_size} devices): tp {d.tp} x cp {d.cp} x pp {d.pp}"
            f"{v} x dp {d.dp} (ep {d.ep}), ZeRO-{plan.zero_stage}, {s.name}, micro-batch {s.microbatch_size} x "
            f"{s.num_microbatches}, global batch {plan.global_batch}")


# --- Megatron-LM ------------------------------------------------------------------------------------------


def megatron_args(plan: Plan, dims: ModelDims) -> tuple[list[str], list[str]]:
    """``pretrain_gpt.py`` arguments (flag, value, flag, ...) and the notes on what differs from the plan."""
    notes: list[str] = []
    args = _megatron_model(dims) + _megatron_layout(plan, notes) + _megatron_recompute(plan, notes)
    d = plan.degrees
    args += ["--micro-batch-size", str(plan.schedule.microbatch_size), "--global-batch-size", str(plan.global_batch)]
    args += megatron_precision_args(plan)
    if _priced_tp_overlap(plan):  # the plan priced Transformer Engine's GEMM / collective overlap
        args.append("--tp-comm-overlap")
    args += _megatron_option_args(plan, notes)
    sharded = d.dp * d.cp > 1
    if plan.zero_stage in (1, 2):
        args.append("--use-distributed-optimizer")
        if plan.zero_stage == 2:
            notes.append("ZeRO-2 runs as Megatron's distributed optimizer, which shards only the fp32 main parameters "
                         "and Adam states (ZeRO-1: 6 + 12/d bytes per parameter)")
    elif plan.zero_stage == 3:  # torch FSDP2 asserts these two (megatron/training/arguments.py validate_args)
        args += ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--ckpt-format", "torch_dist"]
    if sharded and plan.zero_stage < 3:  # the planner prices gradient reduction overlapped with the backward
        args.append("--overlap-grad-reduce")
        if plan.zero_stage in (1, 2):
            args.append("--overlap-param-gather")
    # a run that starts on its own: synthetic data, a fixed vocabulary, a short schedule
    args += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(dims.vocab),
             "--make-vocab-size-divisible-by", "1", "--train-iters", "100", "--lr", "1.0e-4"]
    return args, notes


def megatron_precision_args(plan: Plan) -> list[str]:
    """The flags of the plan's precision (``[precision.<name>] megatron_args`` of profiles/targets/megatron.toml:
    ``--bf16``, ``--fp8-format hybrid --fp8-recipe delayed --fp8-param-gather``, ...)."""
    args = dict(load_target("megatron").precision_args)
    if plan.precision not in args:
        raise ConfigError(f"precision {plan.precision!r} has no Megatron-LM flags in profiles/targets/megatron.toml; "
                          f"precisions: {', '.join(args)}")
    return args[plan.precision].split()


def _megatron_option_args(plan: Plan, notes: list[str]) -> list[str]:
    """The flags of the target options the plan was priced with (``--target megatron:cuda-graphs:...``:
    ``[options.<name>] megatron_args``); a note for an applied option that has none."""
    target = load_target(plan.target)
    if target.name != "megatron":
        return []
    by_name = {o.name: o for o in target.options}
    args: list[str] = []
    for name in target.applied:
        if by_name[name].megatron_args:
            args += by_name[name].megatron_args.split()
        else:
            notes.append(f"the plan was priced with option {name} ({by_name[name].description.split(':')[0]}), "
                         f"which pretrain_gpt.py has no flag for")
    return args


def _priced_tp_overlap(plan: Plan) -> bool:
    """Whether the plan was priced with tp communication overlap (its target hides sequence-parallel
    collectives behind GEMMs and the plan runs sequence parallel over tp > 1)."""
    if plan.degrees.tp == 1 or not plan.sequence_parallel:
        return False
    return load_target(plan.target).constants.tp_comm_exposed < 1.0


def _megatron_model(dims: ModelDims) -> list[str]:
    args = ["--num-layers", str(dims.layers), "--hidden-size", str(dims.hidden), "--num-attention-heads",
            str(dims.heads), "--ffn-hidden-size", str(dims.ffn_hidden), "--seq-length", str(dims.seq),
            "--max-position-embeddings", str(dims.seq)]
    if dims.kv_heads != dims.heads:
        args += ["--group-query-attention", "--num-query-groups", str(dims.kv_heads)]
    if dims.glu:  # Llama family: SwiGLU, RMSNorm, RoPE, no biases
        args += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear"]
    if not dims.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if dims.experts:
        args += ["--num-experts", str(dims.experts), "--moe-router-topk", str(dims.topk), "--moe-grouped-gemm"]
    return args


def _megatron_layout(plan: Plan, notes: list[str]) -> list[str]:
    d, s = plan.degrees, plan.schedule
    args = ["--tensor-model-parallel-size", str(d.tp), "--pipeline-model-parallel-size", str(d.pp)]
    if d.cp > 1:
        args += ["--context-parallel-size", str(d.cp)]
    if d.ep > 1:
        args += ["--expert-model-parallel-size", str(d.ep), "--moe-token-dispatcher-type", "alltoall"]
    if d.ep > 1 and d.tp > 1:  # whole experts on each tp rank, as autopar's runtime and cost model hold them
        args += ["--expert-tensor-parallel-size", "1"]
    if plan.sequence_parallel and d.tp > 1:
        args.append("--sequence-parallel")
    layers = layers_per_stage(plan)
    if d.pp > 1 and len(set(layers)) > 1:  # uneven cuts: one entry per chunk, chunk c on pipeline rank c % pp
        parts = [f"t*{n}" for n in layers]
        parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
        args += ["--pipeline-model-parallel-layout", "|".join(parts)]
    elif s.virtual_stages > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(s.virtual_stages)]
    return args


def _megatron_recompute(plan: Plan, notes: list[str]) -> list[str]:
    per_chunk = recompute_per_chunk(plan)
    layers = layers_per_stage(plan)
    mode = heaviest_recompute(plan)
    if mode == "none":
        return []
    if len({m for m, _ in per_chunk}) > 1:
        notes.append(f"recomputation differs between chunks ({', '.join(m for m, _ in per_chunk)}); Megatron sets "
                     f"one granularity for all: {mode}")
    if mode == "selective":  # Megatron's selective recomputes the core attention of every layer
        return ["--recompute-granularity", "selective"]
    counts = [k if m == "full" else 0 for m, k in per_chunk]
    if counts == layers:
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if len(set(counts)) > 1:
        notes.append(f"recomputed layers per chunk {counts}: Megatron's --recompute-num-layers is one count for every "
                     f"chunk; exported {max(counts)} (chunks with fewer recompute more than planned)")
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
            str(max(counts))]


def _megatron(plan: Plan, dims: ModelDims, memory: MemoryCheck) -> tuple[str, str, list[str]]:
    args, notes = megatron_args(plan, dims)
    lines, i = [], 0
    while i < len(args):  # one flag (and its value) per line
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        lines.append(" ".join(args[i:j]))
        i = j
    head = ["#!/bin/bash", f"# autopar export for Megatron-LM (pretrain_gpt.py): {_summary(plan)}",
            "# Megatron derives dp = world size / (tp x cp x pp). --mock-data, NullTokenizer, --train-iters and --lr",
            "# make it start on its own: put your data, tokenizer and schedule in their place.",
            *(f"# {line}" for line in memory.lines()), *(f"# differs: {n}" for n in notes)]
    d = plan.degrees
    env = ""
    if (d.tp > 1 or d.cp > 1) and plan.zero_stage < 3:
        # arguments.py validate_args asserts it for tp or cp > 1 before Blackwell (torch FSDP2 wants it unset)
        env = "export CUDA_DEVICE_MAX_CONNECTIONS=1\n"
    body = env + _launch(plan, "pretrain_gpt.py") + " \\\n    " + " \\\n    ".join(lines)
    return "\n".join(head) + "\n" + body + "\n", "pretrain_gpt_autopar.sh", notes


# --- torchtitan 0.3.0 -------------------------------------------------------------------------------------

_TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                    "zero-bubble": "InterleavedZeroBubble"}
# torchtitan 0.3.0 torchtitan/models/llama3/__init__.py llama3_configs and config_registry.py:
# registry job -> (flavor, layers, hidden, heads, kv_heads, ffn, vocab)
_TITAN_LLAMA3 = {
    "llama3_8b": ("8B", 32, 4096, 32, 8, 14336, 128256),
    "llama3_70b": ("70B", 80, 8192, 64, 8, 28672, 128256),
    "llama3_405b": ("405B", 126, 16384, 128, 8, 53248, 128256),
}
_TITAN_MODEL = '''    # the plan's model shape, built as torchtitan's llama3 flavors are (torchtitan/models/llama3/__init__.py)
    dim, n_heads = {hidden}, {heads}
    model = Llama3Model.Config(
        dim=dim, vocab_size={vocab},
        tok_embeddings=Embedding.Config(num_embeddings={vocab}, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features={vocab}, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers={layers}, dim=dim, n_heads=n_heads, n_kv_heads={kv_heads}, hidden_dim={ffn},
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=max(131072, {seq}), theta=500000,
                                    scaling="llama"),
            attn_backend="flex",
        ),
    )
    config.model_spec = dataclasses.replace(config.model_spec, flavor="autopar", model=model)
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size={vocab}))
'''
_TITAN_MODEL_IMPORTS = '''import dataclasses

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_llama3_layers,
    _output_linear_init,
    Llama3Model,
)
'''


def _titan_job(dims: ModelDims) -> tuple[str, bool]:
    """(registry job to start from, whether its model already has the plan's shape)."""
    shape = (dims.layers, dims.hidden, dims.heads, dims.kv_heads, dims.ffn_hidden, dims.vocab)
    for job, (_, *flavor) in _TITAN_LLAMA3.items():
        if tuple(flavor) == shape:
            return job, True
    return "llama3_8b", False


def torchtitan_settings(plan: Plan) -> tuple[dict[str, dict[str, object]], str, list[str]]:
    """{section: {field: value}} the job sets, the activation-checkpoint config ('none' | 'selective' | 'full')
    and the notes."""
    d, s = plan.degrees, plan.schedule
    notes: list[str] = []
    par: dict[str, object] = {"tensor_parallel_degree": d.tp, "enable_sequence_parallel": plan.sequence_parallel,
                              "context_parallel_degree": d.cp, "pipeline_parallel_degree": d.pp,
                              "expert_parallel_degree": d.ep}
    if plan.zero_stage == 0:
        par.update(data_parallel_replicate_degree=d.dp, data_parallel_shard_degree=1)
    else:
        par.update(data_parallel_replicate_degree=1, data_parallel_shard_degree=d.dp,
                   fsdp_reshard_after_forward="always" if plan.zero_stage == 3 else "never")
    if plan.zero_stage == 1:
        notes.append("ZeRO-1 runs as FSDP2 without resharding after forward (torchtitan reduce-scatters gradients: "
                     "ZeRO-2)")
    training: dict[str, object] = {"global_batch_size": plan.global_batch, "seq_len": plan.model.seq_len,
                                   "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"}
    if d.pp > 1:  # the pipeline splits the local batch into micro-batches; no accumulation on top
        training.update(local_batch_size=s.microbatch_size * s.num_microbatches, disable_cuda_graphs=True)
        par.update(pipeline_parallel_schedule=_TITAN_SCHEDULES[s.name],
                   pipeline_parallel_microbatch_size=s.microbatch_size,
                   module_fqns_per_model_part=_titan_parts(plan))
    else:  # the micro-batch is the local batch; gradient accumulation over the plan's micro-batches
        training["local_batch_size"] = s.microbatch_size
    if plan.precision != "bf16":
        notes.append(f"precision {plan.precision}: add torchtitan's float8 converter (torchao tensorwise scaling, FSDP "
                     "float8 all-gather) or mx converter (MXFP8) to the job; this export sets bf16 only")
    ac = heaviest_recompute(plan)
    per_chunk = recompute_per_chunk(plan)
    if ac != "none" and any((m, k) != (ac, n) for (m, k), n in zip(per_chunk, layers_per_stage(plan))):
        notes.append(f"recomputation per chunk {[f'{m}:{k}' for m, k in per_chunk]}: torchtitan applies one policy "
                     f"to every layer; exported {ac} everywhere")
    return {"training": training, "parallelism": par}, ac, notes


def _titan_parts(plan: Plan) -> list[list[str]]:
    """torchtitan module FQNs per chunk (chunk c on pipeline rank c % pp, its 'loop' stage order)."""
    parts, start, layers = [], 0, layers_per_stage(plan)
    for c, n in enumerate(layers):
        mods = [f"layers.{i}" for i in range(start, start + n)]
        parts.append((["tok_embeddings"] if c == 0 else []) + mods + (["norm", "lm_head"] if c == len(layers) - 1
                                                                       else []))
        start += n
    return parts


def _torchtitan(plan: Plan, dims: ModelDims, memory: MemoryCheck) -> tuple[str, str, list[str]]:
    job, same_shape = _titan_job(dims)
    sections, ac, notes = torchtitan_settings(plan)
    module = "autopar_torchtitan_job"
    doc = [f"autopar export for torchtitan 0.3.0: {_summary(plan)}.", "",
           f"Starts from torchtitan's {job} registry job (optimizer, data, checkpointing) and sets the plan's "
           "model shape, parallelism, batch and activation checkpointing. Launch from this file's directory:", "",
           f"    PYTHONPATH=. {_launch(plan, '-m torchtitan.train')} --module {module} --config autopar_job", "",
           *memory.lines(), *(f"differs: {n}" for n in notes)]
    ac_expr = {"none": "None", "selective": "SelectiveAC.Config()", "full": "FullAC.Config()"}[ac]
    imports = [*([_TITAN_MODEL_IMPORTS] if not same_shape else []),
               "from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC",
               f"from torchtitan.models.llama3.config_registry import {job}"]
    body = [f"    config = {job}()"]
    if not same_shape:
        body.append(_TITAN_MODEL.format(hidden=dims.hidden, heads=dims.heads, vocab=dims.vocab, layers=dims.layers,
                                        kv_heads=dims.kv_heads, ffn=dims.ffn_hidden, seq=dims.seq).rstrip("\n"))
    for section, fields in sections.items():
        body += [f"    config.{section}.{k} = {v!r}" for k, v in fields.items()]
    body += [f"    config.activation_checkpoint = {ac_expr}", "    return config"]
    docstring = '"""' + "\n".join(doc).replace("\\", "\\\\") + '\n"""'
    text = "\n".join([docstring, "", *imports, "", "", "def autopar_job():", *body]) + "\n"
    return text, f"{module}.py", notes


# --- DeepSpeed ----------------------------------------------------------------------------------------------


def deepspeed_config(plan: Plan) -> tuple[dict[str, object], list[str]]:
    """The ``deepspeed.initialize(config=...)`` dictionary and the notes on what is set in code or differs."""
    d, s = plan.degrees, plan.schedule
    notes: list[str] = []
    cfg: dict[str, object] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": s.microbatch_size,
        "gradient_accumulation_steps": s.num_microbatches,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": plan.zero_stage, "overlap_comm": d.pp == 1, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1.0e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
    }
    if d.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": d.tp}
        if plan.sequence_parallel:
            notes.append("sequence_parallel: DeepSpeed AutoTP has no Megatron-style sequence parallelism (norm and "
                         "dropout activations stay replicated over tp: more activation memory than planned)")
    if d.pp > 1:
        layers = layers_per_stage(plan)
        cut = "partition_method='uniform'" if len(set(layers)) == 1 else (
            f"the plan's uneven cuts {layers} (partition_method takes 'uniform', 'parameters' or 'type:<regex>', "
            "not cut points: nearest is 'parameters')")
        notes.append(f"pp={d.pp}: build the model as deepspeed.pipe.PipelineModule(layers=..., num_stages={d.pp}) "
                     f"with {cut}")
    if d.ep > 1:
        notes.append(f"ep={d.ep}: build the experts as deepspeed.moe.layer.MoE(..., ep_size={d.ep})")
    mode = heaviest_recompute(plan)
    if mode != "none":
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
        notes.append(f"recompute={mode}: wrap each transformer layer in deepspeed.checkpointing.checkpoint (or "
                     "PipelineModule(activation_checkpoint_interval=1)); DeepSpeed recomputes whole layers"
                     + ("; selective recomputation has no DeepSpeed setting" if mode == "selective" else ""))
    return cfg, notes


def _deepspeed(plan: Plan, dims: ModelDims, memory: MemoryCheck) -> tuple[str, str, list[str]]:
    cfg, notes = deepspeed_config(plan)
    return json.dumps(cfg, indent=2) + "\n", "ds_config_autopar.json", notes


WRITERS: dict[str, Writer] = {"megatron": _megatron, "torchtitan": _torchtitan, "deepspeed": _deepspeed}
