"""Zero-bubble search benchmark: REFERENCE.md's 1.5B rows, D=32 T=256, small instances proven, CP-SAT vs HiGHS.

Run: python benchmarks/search/bench.py [--section rows|big|small|compare|warmup|seeds|all] [--time-limit S]
         [--work-limit W] [--workers N]

With one worker and a work limit (CP-SAT's deterministic time) that binds
before the time limit, every CP-SAT figure is the same on every run; the
heuristic is deterministic (a work budget, not a clock).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from typing import Any

from pipeweave.autoschedule import exact, heuristic, lower_bound, problem_from_times
from pipeweave.autoschedule.exact import _checked, build_model, incumbent_starts
from pipeweave.autoschedule.heuristic import one_at_a_time
from pipeweave.autoschedule.isolate import Budget, solve_isolated
from pipeweave.sim.metrics import peak_activations
from pipeweave.sim.timeline import simulate

ROWS = [  # m, T_F, T_B, T_W, T_comm, published ZB-1p, ZB-2p (REFERENCE.md, p = 8)
    (24, 18.522, 18.086, 9.337, 0.601, 0.1585, 0.0433),
    (32, 18.513, 18.086, 9.331, 0.626, 0.1242, 0.0039),
    (64, 18.546, 18.097, 9.321, 0.762, 0.0674, 0.0026),
]


def rows(args: argparse.Namespace) -> None:
    print("| m | K | published | heuristic | heuristic s | CP-SAT | bound | gap | status | s | peak / limit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m, f, b, w, c, z1, z2 in ROWS:
        for k, published in ((1, z1), (2, z2)):
            p = problem_from_times(8, m, time_f=f, time_b=b, time_w=w, time_comm=c, activation_limit=k)
            t0 = time.perf_counter()
            h = heuristic(p)
            h_s = time.perf_counter() - t0
            r = exact(p, solver="cpsat", time_limit=args.time_limit, workers=args.workers,
                      work_limit=args.work_limit)
            peak = max(peak_activations(simulate(r.schedule, p.cost), p.costs))  # validated in exact
            print(f"| {m} | {k} | {published} | {1 - p.work(0) / h.span:.4f} | {h_s:.2f} | "
                  f"{r.bubble_ratio:.4f} | {r.bubble_bound:.4f} | {100 * r.gap:.2f} % | {r.status} | "
                  f"{r.solver_time:.1f} | {peak:g} / {p.limit[0]:g} |", flush=True)


def big(args: argparse.Namespace) -> None:
    print("| D=32 T=256 f=b=w=1 comm 0.1 | K | heuristic s | heuristic span | CP-SAT span | status | "
          "search s (limit) | total s | bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v, k in ((False, 1), (False, 2), (True, 1)):
        p = problem_from_times(32, 256, activation_limit=k, time_comm=0.1, vshape=v)
        t0 = time.perf_counter()
        h = heuristic(p)
        h_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        r = exact(p, solver="cpsat", time_limit=args.time_limit, workers=args.workers)
        total = time.perf_counter() - t0
        print(f"| {'V' if v else 'straight'} | {k} | {h_s:.2f} | {h.span:.1f} | {r.span:.1f} | {r.status} | "
              f"{r.solver_time:.1f} ({args.time_limit:g}) | {total:.1f} | {lower_bound(p):.1f} |", flush=True)


def small(args: argparse.Namespace) -> None:
    print("| D | T | placement | K | f, b, w, comm | heuristic | best | bound | status | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    times = ((1.0, 1.0, 1.0, 0.0), (1.0, 2.0, 1.0, 0.5))
    for (d, t), v, k, (f, b, w, c) in itertools.product(((2, 4), (3, 6), (4, 8)), (False, True), (1, 2), times):
        p = problem_from_times(d, t, vshape=v, time_f=f, time_b=b, time_w=w, time_comm=c, activation_limit=k)
        r = exact(p, solver="cpsat", time_limit=60, workers=1)
        print(f"| {d} | {t} | {'V' if v else 'straight'} | {k} | {f:g}, {b:g}, {w:g}, {c:g} | "
              f"{heuristic(p).span:g} | {r.span:g} | {r.lower_bound:.4g} | {r.status} | {r.solver_time:.1f} |",
              flush=True)


def compare(args: argparse.Namespace) -> None:
    """Both back-ends from the same poor start (one microbatch at a time), so each has to work."""
    print("| instance (f=1, b=2, w=1, comm 0.5) | bound (hand) | heuristic | CP-SAT | s | HiGHS | s |")
    print("|---|---|---|---|---|---|---|")
    for d, t, k, v in ((3, 6, 1, False), (4, 8, 1, False), (4, 8, 1.5, False), (8, 24, 1, False),
                       (3, 6, 1, True), (4, 8, 1, True)):
        p = problem_from_times(d, t, vshape=v, activation_limit=k, time_b=2.0, time_comm=0.5)
        poor = one_at_a_time(p)
        model = build_model(p, poor.span)
        warm = incumbent_starts(model, poor.order)
        cells = []
        for solver in ("cpsat", "highs"):
            t0 = time.perf_counter()
            solved = solve_isolated(solver, model, warm, Budget(t0 + args.time_limit, workers=1))
            elapsed = time.perf_counter() - t0
            found = _checked(p, solved.order) if solved.order is not None else None
            span = f"{found.span:g}" if found is not None else "-"
            bound = f"{solved.bound / model.time_scale:.4g}" if solved.bound > -math.inf else "-"
            cells.append(f"{span} {solved.status} (bound {bound}) | {elapsed:.1f}")
        print(f"| D={d} T={t} K={k}{' V' if v else ''} | {lower_bound(p):.4g} | {heuristic(p).span:g} | "
              f"{' | '.join(cells)} |", flush=True)


LARGE = (10.4, 10.4, 7.7, 0.4)  # f, b, w, comm: like the zero-bubble paper's largest models (ms)


def before_after(name: str, p: Any, option: str) -> str:
    """One table row: the heuristic's bubble and CPU seconds with ``option`` False, then True (the default)."""
    cells = []
    for on in (False, True):
        t0 = time.process_time()
        span = heuristic(p, **{option: on}).span
        cells.append((1 - p.work(0) / span, time.process_time() - t0))
    (old, old_s), (new, new_s) = cells
    return (f"| {name} | {p.num_stages} | {p.num_microbatches} | {p.activation_limit:g} | "
            f"{1 - p.work(0) / lower_bound(p):.4f} | {old:.4f} | **{new:.4f}** | {old_s:.2f} | {new_s:.2f} |")


def warmup(args: argparse.Namespace) -> None:
    """The heuristic without and with the paper's timed warm-ups, on straight pipelines up to D = 32."""
    print("| profile | D | T | K | bound | before | after | before s | after s |")
    print("|---|---|---|---|---|---|---|---|---|")
    cases = [("1.5B", 8, m, (f, b, w, c)) for m, f, b, w, c, *_ in ROWS]
    cases += [("large", d, t, LARGE) for d in (8, 16, 24, 32) for t in (2 * d, 3 * d, 4 * d)]
    cases += [("f=b=w=1 c=0.1", d, 3 * d, (1.0, 1.0, 1.0, 0.1)) for d in (16, 32)]
    for name, d, t, (f, b, w, c) in cases:
        for k in (1, 2):
            p = problem_from_times(d, t, time_f=f, time_b=b, time_w=w, time_comm=c, activation_limit=k)
            print(before_after(name, p, "timed"), flush=True)


def seeds(args: argparse.Namespace) -> None:
    """The heuristic without and with the registry's hand-built orders as candidates (search/seeds.py)."""
    print("| schedule | D | T | K | bound | before | after | before s | after s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for vshape in (False, True):
        f, b, w, c = LARGE if not vshape else (LARGE[0] / 2, LARGE[1] / 2, LARGE[2] / 2, LARGE[3])
        for d, t in ((8, 24), (16, 48), (16, 64), (32, 96)):
            for k in (1, 2):
                p = problem_from_times(d, t, vshape=vshape, time_f=f, time_b=b, time_w=w, time_comm=c,
                                       activation_limit=k)
                print(before_after("zb-v-auto" if vshape else "zb-auto", p, "seeds"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--section", choices=("rows", "big", "small", "compare", "warmup", "seeds", "all"),
                        default="all")
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--work-limit", type=float, default=None, help="CP-SAT deterministic time")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    for name, run in (("rows", rows), ("big", big), ("small", small), ("compare", compare), ("warmup", warmup),
                      ("seeds", seeds)):
        if args.section in (name, "all"):
            print(f"\n## {name}\n", flush=True)
            run(args)


if __name__ == "__main__":
    main()
