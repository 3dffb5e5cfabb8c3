"""The Megatron-LM SC21 runs (Narayanan et al. 2021, Tables 1 and 2) as priced cases.

``run(workload=)`` prices every case of ``benchmarks/data/megatron_sc21.json`` on DGX A100 80 GB nodes for the
execution target that ran it (``megatron:sc21`` for the Table 1 and PTD-P rows, ``deepspeed`` for the ZeRO-3
rows) and compares SC21 Eq. 3's FLOPs over the predicted step time with the measured TFLOP/s per GPU. The case
assumptions are in ``benchmarks/fidelity.py``'s module docstring.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from costmodel.analytic import gpt_workload, sc21_model_flops
from costmodel.profiles import make_cluster
from costmodel.step import ParallelConfig, estimate_step
from costmodel.targets import load_target
from costmodel.workload import Workload

DATA = Path(__file__).resolve().parent / "data" / "megatron_sc21.json"
SEQ, VOCAB = 2048, 51200
TABLE2_MODELS = {"175b": dict(layers=96, hidden=12288, heads=96), "530b": dict(layers=105, hidden=20480, heads=128)}
TABLE2_VIRTUAL = {"175b": 2, "530b": 3}
PRESETS = {1.7: "megatron-1.7b", 3.6: "megatron-3.6b", 7.5: "megatron-7.5b", 18.4: "megatron-18b",
           39.1: "megatron-39b", 76.1: "megatron-76b", 145.6: "megatron-145b", 310.1: "megatron-310b",
           529.6: "megatron-530b", 1008.0: "megatron-1t", 175: "gpt3-175b", 530: "megatron-530b"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    id: str
    dims: dict
    params_b: float
    gpus: int
    config: ParallelConfig
    measured_tflops: float
    assumption: str


def _table1(row: dict) -> Case:
    m, p = row["model"], row["parallel"]
    cfg = ParallelConfig(
        tp=p["tp"], pp=p["pp"], dp=p["dp"], microbatch=p["microbatch"], global_batch=p["global_batch"],
        schedule=p["schedule"], virtual_stages=p["virtual_stages"], recompute=p["recompute"],
        zero_stage=p["zero"], flash_attention=False, overlap_grad_reduce=p["data_parallel_impl"] == "torch DDP",
    )
    dims = dict(layers=m["layers"], hidden=m["hidden"], heads=m["heads"])
    return Case(id=row["id"], dims=dims, params_b=m["params_b"], gpus=row["cluster"]["gpus"], config=cfg,
                measured_tflops=row["measured"]["tflops_per_gpu"], assumption="as listed")


def _table2(row: dict) -> Case:
    size = "175b" if "175b" in row["id"] else "530b"
    dims = TABLE2_MODELS[size]
    n, gb = row["gpus"], row["global_batch"]
    if "zero3" in row["id"]:
        mb = row.get("microbatch", gb // n)
        cfg = ParallelConfig(tp=1, pp=1, dp=n, microbatch=mb, global_batch=gb, schedule="1f1b", recompute="full",
                             zero_stage=3, flash_attention=False, overlap_grad_reduce=True)
        why = f"ZeRO-3 dp={n}, micro-batch {mb}" + ("" if "microbatch" in row else " (= global batch / GPUs)")
    else:
        pp = 12 if size == "175b" else 35
        v = TABLE2_VIRTUAL[size]
        cfg = ParallelConfig(tp=8, pp=pp, dp=n // (8 * pp), microbatch=row.get("microbatch", 1), global_batch=gb,
                             schedule="interleaved-1f1b", virtual_stages=v, recompute="full", zero_stage=0,
                             flash_attention=False, overlap_grad_reduce=False)
        why = f"interleaved v={v} (assumed), local DDP"
    return Case(id=row["id"], dims=dims, params_b=float(size[:-1]), gpus=n, config=cfg,
                measured_tflops=row["tflops_per_gpu"], assumption=why)


def load_cases(path: Path = DATA) -> list[Case]:
    data = json.loads(Path(path).read_text())
    return [_table1(r) for r in data["table1_weak_scaling"]] + [_table2(r) for r in data["table2_zero3_vs_ptdp"]]


def _workload(case: Case, kind: str, cache: dict) -> tuple[Workload, str]:
    key = (case.dims["layers"], case.dims["hidden"], case.dims["heads"])
    if key in cache:
        return cache[key]
    got = None
    if kind == "traced":
        try:
            from planner.workload import workload_from_model

            spec = PRESETS.get(case.params_b)
            if spec is not None:
                w, _ = workload_from_model(spec, seq=SEQ)
                if (w.num_layers, w.hidden, w.heads) == key:
                    got = (w, f"traced {spec}")
        except ImportError:  # the tracer is not installed: fall back to the analytic count
            got = None
    if got is None:
        got = (gpt_workload(**case.dims, vocab=VOCAB, seq=SEQ, name=case.id), "analytic")
    cache[key] = got
    return got


def target_of(case: Case) -> str:
    """The execution target that ran the case: DeepSpeed for the ZeRO-3 rows, Megatron-LM 2021 for the others."""
    return "deepspeed" if case.config.zero_stage == 3 else "megatron:sc21"


def run(*, workload: str = "analytic", path: Path = DATA) -> list[dict]:
    """Predict every case; one row per case with predicted / measured TFLOP/s and the relative error."""
    rows, cache = [], {}
    for case in load_cases(path):
        w, source = _workload(case, workload, cache)
        target = load_target(target_of(case))
        est = estimate_step(w, case.config, make_cluster("dgx-a100-80gb", case.gpus // 8), target=target)
        # the paper's FLOP count (Eq. 3) over the predicted step time: the same numerator as the measurement
        flops = sc21_model_flops(batch=case.config.global_batch, seq=SEQ, layers=case.dims["layers"],
                                 hidden=case.dims["hidden"], vocab=VOCAB, recompute=True)
        pred = flops / est.step_time_s / case.gpus / 1e12
        rows.append({
            "case": case.id, "source": "megatron_sc21", "target": target.spec, "system": "dgx-a100-80gb",
            "metric": "TFLOP/s/GPU", "predicted": pred, "measured": case.measured_tflops,
            "predicted_tflops": pred, "measured_tflops": case.measured_tflops,
            "error": pred / case.measured_tflops - 1.0, "step_time_s": est.step_time_s,
            "memory_gb": est.memory_gb_per_device, "fits": est.fits, "bottleneck": est.bottleneck,
            "workload": source, "assumption": case.assumption, "config": case.config.summary(),
        })
    return rows
