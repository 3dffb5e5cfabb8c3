"""Time the intra-op sharding ILP on one distinct transformer block of a real model.

    python -m benchmarks.intra_op_speed [--model gpt3-175b] [--cluster dgx-a100-80gb --nodes 128] [--repeat 10]

Traces the model once (``planner.workload``, meta device), then for tp in {1, 2, 4, 8} with and without sequence
parallelism solves its first transformer block with a fresh cache ``--repeat`` times per backend and prints the
median / max wall time of ``block_strategy`` (problem build + solve + read back), the solver's own time, the
model size, the status and the chosen styles. Then it walks every layer through one shared cache (the planner's
pattern: one solve, the other layers hit). Target: one block of GPT-3 175B at tp=8 well under 1 s.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--cluster", default="dgx-a100-80gb")
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--microbatch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--backends", default="CBC,SCIP")
    args = ap.parse_args(argv)

    from costmodel.profiles import make_cluster
    from planner.search.block_plan import StrategyCache, block_strategy
    from planner.search.intra_op import SolverOptions
    from planner.workload import workload_from_model

    t0 = time.perf_counter()
    workload, bits = workload_from_model(args.model)
    print(f"{args.model}: traced in {time.perf_counter() - t0:.1f} s, {len(bits.blocks)} blocks, "
          f"{len(bits.groups)} distinct")
    cluster = make_cluster(args.cluster, args.nodes)
    layers = [b for b in bits.blocks if b.kind == "transformer"]
    kw = dict(graph=bits.graph, microbatch=args.microbatch, seq=workload.seq, cluster=cluster)
    t0 = time.perf_counter()
    block_strategy(layers[0], tp=8, **kw)
    print(f"first solve (loads OR-Tools): {time.perf_counter() - t0:.3f} s")
    print(f"{'backend':8} {'tp':>3} {'sp':>3} {'median_ms':>10} {'max_ms':>8} {'solver_ms':>10} {'vars':>5} "
          f"{'cons':>5} status  styles")
    for backend in args.backends.split(","):
        for sp in (False, True):
            for tp in (1, 2, 4, 8):
                times, bs = [], None
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    bs = block_strategy(layers[0], tp=tp, sequence_parallel=sp, cache=StrategyCache(),
                                        options=SolverOptions(backend=backend), **kw)
                    times.append(time.perf_counter() - t0)
                styles = ",".join(sorted({f"{m.fqn.rsplit('.', 1)[-1]}={m.style}" for m in bs.shardings}))
                print(f"{backend:8} {tp:>3} {'y' if sp else 'n':>3} {statistics.median(times) * 1e3:>10.1f} "
                      f"{max(times) * 1e3:>8.1f} {bs.solver['solve_time_s'] * 1e3:>10.1f} "
                      f"{bs.solver['num_variables']:>5} {bs.solver['num_constraints']:>5} {bs.solver['status']}  "
                      f"{styles}")
    cache = StrategyCache()
    t0 = time.perf_counter()
    for layer in layers:
        block_strategy(layer, tp=8, sequence_parallel=True, cache=cache, **kw)
    print(f"all {len(layers)} layers through one cache: {time.perf_counter() - t0:.3f} s "
          f"({cache.misses} solve, {cache.hits} hits)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
