"""Train a small GPT (OPT architecture: separate q/k/v, gelu MLP, learned positions) with ``runtime.auto_wrap``.

    torchrun --nproc-per-node 4 examples/train_gpt.py                     # plan with the planner for 4 ranks
    torchrun --nproc-per-node 4 examples/train_gpt.py --plan plan.json    # a plan from `autopar plan`
    torchrun --nproc-per-node 4 examples/train_gpt.py --manual tp=2,dp=2,zero=3,sp=1
    torchrun --nproc-per-node 4 --max-restarts 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \
        examples/train_gpt.py --checkpoint-dir ckpt --checkpoint-every 2 --losses-out losses.json

The same script runs every plan: the model is built on the meta device (auto_wrap materialises only each rank's
shards, seeded per parameter name), every rank draws the same global batch and ``pm.step`` takes its share.
The data is synthetic and learnable (each sequence counts up from a random start with a random stride, mod the
vocabulary), so the loss falls well below ln(vocab) within a few dozen steps.

With ``--checkpoint-dir`` it saves every ``--checkpoint-every`` steps and, started again (by hand or by torchrun's
``--max-restarts``, on the same or another number of ranks), continues from the latest complete checkpoint: step
``s`` always trains on batch ``s``. ``--losses-out`` writes ``{"1": loss, ...}``: each step this run trained,
counted from 1, and its global loss. ``--fail-at N`` makes the last rank exit inside step N's loss (mid-step) on
the first attempt only (TORCHELASTIC_RESTART_COUNT=0), to try the restart; ``--lose-node-at N`` kills the torchrun
agent and ranks of the node started with AUTOPAR_LOSE_THIS_NODE=1 inside step N, to try ``--nnodes MIN:MAX``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from costmodel.errors import AutoparError  # noqa: E402
from runtime import auto_wrap, init_distributed  # noqa: E402
from runtime.auto_wrap import launch_shape  # noqa: E402
from runtime.manual_plan import manual_plan  # noqa: E402


def build_gpt(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, ffn_dim=4 * args.hidden,
        num_attention_heads=args.heads, max_position_embeddings=max(64, args.seq), word_embed_proj_dim=args.hidden,
        activation_function="gelu", dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=1,
        use_cache=False,
    )
    with torch.device("meta"):
        return OPTForCausalLM(cfg)


def gpt(batch: int = 8, seq: int = 32, layers: int = 4, hidden: int = 128, heads: int = 4, vocab: int = 512):
    """The model and one example batch, for ``autopar plan --model examples.train_gpt:gpt`` (the defaults are this
    script's, so the plan's fingerprint matches the model it trains)."""
    args = argparse.Namespace(vocab=vocab, hidden=hidden, layers=layers, heads=heads, seq=seq)
    return build_gpt(args), (torch.zeros(batch, seq, dtype=torch.long),)


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
    nodes = int(kv.get("nodes", launch_shape(world)[0]))  # the plan's cluster: this launch's nodes by default
    return manual_plan(
        model, tp=tp, dp=dp, pp=pp, zero_stage=int(kv.get("zero", 0)), sequence_parallel=kv.get("sp", "0") == "1",
        microbatch_size=batch_rows // (dp * mb), num_microbatches=mb, schedule=kv.get("schedule", "1f1b"),
        seq_len=seq, name="train_gpt", nodes=nodes,
    )


@record  # torchrun's failure summary then shows the exception of a failed rank, not only its exit code
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default=None, help="plan JSON from `autopar plan`, or a directory of them (the one "
                    "for the running world size is used); default: plan here for this launch")
    ap.add_argument("--manual", default=None, help="a plan given by hand: tp=2,dp=2,pp=1,zero=3,sp=1,mb=2[,nodes=2]")
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
    ap.add_argument("--checkpoint-dir", default=None, help="save here and resume from the latest complete save")
    ap.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints (default 5)")
    ap.add_argument("--checkpoint-keep", type=int, default=2, help="complete checkpoints kept (default 2)")
    ap.add_argument("--losses-out", default=None, help="write {step from 1: global loss} of the steps run as JSON")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="collective timeout: a dead or hung rank fails the others after this (default 600 s)")
    ap.add_argument("--fail-at", type=int, default=None, help=argparse.SUPPRESS)  # tests: the last rank exits
    ap.add_argument("--lose-node-at", type=int, default=None, help=argparse.SUPPRESS)  # tests: the last node dies
    args = ap.parse_args(argv)

    info = init_distributed(timeout_s=args.timeout_s)
    model = build_gpt(args)
    example = batch(0, rows=args.batch, seq=args.seq, vocab=args.vocab, seed=args.seed)
    plan = args.plan
    ckpt = {}
    if args.checkpoint_dir:
        ckpt = {"checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every,
                "checkpoint_keep": args.checkpoint_keep}
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    agent = os.getppid()  # torchrun's agent on this node
    lose_this_node = os.environ.get("AUTOPAR_LOSE_THIS_NODE") == "1"  # set on the agent of the node to lose
    current = {"step": 0}

    def step_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if first_attempt and current["step"] + 1 == args.fail_at and info.rank == info.world_size - 1:
            print(f"rank {info.rank}: exiting inside step {args.fail_at} (--fail-at)", flush=True)
            os._exit(17)  # mid-step: after this step's first forward, before its backward; no cleanup
        if first_attempt and current["step"] + 1 == args.lose_node_at and lose_this_node and agent > 1:
            print(f"rank {info.rank}: node {os.environ['GROUP_RANK']} lost inside step {args.lose_node_at} "
                  "(--lose-node-at: its torchrun agent is killed)", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent, signal.SIGKILL)
            os._exit(17)
        return loss_fn(logits, targets)

    if args.manual:
        plan = parse_manual(args.manual, model, world=info.world_size, batch_rows=args.batch, seq=args.seq)
    try:
        pm = auto_wrap(model, example, loss_fn=step_loss, plan=plan, cluster=args.cluster, seed=args.seed, **ckpt)
    except (AutoparError, ImportError) as e:
        if plan is not None:
            raise
        fallback = f"tp={2 if info.world_size % 2 == 0 else 1}"
        if info.rank == 0:
            print(f"planning failed ({type(e).__name__}: {e}); running the hand plan {fallback} instead")
        plan = parse_manual(fallback, build_gpt(args), world=info.world_size, batch_rows=args.batch, seq=args.seq)
        model = build_gpt(args)
        pm = auto_wrap(model, example, loss_fn=step_loss, plan=plan, seed=args.seed, **ckpt)
    d = pm.plan.degrees
    if info.rank == 0:
        print(
            f"world {info.world_size}: tp={d.tp} pp={d.pp} dp={d.dp} zero={pm.plan.zero_stage} "
            f"sp={pm.plan.sequence_parallel} schedule={pm.plan.schedule.name} x{pm.plan.schedule.num_microbatches}"
        )
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, foreach=False)
    start = pm.resume(opt) if args.checkpoint_dir else 0
    if info.rank == 0 and start:
        print(f"resumed from the checkpoint of step {start} in {args.checkpoint_dir}")
    losses: dict[str, float] = {}
    first = last = math.nan
    t_start = time.perf_counter()
    for step in range(start, args.steps):
        current["step"] = step
        t0 = time.perf_counter()
        inputs, targets = batch(step, rows=args.batch, seq=args.seq, vocab=args.vocab, seed=args.seed)
        loss = float(pm.step(inputs, targets))
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        first = loss if step == start else first
        last = loss
        losses[str(step + 1)] = loss
        if info.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step + 1:4d}  loss {loss:.4f}  {dt * 1e3:7.1f} ms  {args.batch * args.seq / dt:8.0f} tok/s")
    pm.close()
    if info.rank == 0:
        total = time.perf_counter() - t_start
        print(f"loss {first:.4f} -> {last:.4f} (ln vocab = {math.log(args.vocab):.4f}) in {total:.1f} s")
        if args.losses_out:
            Path(args.losses_out).write_text(json.dumps(losses, indent=1) + "\n")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
