"""The runtime's own cost: the same plans applied through ``runtime.auto_wrap`` and through a hand-written script in
torchtitan's style, step times side by side in the same processes.

    python -m benchmarks.runtime_overhead [--steps 15] [--layers 4] [--hidden 256] [--seq 64]

Plans (gloo ranks on this CPU): tp2 (2 ranks), dp2 ZeRO-3 (2), pp2 1F1B with 2 micro-batches (2), tp2 x dp2
ZeRO-3 (4). The model is a small Llama from a transformers ``LlamaConfig`` (random init, the same weights in both
variants). The hand-written side calls torch directly: ``parallelize_module`` with Megatron styles (vocabulary-
parallel embedding, loss-parallel head), ``fully_shard`` per layer and on the root, ``PipelineStage`` +
``Schedule1F1B`` over a hand-cut model; both run the same AdamW. Each measured step starts after a barrier and
counts the slowest rank (forward, backward, optimizer step, zero_grad); the two variants alternate step by step
(A B B A ...) so both see the same load, and the ratio is median(auto_wrap) / median(hand-written). Goal: <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PLANS = (
    # (label, world size, manual_plan keywords)
    ("tp2", 2, dict(tp=2)),
    ("dp2 ZeRO-3", 2, dict(dp=2, zero_stage=3)),
    ("pp2 1F1B", 2, dict(pp=2, num_microbatches=2, schedule="1f1b")),
    ("tp2 x dp2 ZeRO-3", 4, dict(tp=2, dp=2, zero_stage=3)),
)


def llama(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --- the hand-written side (torchtitan's parallelize_llama / pipeline_llama shape) ---------------------------


def _tp(model: nn.Module, tp_mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # loss parallel
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
        })


def _fsdp(model: nn.Module, dp_mesh: Any, layers: list[nn.Module]) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=True)


class _Stage(nn.Module):
    """One pipeline stage of the Llama: embedding (first), a run of layers, norm and head (last)."""

    def __init__(self, model: nn.Module, lo: int, hi: int) -> None:
        super().__init__()
        n = len(model.model.layers)
        self.embed = model.model.embed_tokens if lo == 0 else None
        self.layers = nn.ModuleList(model.model.layers[lo:hi])
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm if hi == n else None
        self.head = model.lm_head if hi == n else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x  # (B, T, H)
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.rotary(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope)  # causal SDPA
        return self.head(self.norm(h)) if self.head is not None else h


class Hand:
    """The hand-written parallel model: ``step(ids, targets)`` runs one training step's forward and backward."""

    def __init__(self, model: nn.Module, kw: dict, world: int, rows: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.n_mb, self.loss_parallel, self.schedule = kw.get("num_microbatches", 1), False, None
        tp, dp, pp = kw.get("tp", 1), kw.get("dp", 1), kw.get("pp", 1)
        rank = dist.get_rank()
        self.rows = slice((rank // tp) * rows // dp, (rank // tp + 1) * rows // dp) if pp == 1 else slice(None)
        if pp > 1:
            self._pipeline(model, world)
            self.params = list(self.stage_module.parameters())
            return
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        if tp > 1:
            _tp(model, mesh["tp"])
            self.loss_parallel = True
        if dp > 1:
            _fsdp(model, mesh["dp"], list(model.model.layers))
        self.model, self.params = model, list(model.parameters())

    def _pipeline(self, model: nn.Module, world: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        rank, half = dist.get_rank(), len(model.model.layers) // 2
        self.stage_module = _Stage(model, 0, half) if rank == 0 else _Stage(model, half, len(model.model.layers))
        stage = PipelineStage(self.stage_module, stage_index=rank, num_stages=world, device=torch.device("cpu"))
        n_mb = self.n_mb
        self.schedule = Schedule1F1B(stage, n_microbatches=n_mb, loss_fn=lambda out, t: loss_fn(out, t) / n_mb,
                                     scale_grads=False)
        self.first, self.last = rank == 0, rank == world - 1

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        if self.schedule is not None:
            if self.first:
                self.schedule.step(ids)
            else:
                self.schedule.step(target=targets, losses=[])
            return
        ids, targets = ids[self.rows], targets[self.rows]
        logits = self.model(ids).logits
        if self.loss_parallel:
            with loss_parallel():
                loss_fn(logits, targets).backward()
        else:
            loss_fn(logits, targets).backward()


# --- one rank --------------------------------------------------------------------------------------------


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _plan_rank(rank: int, world: int, args: argparse.Namespace, label: str, kw: dict) -> dict:
    from runtime import auto_wrap
    from runtime.manual_plan import manual_plan

    rows = 4
    mb = rows // kw.get("dp", 1) // kw.get("num_microbatches", 1)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (rows, args.seq + 1), generator=gen)
    ids, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    ours = llama(args)
    plan = manual_plan(ours, seq_len=args.seq, microbatch_size=mb, **kw)
    pm = auto_wrap(ours, ids, loss_fn=loss_fn, plan=plan)
    hand = Hand(llama(args), kw, world, rows)
    opts = {"auto_wrap": torch.optim.AdamW(pm.parameters(), lr=1e-4),
            "hand-written": torch.optim.AdamW(hand.params, lr=1e-4)}
    runs: dict[str, Callable[[], None]] = {"auto_wrap": lambda: pm.step(ids, targets),
                                           "hand-written": lambda: hand.step(ids, targets)}

    def one(name: str) -> float:
        def body() -> None:
            runs[name]()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
        return _timed(body)

    for name in runs:  # warm-up (the pipeline's shape inference, FSDP's lazy init, allocator)
        one(name)
        one(name)
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for i in range(args.steps):
        for name in order if i % 2 == 0 else order[::-1]:  # A B B A A B ...
            times[name].append(one(name))
    return {"label": label, "times": times}


def _world_rank(rank: int, world: int, args: argparse.Namespace, plans: list) -> list[dict]:
    out = []
    for label, _, kw in plans:
        out.append(_plan_rank(rank, world, args, label, kw))
        dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    from runtime.measure.spawn import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=15, help="measured steps per variant and plan (default 15)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results = []
    for world in sorted({w for _, w, _ in PLANS}):
        plans = [p for p in PLANS if p[1] == world]
        results += run_ranks(_world_rank, world_size=world, args=(args, plans), backend="gloo", threads=1,
                             timeout_s=1800, what=f"runtime overhead on {world} ranks")[0]
    load_after = os.getloadavg()
    print(f"Llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}, global batch 4; "
          f"{args.steps} steps per variant, interleaved; median step of the slowest rank")
    print(f"{'plan':<18} {'auto_wrap ms':>13} {'hand ms':>9} {'ratio':>7}   (min: auto_wrap / hand ms)")
    for res in results:
        a, h = (statistics.median(res["times"][k]) for k in ("auto_wrap", "hand-written"))
        amin, hmin = (min(res["times"][k]) for k in ("auto_wrap", "hand-written"))
        print(f"{res['label']:<18} {1e3 * a:>13.1f} {1e3 * h:>9.1f} {a / h:>7.3f}   ({1e3 * amin:.1f} / {1e3 * hmin:.1f})")
    print(f"load average (1/5/15 min) before {'/'.join(f'{x:.1f}' for x in load_before)}, after "
          f"{'/'.join(f'{x:.1f}' for x in load_after)} on {os.cpu_count()} cores; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
