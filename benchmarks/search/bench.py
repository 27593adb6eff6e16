"""Zero-bubble search benchmark: REFERENCE.md's 1.5B rows, D=32 T=256, CP-SAT vs HiGHS.

Run: python benchmarks/search/bench.py [--time-limit S] [--workers N]
"""

from __future__ import annotations

import argparse
import time

from pipeweave.search import exact, heuristic, lower_bound, problem_from_times

ROWS = [  # m, T_F, T_B, T_W, T_comm, published ZB-1p, ZB-2p (REFERENCE.md, p = 8)
    (24, 18.522, 18.086, 9.337, 0.601, 0.1585, 0.0433),
    (32, 18.513, 18.086, 9.331, 0.626, 0.1242, 0.0039),
    (64, 18.546, 18.097, 9.321, 0.762, 0.0674, 0.0026),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    print("| m | K | published | heuristic | cpsat | bound | gap | cpsat s |")
    print("|---|---|---|---|---|---|---|---|")
    for m, f, b, w, c, z1, z2 in ROWS:
        for k, published in ((1, z1), (2, z2)):
            p = problem_from_times(8, m, time_f=f, time_b=b, time_w=w, time_comm=c, memory_limit=k)
            h = heuristic(p)
            r = exact(p, solver="cpsat", time_limit=args.time_limit, workers=args.workers)
            print(f"| {m} | {k} | {published} | {1 - p.work(0) / h.span:.4f} | {r.bubble_ratio:.4f} | "
                  f"{r.bubble_bound:.4f} | {100 * r.gap:.2f} % | {r.solver_time:.1f} |", flush=True)
    print("\nD=32 T=256 (f=b=w=1, comm 0.1):")
    for k in (1, 2):
        p = problem_from_times(32, 256, memory_limit=k, time_comm=0.1)
        t0 = time.perf_counter()
        h = heuristic(p)
        elapsed = time.perf_counter() - t0
        r = exact(p, solver="cpsat", time_limit=args.time_limit, workers=args.workers)
        print(f"K={k}: heuristic {elapsed:.2f} s span {h.span:.1f}; cpsat best {r.span:.1f} in {r.solver_time:.1f} s "
              f"({r.status}); bound {lower_bound(p):.1f}", flush=True)
    print("\nCP-SAT vs HiGHS (same instances, same limit):")
    for d, t, kk in ((3, 6, 1), (4, 8, 1), (8, 24, 1)):
        p = problem_from_times(d, t, memory_limit=kk, time_b=2.0, time_comm=0.5)
        for solver in ("cpsat", "highs"):
            r = exact(p, solver=solver, time_limit=args.time_limit, workers=args.workers)
            print(f"D={d} T={t} {solver}: span {r.span} bound {r.lower_bound:.3f} {r.status} {r.solver_time:.1f} s",
                  flush=True)


if __name__ == "__main__":
    main()
