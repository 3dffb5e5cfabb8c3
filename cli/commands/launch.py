"""``autopar launch plan.json -- train.py ARGS``: the torchrun command that runs a plan on its cluster.

Prints one ``torchrun`` command per node of the plan's cluster (``--nnodes`` = the plan's nodes, or
``MIN:MAX`` with ``--min-nodes``; ``--nproc-per-node`` = its GPUs per node; c10d rendezvous at
``--master-addr:--port``), or with ``--slurm`` an sbatch script whose ``srun`` starts one torchrun per node
(rendezvous at the job's first node, ``--rdzv-id`` the job id). ``--local`` runs the plan's ranks on this machine:
one torchrun agent per plan node, all on 127.0.0.1 (each stands for one node), and exits 0 when every agent does.
torchrun does the work (rendezvous, restarts, rank numbering); this command only writes its arguments.

Every command sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the store shared between torchrun's
rendezvous and the workers, a restarted worker can read the failed attempt's connection keys
(pytorch/pytorch#135712). The training script must take the plan itself (``auto_wrap(..., plan="plan.json")``,
e.g. ``examples/train_gpt.py --plan plan.json``); the launch must match the plan's nodes x GPUs per node, which
``runtime.mesh.check_launch`` enforces at start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from cli.exit import EXIT_ERROR, EXIT_OK
from costmodel.errors import ConfigError

NAME = "launch"
HELP = ("print the torchrun command per node that runs a plan (--slurm: an sbatch script with srun; --local: run "
        "the plan's ranks here through torchrun); usage: autopar launch plan.json [options] -- train.py ARGS")

PASSTHROUGH = True
"""What follows ``--`` on the command line (the training script and its arguments) arrives as ``args.passthrough``."""
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", type=Path, help="the plan JSON (from `autopar plan --out`)")
    p.add_argument("--master-addr", default="MASTER_HOST",
                   help="host of the rendezvous (the first node; default the placeholder MASTER_HOST)")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port (default 29500)")
    p.add_argument("--rdzv-id", default=None, help="rendezvous id (default: derived from the plan file)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts after a failure (resume with checkpoint_dir=; default 0)")
    p.add_argument("--min-nodes", type=int, default=None,
                   help="elastic: --nnodes MIN:MAX with MIN this (the job continues with fewer nodes; re-plan with "
                        "auto_wrap(plan=None) or a directory of plans)")
    p.add_argument("--slurm", action="store_true", help="print an sbatch script that runs torchrun with srun")
    p.add_argument("--local", action="store_true",
                   help="run the plan's ranks on this machine: one torchrun agent per plan node on 127.0.0.1")
    p.add_argument("--json", action="store_true",
                   help="print {nodes, nproc_per_node, env, commands: one argv per node} (with --slurm: {sbatch})")
    p.add_argument("--python", default=sys.executable,
                   help="--local: the interpreter that runs torch.distributed.run (default this one)")


def _script(args: argparse.Namespace) -> list[str]:
    rest = list(getattr(args, "passthrough", None) or [])
    if not rest:
        raise ConfigError("no training script: autopar launch plan.json -- train.py [ARGS]")
    return rest


def _shape(plan) -> tuple[int, int]:
    c = plan.cluster
    if c.nodes * c.gpus_per_node != c.num_devices:
        raise ConfigError(
            f"plan cluster {c.name!r} has {c.num_devices} devices, not {c.nodes} nodes x {c.gpus_per_node}: its node "
            "groups differ in size; launch each group's nodes by hand with their own --nproc-per-node"
        )
    return c.nodes, c.gpus_per_node


def torchrun_args(*, nnodes: str, nproc: int, endpoint: str, rdzv_id: str, max_restarts: int) -> list[str]:
    """torchrun's options, the same on every node: the c10d rendezvous numbers the nodes (GROUP_RANK; torchrun
    ignores ``--node-rank`` under c10d)."""
    out = ["--nnodes", nnodes]
    out += ["--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", rdzv_id, "--max-restarts", str(max_restarts)]
    return out


def run(args: argparse.Namespace) -> int:
    from planner.plan import load_plan

    plan = load_plan(args.plan)
    script = _script(args)
    nodes, per_node = _shape(plan)
    if args.min_nodes is not None and not 1 <= args.min_nodes <= nodes:
        raise ConfigError(f"--min-nodes {args.min_nodes} must be between 1 and the plan's {nodes} nodes")
    nnodes = f"{args.min_nodes}:{nodes}" if args.min_nodes is not None and args.min_nodes < nodes else str(nodes)
    rdzv_id = args.rdzv_id or "autopar-" + hashlib.sha256(plan.to_json().encode()).hexdigest()[:12]
    d = plan.degrees
    summary = (f"plan {args.plan}: tp={d.tp} cp={d.cp} pp={d.pp} dp={d.dp} ep={d.ep} on {nodes} node(s) x {per_node} "
               f"({plan.cluster.name}, {plan.cluster.gpu})")
    if args.local:
        return _run_local(args, script=script, nodes=nodes, per_node=per_node, nnodes=nnodes, rdzv_id=rdzv_id,
                          summary=summary)
    if args.slurm:
        text = _sbatch(plan, script=script, nodes=nodes, per_node=per_node, nnodes=nnodes, port=args.port,
                       max_restarts=args.max_restarts, summary=summary)
        sys.stdout.write(json.dumps({"sbatch": text}, indent=1) + "\n" if args.json else text)
        return EXIT_OK
    endpoint = f"{args.master_addr}:{args.port}"
    cmds = [["torchrun", *torchrun_args(nnodes=nnodes, nproc=per_node, endpoint=endpoint, rdzv_id=rdzv_id,
                                        max_restarts=args.max_restarts), *script] for _ in range(nodes)]
    if args.json:
        print(json.dumps({"nodes": nodes, "nnodes": nnodes, "nproc_per_node": per_node,
                          "env": {SHARE_STORE_ENV: "1"}, "commands": cmds}, indent=1))
        return EXIT_OK
    print(f"# {summary}")
    print(f"# the rendezvous is on {args.master_addr}; the c10d rendezvous numbers the nodes (GROUP_RANK)")
    for i, cmd in enumerate(cmds):
        print(f"# node {i} of {nodes}")
        print(f"{SHARE_STORE_ENV}=1 {shlex.join(cmd)}")
    return EXIT_OK


def _sbatch(plan, *, script: list[str], nodes: int, per_node: int, nnodes: str, port: int, max_restarts: int,
            summary: str) -> str:
    cpu = plan.cluster.gpu.lower().startswith("cpu") or not plan.cluster.gpu
    gpus = "" if cpu else f"#SBATCH --gpus-per-node={per_node}\n"
    cmd = ["torchrun", *torchrun_args(nnodes=nnodes, nproc=per_node, endpoint="__ENDPOINT__", rdzv_id="__ID__",
                                      max_restarts=max_restarts), *script]
    line = shlex.join(cmd).replace("__ENDPOINT__", f'"$head_node:{port}"').replace("__ID__", '"$SLURM_JOB_ID"')
    return (
        "#!/bin/bash\n"
        f"# {summary}\n"
        f"#SBATCH --job-name=autopar-{plan.model.name.split(':')[0][:40]}\n"
        f"#SBATCH --nodes={nodes}\n"
        "#SBATCH --ntasks-per-node=1\n"
        f"{gpus}"
        "set -euo pipefail\n"
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"export {SHARE_STORE_ENV}=1\n"
        f"srun --kill-on-bad-exit=1 {line}\n"
    )


def _run_local(args: argparse.Namespace, *, script: list[str], nodes: int, per_node: int, nnodes: str, rdzv_id: str,
               summary: str) -> int:
    from runtime.measure.spawn import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, SHARE_STORE_ENV: "1"}
    print(f"# {summary}; {nodes} local torchrun agent(s), rendezvous {endpoint}", flush=True)
    procs = []
    for i in range(nodes):
        cmd = [args.python, "-m", "torch.distributed.run",
               *torchrun_args(nnodes=nnodes, nproc=per_node, endpoint=endpoint, rdzv_id=rdzv_id,
                              max_restarts=args.max_restarts), *script]
        print(shlex.join(cmd), flush=True)
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        raise
    failed = [(i, c) for i, c in enumerate(codes) if c != 0]
    if failed:
        what = ", ".join(f"node {i} exited with {c}" for i, c in failed)
        print(f"autopar launch: error: torchrun failed ({what}); its summary above names the failed ranks",
              file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
