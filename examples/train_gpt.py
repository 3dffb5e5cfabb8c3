"""Train a small GPT (OPT architecture: separate q/k/v, gelu MLP, learned positions) with ``runtime.auto_wrap``.

    torchrun --nproc-per-node 4 examples/train_gpt.py                     # plan with the planner for 4 ranks
    torchrun --nproc-per-node 4 examples/train_gpt.py --plan plan.json    # a plan from `autopar plan`
    torchrun --nproc-per-node 4 examples/train_gpt.py --manual tp=2,dp=2,zero=3,sp=1

The same script runs every plan: the model is built on the meta device (auto_wrap materialises only each rank's
shards, seeded per parameter name), every rank draws the same global batch and ``pm.step`` takes its share.
The data is synthetic and learnable (each sequence counts up from a random start with a random stride, mod the
vocabulary), so the loss falls well below ln(vocab) within a few dozen steps.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from costmodel.errors import AutoparError  # noqa: E402
from runtime import auto_wrap, init_distributed  # noqa: E402
from runtime.manual_plan import manual_plan  # noqa: E402


def build_gpt(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, ffn_dim=4 * args.hidden,
        num_attention_heads=args.heads, max_position_embeddings=max(64, args.seq), word_embed_proj_dim=args.hidden,
        activation_function="gelu", dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=1,
    )
    with torch.device("meta"):
        return OPTForCausalLM(cfg)


def batch(step: int, *, rows: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (rows, 1), generator=gen)
    stride = torch.randint(1, 8, (rows, 1), generator=gen)
    ids = (start + stride * torch.arange(seq + 1)) % vocab  # (B, T+1)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parse_manual(text: str, model: torch.nn.Module, *, world: int, batch_rows: int, seq: int):
    kv = dict(item.split("=", 1) for item in text.split(",") if item)
    tp, pp = int(kv.get("tp", 1)), int(kv.get("pp", 1))
    dp = int(kv.get("dp", world // (tp * pp)))
    mb = int(kv.get("mb", 1))
    return manual_plan(
        model, tp=tp, dp=dp, pp=pp, zero_stage=int(kv.get("zero", 0)), sequence_parallel=kv.get("sp", "0") == "1",
        microbatch_size=batch_rows // (dp * mb), num_microbatches=mb, schedule=kv.get("schedule", "1f1b"),
        seq_len=seq, name="train_gpt",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default=None, help="plan JSON from `autopar plan` (default: plan here)")
    ap.add_argument("--manual", default=None, help="a plan given by hand: tp=2,dp=2,pp=1,zero=3,sp=1,mb=2")
    ap.add_argument("--cluster", default=None, help="cluster spec for planning (default: local, this world)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    info = init_distributed()
    model = build_gpt(args)
    example = batch(0, rows=args.batch, seq=args.seq, vocab=args.vocab, seed=args.seed)
    plan = args.plan
    if args.manual:
        plan = parse_manual(args.manual, model, world=info.world_size, batch_rows=args.batch, seq=args.seq)
    try:
        pm = auto_wrap(model, example, loss_fn=loss_fn, plan=plan, cluster=args.cluster, seed=args.seed)
    except (AutoparError, ImportError) as e:
        if plan is not None:
            raise
        fallback = f"tp={2 if info.world_size % 2 == 0 else 1}"
        if info.rank == 0:
            print(f"planning failed ({type(e).__name__}: {e}); running the hand plan {fallback} instead")
        plan = parse_manual(fallback, build_gpt(args), world=info.world_size, batch_rows=args.batch, seq=args.seq)
        model = build_gpt(args)
        pm = auto_wrap(model, example, loss_fn=loss_fn, plan=plan, seed=args.seed)
    d = pm.plan.degrees
    if info.rank == 0:
        print(
            f"world {info.world_size}: tp={d.tp} pp={d.pp} dp={d.dp} zero={pm.plan.zero_stage} "
            f"sp={pm.plan.sequence_parallel} schedule={pm.plan.schedule.name} x{pm.plan.schedule.num_microbatches}"
        )
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, foreach=False)
    first = last = math.nan
    t_start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        inputs, targets = batch(step, rows=args.batch, seq=args.seq, vocab=args.vocab, seed=args.seed)
        loss = float(pm.step(inputs, targets))
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        first = loss if step == 0 else first
        last = loss
        if info.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss:.4f}  {dt * 1e3:7.1f} ms  {args.batch * args.seq / dt:8.0f} tok/s")
    if info.rank == 0:
        total = time.perf_counter() - t_start
        print(f"loss {first:.4f} -> {last:.4f} (ln vocab = {math.log(args.vocab):.4f}) in {total:.1f} s")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
