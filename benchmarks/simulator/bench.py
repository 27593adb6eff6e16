"""Time the simulator and its metrics, the pure-Python reference beside the two fast engines, in one run.

Usage (from the repository root):
    python benchmarks/simulator/bench.py --parts --no-big     # where the fast engine's cold time goes
    python benchmarks/simulator/bench.py                      # D=64, T=512 for every schedule, then D=1024, T=4096 1f1b
    python benchmarks/simulator/bench.py --names 1f1b zb-v    # a subset
    python benchmarks/simulator/bench.py --no-big             # skip D=1024, T=4096

For each schedule, ``--rounds`` rounds; each round times, one after the other
on the same machine state, the reference (``simulate(s, fast=False)`` and
``compute_metrics``), then each fast engine -- the numpy rounds
(``sim.rounds``) and the compiled walk (``sim.compiled``), in turn first -- on
a schedule it has not seen (``simulate(s)`` and ``compute_metrics``, cold: the
schedule's arrays are made and checked inside) and then again on the same
schedule (warm: what a search pays to re-simulate one schedule under other
costs). All validate the actions (``check=True``, the default). Generating the
schedule is timed once, apart; so is loading the compiled walk (numba's import
and its cache, in a fresh process), which a process pays once. Prints every
round and the medians as a markdown table, and checks that every engine gives
the same metrics. Not a test: timings depend on the machine and its load; see
README.md for recorded results.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from pipeweave.schedule import SCHEDULES, ScheduleError, generate, validate
from pipeweave.schedule.ir import Schedule
from pipeweave.sim import compute_metrics, rounds as engines, simulate
from pipeweave.sim.network import Link, Network
from pipeweave.sim.parallel import Layout, simulate_layout
from pipeweave.sim.traffic import ModelBytes
from pipeweave.sim.validation import check

# --layout: TP 2, DP 4, ZeRO 1 on nodes of 8 (NVLink-like inside, a slower link across), with issue 18's
# data-parallel reductions; sizes in the cost model's units, chosen so that every term shows.
LAYOUT = Layout(tp=2, dp=4, zero=1, network=Network(intra_node=Link(bandwidth=3e3, latency=0.013),
                                                    inter_node=Link(bandwidth=7e2, latency=0.11), gpus_per_node=8))
MODEL = ModelBytes(message=1e3, tp_collectives=2, params=5e4)


def _cpu(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(result, CPU seconds)``: CPU time, because the 2-core machine is shared and wall time swings with load."""
    gc.collect()
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def _make(name: str, d: int, t: int) -> Schedule:
    return generate(name, num_stages=d, num_microbatches=t)


def _run(schedule: Schedule, *, fast: bool, layout: bool) -> Any:
    """Simulate and compute the metrics, on one GPU per stage or on ``LAYOUT``."""
    if layout:
        return compute_metrics(simulate_layout(schedule, None, LAYOUT, MODEL, fast=fast))
    return compute_metrics(simulate(schedule, fast=fast))


ENGINES = {"rounds": float("inf"), "compiled": 0}  # ``sim.rounds.COMPILED_FROM`` that makes "auto" take each


def _engine(name: str, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``_cpu(fn)`` with the fast engine ``name``."""
    saved = engines.COMPILED_FROM
    engines.COMPILED_FROM = ENGINES[name]  # type: ignore[assignment]
    try:
        return _cpu(fn)
    finally:
        engines.COMPILED_FROM = saved


def load_seconds() -> tuple[float, float]:
    """Wall and CPU seconds a fresh process spends loading the compiled walk: numba's import, and the first
    call on a small schedule (the kernel from numba's cache on disk, compiled when the cache is empty)."""
    code = ("import time; from pipeweave.schedule import generate; from pipeweave.sim import rounds, simulate; "
            "s = generate('1f1b', num_stages=2, num_microbatches=2); rounds.COMPILED_FROM = 0; "
            "w, c = time.perf_counter(), time.process_time(); simulate(s); "
            "print(time.perf_counter() - w, time.process_time() - c)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


def compare(name: str, d: int, t: int, rounds: int, layout: bool = False) -> dict[str, Any]:
    """Per round the reference's, and each fast engine's cold and warm, CPU seconds (``error`` when rejected)."""
    try:
        schedule, t_gen = _cpu(lambda: _make(name, d, t))
    except ScheduleError as exc:
        return {"name": name, "error": str(exc)}
    out: dict[str, Any] = {"name": name, "generate": t_gen, "old": []}
    same = True
    for k in range(rounds):
        reference, seconds = _cpu(lambda: _run(schedule, fast=False, layout=layout))
        out["old"].append(seconds)
        for engine in (("rounds", "compiled") if k % 2 == 0 else ("compiled", "rounds")):
            fresh = _make(name, d, t)  # the fast engines keep a schedule's arrays: give each one it has not seen
            fast, cold = _engine(engine, lambda s=fresh: _run(s, fast=True, layout=layout))  # type: ignore[misc]
            again, warm = _engine(engine, lambda s=fresh: _run(s, fast=True, layout=layout))  # type: ignore[misc]
            out.setdefault(f"{engine} cold", []).append(cold)
            out.setdefault(f"{engine} warm", []).append(warm)
            same &= reference == fast == again
            del fresh
    out.update(actions=sum(len(row) for row in schedule.actions), same=same, bubble_ratio=reference.bubble_ratio)
    return out


def _command(schedule: Schedule, *, arrays: bool) -> Any:
    """What ``pipeweave simulate`` pays after generating: validation, simulation (fast engine), metrics; the
    validation by the pure-Python ``validate`` (before: ``arrays=False``) or over arrays (``sim.validation``)."""
    if arrays:
        check(schedule)
        return compute_metrics(simulate(schedule, check=True))
    validate(schedule)
    return compute_metrics(simulate(schedule, check=False))


def compare_command(name: str, d: int, t: int, rounds: int) -> dict[str, Any]:
    """Per round, the command's CPU seconds validating with ``validate`` and over arrays, each on a schedule
    generated afresh (cold), the two in turn first."""
    old: list[float] = []
    new: list[float] = []
    metrics = []
    for k in range(rounds):
        for arrays in ((False, True) if k % 2 == 0 else (True, False)):
            fresh = _make(name, d, t)
            found, seconds = _cpu(lambda s=fresh, a=arrays: _command(s, arrays=a))  # type: ignore[misc]
            (new if arrays else old).append(seconds)
            metrics.append(found)
            del fresh
    return {"name": name, "old": old, "new": new, "same": all(m == metrics[0] for m in metrics)}


def command_row(r: dict[str, Any], d: int, t: int) -> str:
    old, new = statistics.median(r["old"]), statistics.median(r["new"])
    show = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    return (f"| {r['name']} | {d} | {t} | {old:.3f} | **{new:.3f}** | {old / new:.1f}x | "
            f"{'yes' if r['same'] else 'NO'} | {show(r['old'])} | {show(r['new'])} |")


COLUMNS = ("rounds cold", "rounds warm", "compiled cold", "compiled warm")


def row(r: dict[str, Any], d: int, t: int) -> str:
    if "error" in r:
        return f"| {r['name']} | {d} | {t} | rejected: {r['error']} | | | | | | | | |"
    old = statistics.median(r["old"])
    rounds_cold, rounds_warm, cold, warm = (statistics.median(r[k]) for k in COLUMNS)
    return (f"| {r['name']} | {d} | {t} | {r['actions']} | {r['generate']:.3f} | {old:.3f} | {rounds_cold:.3f} | "
            f"{rounds_warm:.3f} | **{cold:.3f}** | {warm:.3f} | {old / cold:.0f}x | {'yes' if r['same'] else 'NO'} | "
            f"{r['bubble_ratio']:.4f} |")


def rounds_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return ""
    show = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    return f"{r['name']}: reference {show(r['old'])} | " + " | ".join(f"{k} {show(r[k])}" for k in COLUMNS)


# --parts: where the fast engine's cold time goes; (module, owner, function): each timed where it is called.
PARTS = (("pipeweave.sim.arrays", None, "encode"), ("pipeweave.sim.arrays", None, "well_formed"),
         ("pipeweave.sim.rounds", "_Loop", "__init__"), ("pipeweave.sim.rounds", "_Loop", "run"),
         ("pipeweave.sim.rounds", "_Loop", "times"), ("pipeweave.sim.compiled", None, "walk_times"),
         ("pipeweave.sim.rounds", None, "_run_updates"),
         ("pipeweave.sim.metrics", None, "bubble_metrics"), ("pipeweave.sim.metrics", None, "peak_activations"))


def parts(name: str, d: int, t: int, rounds: int, engine: str) -> dict[str, list[float]]:
    """Per part of ``PARTS`` (and ``total``), its CPU seconds in each cold round (a schedule generated afresh)
    on the fast ``engine``; ``encode`` includes ``well_formed``, ``run`` the rounds' walk."""
    spent: dict[str, list[float]] = {}
    now: dict[str, float] = {}
    undo = []
    for module_name, owner_name, function in PARTS:
        owner = importlib.import_module(module_name)
        owner = getattr(owner, owner_name) if owner_name else owner
        original = getattr(owner, function)

        def timed(*args: Any, _f: Any = original, _key: str = function, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return _f(*args, **kwargs)
            finally:
                now[_key] = now.get(_key, 0.0) + time.process_time() - t0

        setattr(owner, function, timed)
        undo.append((owner, function, original))
    try:
        for _ in range(rounds):
            fresh = _make(name, d, t)
            now.clear()
            _, now["total"] = _engine(engine, lambda s=fresh: _run(s, fast=True, layout=False))  # type: ignore[misc]
            for key, seconds in now.items():
                spent.setdefault(key, []).append(seconds)
            del fresh
    finally:
        for owner, function, original in undo:
            setattr(owner, function, original)
    return spent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--names", nargs="*", default=None, help="registry names (default: all)")
    p.add_argument("--stages", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5, help="rounds of reference-then-fast per schedule")
    p.add_argument("--big-rounds", type=int, default=3, help="rounds for 1f1b at D=1024, T=4096")
    p.add_argument("--no-big", action="store_true", help="skip 1f1b at D=1024, T=4096")
    p.add_argument("--big-only", action="store_true", help="only 1f1b at D=1024, T=4096")
    p.add_argument("--layout", action="store_true", help="through simulate_layout on TP 2 x DP 4 (LAYOUT)")
    p.add_argument("--parts", action="store_true", help="the fast engine's cold CPU time by part, medians in ms")
    p.add_argument("--engine", choices=list(ENGINES), default="compiled", help="the fast engine of --parts")
    p.add_argument("--command", action="store_true",
                   help="what pipeweave simulate pays: validate() then simulate, against sim.validation.check")
    args = p.parse_args(argv)
    names = args.names or list(SCHEDULES)
    print(f"# python {platform.python_version()} on {platform.machine()}, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    if args.parts:
        print(f"CPU milliseconds of the fast engine ({args.engine}), cold, by part (medians of the rounds)")
        _engine(args.engine, lambda: _run(_make("1f1b", 2, 2), fast=True, layout=False))  # loaded before timing
        skip = {"__init__", "run", "times"} if args.engine == "compiled" else {"walk_times"}  # the other engine's
        keys = [function for _, _, function in PARTS if function not in skip] + ["total"]
        print("| schedule | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for name in names:
            spent = parts(name, args.stages, args.microbatches, args.rounds, args.engine)
            print(f"| {name} | " + " | ".join(f"{statistics.median(spent.get(k, [0.0])) * 1e3:.1f}" for k in keys)
                  + " |", flush=True)
        return 0
    if args.command:
        print("CPU seconds of validation + simulate + compute_metrics (cold), medians and every round")
        print("| schedule | D | T | validate() | over arrays | speed-up | same metrics | rounds, validate() | "
              "rounds, over arrays |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name in names:
            print(command_row(compare_command(name, args.stages, args.microbatches, args.rounds), args.stages,
                              args.microbatches), flush=True)
        return 0
    wall, cpu = load_seconds()
    print(f"Loading the compiled walk in a fresh process (numba's import, the kernel from its cache): {wall:.3f} s "
          f"wall, {cpu:.3f} s CPU")
    _engine("compiled", lambda: _run(_make("1f1b", 2, 2), fast=True, layout=False))  # this process: loaded before
    print("CPU seconds of simulate + compute_metrics, medians of the rounds (every round below the table)")
    print("| schedule | D | T | actions | generate | reference | rounds (cold) | rounds (warm) | compiled (cold) "
          "| compiled (warm) | speed-up (cold) | same metrics | bubble |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    sizes = [] if args.big_only else [(n, args.stages, args.microbatches, args.rounds) for n in names]
    if not args.no_big:
        sizes.append(("1f1b", 1024, 4096, args.big_rounds))
    for name, d, t, rounds in sizes:
        r = compare(name, d, t, rounds, args.layout)
        results.append(r)
        print(row(r, d, t), flush=True)
    print()
    for r in results:
        print(rounds_line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
