"""Time the contiguous stage DP (``planner.search.stage_dp``) on a large instance: 130 layers on 64 stages.

    python -m benchmarks.stage_dp_speed [--repeat 5]

Prints the median and max wall time of ``solve_stages`` and the cut it finds. Target on the 2-core development
machine: under 2 s per solve (a 126-layer model pipelined over 64 ranks).
"""

from __future__ import annotations

import argparse
import statistics
import time

from planner.search.stage_dp import make_problem, solve_stages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=130)
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    n, s = args.layers, args.stages
    problem = make_problem(layer_time_s=[0.2] + [1.0] * (n - 2) + [0.4], layer_static_bytes=[1.0] * n,
                           layer_act_bytes=[0.1] * n, num_stages=s, num_microbatches=96,
                           inflight=[float(s - i) for i in range(s)], memory_limit_bytes=10.0)
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        sol = solve_stages(problem)
        times.append(time.perf_counter() - t0)
    print(f"stage DP, {n} layers on {s} stages: median {statistics.median(times):.3f} s, max {max(times):.3f} s "
          f"over {args.repeat} solves (target < 2 s); layers per stage {min(sol.stage_layers)}.."
          f"{max(sol.stage_layers)}, objective {sol.objective_s:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
