"""How ``benchmarks/fidelity.py`` prices each development-set case: target, model, cluster and configuration.

``dev_run(case)`` turns a ``benchmarks.devset.DevCase`` into a ``DevRun``: the execution target, the model spec
(a preset where its dimensions equal the case's config JSON, the inline ``gpt:`` spec for a GPT-2-layout config,
else ``benchmarks/data/models/<model>.json``), the node type and shape of the cluster, the ``ParallelConfig`` and
the assumptions the published row leaves open (one rule for every case, listed in ``ASSUMPTIONS``), or ``skip``:
why the case cannot be priced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from benchmarks.devset import DevCase, load_devset, load_recipes
from costmodel.step_config import ParallelConfig

TARGET_OF_SOURCE = {"megatron_bridge_performance": "megatron", "nemo_performance": "megatron",
                    "torchtitan_llama3_8b_h200": "torchtitan"}
NODE_OF_SYSTEM = {"dgx-h100": "dgx-h100", "dgx-b200": "dgx-b200", "dgx-b300": "dgx-b300",
                  "gb200-nvl72": "gb200-nvl72", "gb300-nvl72": "gb300-nvl72", "h200-8gpu-cx7": "h200-8gpu-cx7"}
NVL_DOMAIN = 64
"""GPUs of one NVLink domain of an NVL72 job of 64 or more GPUs (16 of a rack's 18 compute trays)."""
PRESETS = ("llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b")
ASSUMPTIONS = (
    "target: megatron (Megatron-Core + Transformer Engine) for the Megatron-Bridge and NeMo rows, torchtitan for "
    "the torchtitan rows",
    "cluster: the row's system as a node type of profiles/nodes.toml; NVL72 jobs run in NVLink domains of "
    f"min(GPUs, {NVL_DOMAIN}) GPUs (whole 4-GPU trays, a power of two per rack), one NIC per GPU between them",
    "dp = GPUs / (tp pp cp); virtual stages VP (none: 1); interleaved 1F1B when VP > 1, else 1F1B",
    "FSDP > 0: ZeRO-3 (Megatron-FSDP, parameters, gradients and optimizer states sharded); otherwise the "
    "distributed optimizer (ZeRO-1, Megatron-Bridge's recipes); torchtitan: FSDP2 over all GPUs (ZeRO-3)",
    "sequence parallelism whenever tp > 1 (Megatron-Bridge's recipes); fused (flash) attention; gradient "
    "reduction overlapped",
    "GPT-OSS: its attention with per-head sinks traced as one exact sdpa call per layer (planner.sink_attention; "
    "sliding-window layers as blocks of the window against 2 windows of keys), its values zero-padded to q / k's "
    "head dim + 1 so it is one fused kernel",
    "DeepSeek-V3: its multi-head latent attention (q / k head dim 192, v 128) traced as one fused sdpa call with v "
    "zero-padded to 192 (planner.mla_attention: what transformers' flash path did), FLOPs of the unpadded v",
    "precision: BF16 -> bf16, FP8-CS -> fp8-cs, MXFP8 -> mxfp8, NVFP4 -> nvfp4; an unnamed FP8 recipe -> fp8-cs on "
    "Megatron-Bridge (its earlier releases name the same rows FP8-CS) and delayed-scaling fp8 on NeMo 24.07 "
    "(Transformer Engine's default then); 25.09 gives no precision: its plain figures are priced fp8-cs, its "
    "parenthesized block-scaled figures mxfp8 (Blackwell) or fp8-cs (Hopper 128x128 blocks)",
    "Megatron-Bridge recipe settings (benchmarks/data/megatron_bridge_recipes.json, the recipe of the row at its "
    "release's tag, where its GPUs, parallel sizes and batches are the row's) as options of the megatron target: "
    "full-iteration CUDA graphs -> cuda-graphs, moe_a2a_overlap -> moe-a2a-overlap, cutedsl_fused_grouped_mlp "
    "-> fused-grouped-mlp, fp8_dot_product_attention (fp8 precisions) -> fp8-attention",
    "recomputation: none unless the row names it (torchtitan: selective); the step time is priced whether or "
    "not the plan fits (Megatron-Bridge's FSDP rows offload activations to the CPU, which is not modelled)",
    "measured figure: tokens per second per GPU as printed (a row printing only TFLOP/s: converted with the "
    "FLOPs per token of the same model and sequence length in the set)",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DevRun:
    case: DevCase
    target: str
    spec: str
    node: str
    nodes: int
    gpus_per_node: int
    config: ParallelConfig | None
    measured_tokens_per_gpu: float | None
    assumption: str
    skip: str | None = None
    options: tuple[str, ...] = ()
    """Options of ``target`` the row's recipe ran (``recipe_options``)."""

    @property
    def target_spec(self) -> str:
        """``costmodel.targets.load_target``'s spec: the target with its options."""
        return ":".join((self.target, *self.options))


def stage_layers_of(config: ParallelConfig, entries: int, layers: int) -> tuple[int, ...] | None:
    """Explicit cuts when pp x VP exceeds the transformer layers: the embedding and the loss each count as one
    layer of the split (Megatron-Core account_for_embedding_in_pipeline_split / ..._loss_...), every chunk the
    same number of entries; None: the step model's even split."""
    chunks = config.pp * config.virtual_stages
    if chunks <= layers or entries % chunks:
        return None
    return (entries // chunks,) * chunks


def precision_of(c: DevCase) -> str:
    """The ``PRECISIONS`` name of the case's recipe (see ``ASSUMPTIONS``)."""
    if c.precision is None:  # 25.09: no precision column
        if c.variant == "parenthesized":
            return "fp8-cs" if c.system == "dgx-h100" else "mxfp8"
        return "fp8-cs"
    if c.precision == "fp8":
        recipe = c.precision_recipe or ("fp8-cs" if c.source == "megatron_bridge_performance" else "fp8")
        return {"current-scaling": "fp8-cs", "mxfp8": "mxfp8"}.get(recipe, recipe)
    return c.precision


def model_spec(c: DevCase) -> str:
    """A preset whose dimensions equal the config JSON's; else, for a GPT-2-layout config (Megatron-Core's GPT:
    learned positions, LayerNorm, GeLU, biases, tied embeddings), the inline ``gpt:`` spec of its dimensions;
    else the config JSON's path.

    The GPT rows are built as the ``gpt3-175b`` preset is (``transformers.OPTForCausalLM``, every projection an
    ``nn.Linear``), not as ``GPT2LMHeadModel``: Megatron shards its projections column- / row-wise, while
    GPT-2's ``Conv1D`` has no tensor-parallel strategy in autopar's space, so a GPT2 build is priced replicated
    over tp (NeMo's GPT3-20B at tp=2 was priced at 0.55x its published throughput)."""
    from planner.models import model_dims

    path = str(c.model_config)
    mine = model_dims(path, seq=c.seq_len)
    key = lambda d: (d.layers, d.hidden, d.heads, d.kv_heads, d.ffn_hidden, d.vocab, d.experts)  # noqa: E731
    for name in PRESETS:
        if key(model_dims(name, seq=c.seq_len)) == key(mine):
            return name
    if json.loads(c.model_config.read_text()).get("model_type") == "gpt2":
        return (f"gpt:layers={mine.layers},hidden={mine.hidden},heads={mine.heads},vocab={mine.vocab},"
                f"seq={mine.seq},ffn={mine.ffn_hidden}")
    return path


def _cluster_shape(c: DevCase) -> tuple[int, int]:
    """(nodes, GPUs per node) of the case's job."""
    if "nvl72" in c.system:
        per = min(c.num_gpus, NVL_DOMAIN)
        return c.num_gpus // per, per
    return c.num_gpus // 8, 8


def _skip_reason(c: DevCase, dp: int) -> str | None:
    if not c.model_config.is_file():
        return f"no model config: benchmarks/data/models/{c.model}.json does not exist (no published config)"
    if c.num_gpus % (c.tp * c.pp * c.cp):
        return f"tp*pp*cp={c.tp * c.pp * c.cp} does not divide the {c.num_gpus} GPUs"
    ep = c.ep or 1
    if dp % ep:
        return (f"ep={ep} does not divide dp={dp}: Megatron-Core folds the expert-parallel group over tp x cp x dp "
                "ranks (MoE parallel folding, expert tensor parallel 1, the MoE block sequence-parallel over tp); "
                "autopar's ParallelConfig places ep inside dp and its block strategies have no sequence-parallel "
                "MoE block, so the tokens and experts per GPU of this layout cannot be described")
    if "nvl72" in c.system and c.num_gpus > NVL_DOMAIN and c.num_gpus % NVL_DOMAIN:
        return f"{c.num_gpus} GPUs do not fill NVLink domains of {NVL_DOMAIN}"
    return None


def measured_tokens(c: DevCase, cases: list[DevCase]) -> float | None:
    if c.tokens_per_s_per_gpu is not None:
        return float(c.tokens_per_s_per_gpu)
    if c.model_tflops_per_gpu is None:
        return None
    twins = [o for o in cases if o.model == c.model and o.seq_len == c.seq_len and o.tokens_per_s_per_gpu
             and o.model_tflops_per_gpu]
    if not twins:
        return None
    flops_per_token = twins[0].model_tflops_per_gpu * 1e12 / twins[0].tokens_per_s_per_gpu
    return c.model_tflops_per_gpu * 1e12 / flops_per_token


def recipe_options(recipe: dict | None, precision: str) -> tuple[str, ...]:
    """The megatron target's options that a Megatron-Bridge recipe's settings turn on (see ``ASSUMPTIONS``)."""
    if not recipe:
        return ()
    scope = recipe.get("cuda_graph_scope")
    full_graph = recipe.get("cuda_graph_impl") == "full_iteration" or (
        recipe.get("cuda_graph_impl") == "local" and isinstance(scope, list) and "full_iteration" in scope)
    on = {"cuda-graphs": full_graph,
          "moe-a2a-overlap": recipe.get("moe_a2a_overlap") is True,
          "fused-grouped-mlp": recipe.get("cutedsl_fused_grouped_mlp") is True,
          "fp8-attention": recipe.get("fp8_dot_product_attention") is True and precision != "bf16"}
    return tuple(name for name, yes in on.items() if yes)


def dev_run(c: DevCase, cases: list[DevCase], recipes: dict[str, dict] | None = None) -> DevRun:
    """How ``c`` is priced (see the module docstring and ``ASSUMPTIONS``)."""
    target = TARGET_OF_SOURCE[c.source]
    dp = c.data_parallel
    nodes, per = _cluster_shape(c)
    skip = _skip_reason(c, dp)
    precision = precision_of(c)
    recompute = "selective" if (c.recompute or "").startswith("selective") else "full" if c.recompute == "full" \
        else "none"
    v = c.vp or 1
    zero = 3 if (c.fsdp or 0) > 0 else 1
    recipe = (recipes or {}).get(c.id)
    matched = recipe is not None and recipe.get("matched") is True  # else what ran is not the recipe at the tag
    options = recipe_options(recipe, precision) if target == "megatron" and matched else ()
    why = (f"{precision}, ZeRO-{zero}{' sp' if c.tp > 1 else ''}, recompute {recompute}, "
           f"{nodes} x {per} GPUs" + (f", recipe: {' '.join(options)}" if options else ""))
    base = dict(case=c, target=target, node=NODE_OF_SYSTEM[c.system], nodes=nodes, gpus_per_node=per,
                measured_tokens_per_gpu=measured_tokens(c, cases), assumption=why, options=options)
    if skip is not None:
        return DevRun(spec="", config=None, skip=skip, **base)
    config = ParallelConfig(
        tp=c.tp, pp=c.pp, cp=c.cp, dp=dp, ep=c.ep or 1, microbatch=c.micro_batch, global_batch=c.global_batch,
        schedule="interleaved-1f1b" if c.pp > 1 and v > 1 else "1f1b", virtual_stages=v if c.pp > 1 else 1,
        recompute=recompute, sequence_parallel=c.tp > 1, zero_stage=zero, flash_attention=True,
        overlap_grad_reduce=True, precision=precision,
    )
    return DevRun(spec=model_spec(c), config=config, **base)



def _row(run: DevRun, est, workload_name: str) -> dict:
    c = run.case
    pred = c.global_batch * c.seq_len / est.step_time_s / c.num_gpus
    meas = run.measured_tokens_per_gpu
    row = {
        "case": c.id, "source": c.source, "release": c.release, "target": run.target, "system": c.system,
        "model": c.model, "gpus": c.num_gpus, "precision": run.config.precision, "metric": "tokens/s/GPU",
        "predicted": pred, "measured": meas, "error": None if meas is None else pred / meas - 1.0,
        "step_time_s": est.step_time_s, "memory_gb": est.memory_gb_per_device, "fits": est.fits,
        "bottleneck": est.bottleneck, "workload": workload_name, "assumption": run.assumption,
        "config": run.config.summary(), "options": list(run.options),
    }
    if c.memory_gib is not None:  # published memory (GiB): the prediction in GiB against it
        mem_gib = est.memory_gb_per_device * 1e9 / 2**30
        row.update(memory_measured_gib=c.memory_gib, memory_predicted_gib=mem_gib,
                   memory_error=mem_gib / c.memory_gib - 1.0)
    return row


def _skipped(run: DevRun, reason: str) -> dict:
    c = run.case
    return {"case": c.id, "source": c.source, "release": c.release, "target": run.target, "system": c.system,
            "model": c.model, "gpus": c.num_gpus, "skip": reason}


def _estimate(run: DevRun, workload, cluster, target) -> tuple[object, DevRun]:
    """The step estimate of ``run`` (its explicit cuts where pp x VP exceeds the layers); a block with no
    executable sequence-parallel sharding (MoE routers and experts in autopar's strategy space) is priced without
    sequence parallelism, and the run says so."""
    from costmodel.errors import ConfigError
    from costmodel.step import estimate_step

    cuts = stage_layers_of(run.config, len(workload.layers), workload.num_layers)
    if cuts is not None:
        run = replace(run, assumption=run.assumption + ", embedding and loss count as pipeline layers")
    try:
        return estimate_step(workload, run.config, cluster, stage_layers=cuts, target=target), run
    except ConfigError as e:
        if "no sequence-parallel sharding" not in str(e):
            raise
    run = replace(run, config=replace(run.config, sequence_parallel=False),
                  assumption=run.assumption + ", no sequence parallelism (no executable sequence-parallel sharding "
                  "of the MoE block)")
    return estimate_step(workload, run.config, cluster, stage_layers=cuts, target=target), run


def price_devset(cases: list[DevCase] | None = None) -> list[dict]:
    """Price every case (see ``dev_run``): one row per case, in the set's order, a ``skip`` reason where it
    cannot be priced. Each distinct (model, sequence) is traced once, each target and cluster loaded once."""
    from costmodel.errors import AutoparError
    from costmodel.profiles import make_cluster
    from costmodel.targets import load_target
    from planner.workload import workload_from_model

    cases = load_devset() if cases is None else cases
    recipes = load_recipes()
    runs = [dev_run(c, cases, recipes) for c in cases]
    workloads: dict[tuple[str, int], object] = {}
    rows: dict[int, dict] = {}
    for i in sorted(range(len(runs)), key=lambda i: (runs[i].spec, runs[i].case.seq_len)):
        run = runs[i]
        if run.skip is not None:
            rows[i] = _skipped(run, run.skip)
            continue
        key = (run.spec, run.case.seq_len)
        if key not in workloads:
            try:
                workloads[key] = workload_from_model(run.spec, seq=run.case.seq_len)[0]
            except AutoparError as e:
                why = str(e).replace(run.spec, run.spec.split("/")[-1])
                workloads[key] = f"cannot trace {run.spec.split('/')[-1]}: {type(e).__name__}: {why[:200]}"
        w = workloads[key]
        if isinstance(w, str):
            rows[i] = _skipped(run, w)
            continue
        cluster = make_cluster(run.node, run.nodes, gpus_per_node=run.gpus_per_node)
        try:
            est, run = _estimate(run, w, cluster, load_target(run.target_spec))
        except AutoparError as e:
            rows[i] = _skipped(run, f"{type(e).__name__}: {str(e)[:240]}")
            continue
        rows[i] = _row(run, est, run.spec.split("/")[-1])
    return [rows[i] for i in range(len(runs))]
