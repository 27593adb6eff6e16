"""Time generate + validate + simulate (+ metrics) for every registry schedule.

Usage (from the repository root):
    python benchmarks/simulator/bench.py                      # D=64, T=512 for all, then D=1024, T=4096 1f1b
    python benchmarks/simulator/bench.py --names 1f1b zb-v    # a subset
    python benchmarks/simulator/bench.py --no-big             # skip D=1024, T=4096

Prints a markdown table (seconds per phase, best of --repeat runs for the
D=64 rows) and the process's peak memory. Not a test: timings depend on the
machine and its load; see README.md for recorded results.
"""

from __future__ import annotations

import argparse
import gc
import platform
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

from pipeweave.schedule import SCHEDULES, ScheduleError, generate, validate
from pipeweave.sim import compute_metrics, simulate


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(result, CPU seconds)``: CPU time, because the 2-core machine is shared and wall time swings with load."""
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def measure(name: str, d: int, t: int) -> dict[str, Any]:
    """Seconds of each phase for one schedule and size (``error`` when the family rejects it)."""
    gc.collect()
    wall = time.perf_counter()
    try:
        schedule, t_gen = _timed(lambda: generate(name, num_stages=d, num_microbatches=t))
    except ScheduleError as exc:
        return {"name": name, "error": str(exc)}
    _, t_val = _timed(lambda: validate(schedule))
    timeline, t_sim = _timed(lambda: simulate(schedule, check=False))  # validated just above
    metrics, t_met = _timed(lambda: compute_metrics(timeline))
    actions = sum(len(row) for row in schedule.actions)
    return {"name": name, "actions": actions, "generate": t_gen, "validate": t_val, "simulate": t_sim,
            "metrics": t_met, "total": t_gen + t_val + t_sim + t_met, "wall": time.perf_counter() - wall,
            "bubble_ratio": metrics.bubble_ratio}


def best_of(name: str, d: int, t: int, repeat: int) -> dict[str, Any]:
    runs = [measure(name, d, t) for _ in range(repeat)]
    return min(runs, key=lambda r: r.get("total", 0.0))


def row(r: dict[str, Any], d: int, t: int) -> str:
    if "error" in r:
        return f"| {r['name']} | {d} | {t} | rejected: {r['error']} | | | | | | | |"
    return (f"| {r['name']} | {d} | {t} | {r['actions']} | {r['generate']:.3f} | {r['validate']:.3f} | "
            f"{r['simulate']:.3f} | {r['metrics']:.3f} | **{r['total']:.3f}** | {r['wall']:.3f} | {r['bubble_ratio']:.4f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--names", nargs="*", default=None, help="registry names (default: all)")
    p.add_argument("--stages", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs per schedule")
    p.add_argument("--no-big", action="store_true", help="skip 1f1b at D=1024, T=4096")
    p.add_argument("--big-only", action="store_true", help="only 1f1b at D=1024, T=4096")
    args = p.parse_args(argv)
    names = args.names or list(SCHEDULES)
    print(f"# python {platform.python_version()} on {platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print("CPU seconds per phase (wall seconds of the whole, on a shared machine, last)")
    print("| schedule | D | T | actions | generate | validate | simulate | metrics | total CPU | wall | bubble |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in [] if args.big_only else names:
        print(row(best_of(name, args.stages, args.microbatches, args.repeat), args.stages, args.microbatches),
              flush=True)
    if not args.no_big:
        print(row(measure("1f1b", 1024, 4096), 1024, 4096), flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"\npeak resident memory: {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
