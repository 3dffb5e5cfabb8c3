"""``autopar trace``: trace a model on meta tensors and print its blocks, FLOPs and coverage."""

from __future__ import annotations

import argparse
import json
import time

NAME = "trace"
HELP = ("trace a model (on meta tensors) and print per-block ops, params, FLOPs, the activation bytes autograd saves "
        "for backward, coverage")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="preset (gpt2, gpt3-175b, llama3-8b, ...), inline dims (gpt:layers=..,hidden=..), "
                             "a config.json path, or module.path:function")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    from planner.graph import coarsen, find_block_groups, find_blocks
    from planner.workload import trace_spec

    t0 = time.perf_counter()
    traced = trace_spec(args.model, batch=args.batch, seq=args.seq)
    graph = traced.graph
    blocks = find_blocks(graph)
    runs = _runs(blocks)
    saved = _saved_bytes(graph, blocks)
    groups = find_block_groups([b for b in blocks if b.kind == "transformer"])
    wall_s = time.perf_counter() - t0
    summary = {
        "model": args.model,
        "batch": args.batch,
        "seq": traced.dims.seq,
        "params": graph.params,
        "params_model": traced.params,
        "fingerprint": traced.fingerprint,
        "flops_fwd": graph.flops_fwd,
        "flops_bwd": graph.flops_bwd,
        "model_flops": graph.model_flops,
        "model_flops_causal": graph.model_flops_causal,
        "attention_flops_fwd": sum(b.attn_flops_fwd for b in blocks),
        "num_nodes": len(graph.nodes),
        "num_nodes_coarse": len(coarsen(graph).nodes),
        "num_layers": len(graph.layer_fqns),
        "traced_layers": graph.traced_layers,
        "blocks": [_run_json(r, saved) for r in runs],
        "identical_blocks": [{"members": list(g.members), "repeat": g.repeat, "signature": g.signature}
                             for g in groups],
        "unsupported_ops": dict(graph.unsupported),
        "trace_time_s": graph.trace_time_s,
        "wall_time_s": wall_s,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_table(summary, runs, saved)
    return 0


def _saved_bytes(graph, blocks: list) -> dict[str, float | None]:
    """Per block, the bytes autograd saves for backward (``planner.saved``'s replay of the traced backward, summed
    over the block's ops); None where the replay did not run."""
    by_name = {n.name: n for n in graph.nodes}
    out: dict[str, float | None] = {}
    for b in blocks:
        vals = [by_name[o].saved_bytes for o in b.ops if o in by_name]
        out[b.name] = None if any(v is None for v in vals) else float(sum(vals))
    return out


def _runs(blocks: list) -> list[list]:
    """Consecutive blocks with one signature, as runs."""
    runs: list[list] = []
    for b in blocks:
        if runs and runs[-1][0].signature == b.signature:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


def _run_name(run: list) -> str:
    if len(run) == 1:
        return run[0].name
    first, last = run[0].name, run[-1].name
    parent, _, i = first.rpartition(".")
    return f"{parent}.{i}-{last.rpartition('.')[2]}" if parent else f"{first}..{last}"


def _run_json(run: list, saved: dict[str, float | None]) -> dict:
    b = run[0]
    return {"name": _run_name(run), "kind": b.kind, "first": b.name, "last": run[-1].name, "repeat": len(run),
            "ops": len(b.ops), "params": b.params, "flops_fwd": b.flops_fwd, "flops_bwd": b.flops_bwd,
            "saved_bytes": saved[b.name], "written_bytes": b.act_bytes, "signature": b.signature}


def _print_table(s: dict, runs: list[list], saved: dict[str, float | None]) -> None:
    print(f"model {s['model']}: {s['params']:,} parameters ({s['params'] / 1e9:.3f}B), batch {s['batch']}, "
          f"seq {s['seq']}")
    n_layers, traced = s["num_layers"], s["traced_layers"]
    groups = s["identical_blocks"]
    if len(groups) == 1:
        same = f"{groups[0]['repeat']} identical blocks"
    else:
        same = f"{len(groups)} distinct layer blocks: " + ", ".join(
            f"{g['members'][0]} x{g['repeat']}" for g in groups)
    if n_layers:
        print(f"traced {traced} of {n_layers} layers; {same}"
              + ("" if traced == n_layers else " (the others are copies of the traced ones)"))
    head = f"{'block':<28} {'x':>4} {'ops':>5} {'params':>14} {'fwd GFLOP':>12} {'bwd GFLOP':>12} {'saved MB':>10} {'written MB':>11}"
    print(head)
    print("-" * len(head))
    for r in runs:
        b = r[0]
        kept = "-" if saved[b.name] is None else f"{saved[b.name] / 2**20:.1f}"
        print(f"{_run_name(r):<28} {len(r):>4} {len(b.ops):>5} {b.params:>14,} {b.flops_fwd / 1e9:>12.2f} "
              f"{b.flops_bwd / 1e9:>12.2f} {kept:>10} {b.act_bytes / 2**20:>11.1f}")
    print("-" * len(head))
    print(f"{'total':<28} {'':>4} {s['num_nodes']:>5} {s['params']:>14,} {s['flops_fwd'] / 1e9:>12.2f} "
          f"{s['flops_bwd'] / 1e9:>12.2f}")
    if s["attention_flops_fwd"]:
        print(f"model FLOPs (fwd+bwd, no recompute): {s['model_flops']:.4g} dense attention, "
              f"{s['model_flops_causal']:.4g} causal; attention {s['attention_flops_fwd'] / 1e9:.4g} GFLOP forward")
    else:
        print(f"model FLOPs (fwd+bwd, no recompute): {s['model_flops']:.4g}; no attention ops")
    print("saved MB: what autograd keeps for the backward, per block (replayed on fake tensors); written MB: the "
          "bytes its ops write (an upper bound)")
    print(f"ops: {s['num_nodes']} aten ops, {s['num_nodes_coarse']} after folding views / pointwise ops")
    if s["unsupported_ops"]:
        print("coverage: ops with no FLOP rule (counted as 0 FLOPs):")
        for op, n in sorted(s["unsupported_ops"].items(), key=lambda kv: -kv[1]):
            print(f"  {op}: {n}")
    else:
        print("coverage: every op has a FLOP rule")
    print(f"trace time {s['trace_time_s']:.2f} s; with the model build and library imports {s['wall_time_s']:.2f} s")
