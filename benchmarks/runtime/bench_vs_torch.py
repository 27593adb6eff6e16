"""pipeweave's runtime against torch.distributed.pipelining, side by side in one run.

The model of the issue: the residual mlp (8 blocks of LayerNorm -> Linear(h,4h)
-> GELU -> Linear(4h,h)), h = 256, batch 256 in T = 8 microbatches, MSE, SGD,
2 ranks on gloo, one thread per rank. In one process group, in turn:

1. the single-rank baseline: the whole model on rank 0, 8-microbatch gradient
   accumulation (rank 1 waits), which gives the ideal 2-rank 1F1B step time
   t_1 / D x (T + D - 1) / T;
2. pipeweave's schedules (``run_rank``, the code ``pipeweave train`` runs),
   with measured and simulated bubble ratios;
3. torch.distributed.pipelining's Schedule1F1B, ScheduleGPipe,
   ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble on the same
   architecture (standard nn modules).

Step times are the median over ``--steps`` steps after ``--warmup`` steps.
Usage: ``python benchmarks/runtime/bench_vs_torch.py [--steps 20] [--ranks 2] [--transport shm] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeweave.runtime.context import RankContext
from pipeweave.models import ModelSpec
from pipeweave.config import TrainConfig
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.report.trace import summarize
from pipeweave.runtime.run.prepare import build_schedule, prepare

HIDDEN, LAYERS, BATCH, T = 256, 8, 256, 8
OURS = (("1f1b", None), ("zb-h1", None), ("gpipe", None), ("zb-h2", None), ("interleaved-1f1b", 2), ("zb-v", None))
THEIRS = ("Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")


class TorchBlock(nn.Module):
    """The same residual block, from standard modules (what a torch user would write)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def single_rank_time(steps: int, warmup: int, repeats: int = 3) -> tuple[float, float]:
    """Wall and CPU seconds per step of plain training with T-microbatch accumulation on one rank.

    ``run_plain`` builds the model in each call, so a call of ``warmup`` steps
    is timed beside one of ``warmup + steps``: their difference over
    ``steps`` is the steady step, without the build and the first steps. The
    median of ``repeats`` such pairs.
    """
    spec = ModelSpec(kind="mlp", layers=LAYERS, hidden=HIDDEN)

    def timed(n: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        run_plain(spec, steps=n, batch_size=BATCH, num_microbatches=T)
        return time.perf_counter() - t0, time.process_time() - c0

    wall, cpu = [], []
    for _ in range(repeats):
        (short_wall, short_cpu), (long_wall, long_cpu) = timed(warmup), timed(warmup + steps)
        wall.append((long_wall - short_wall) / steps)
        cpu.append((long_cpu - short_cpu) / steps)
    return statistics.median(wall), statistics.median(cpu)


def ours(context: RankContext, name: str, chunks: int | None, steps: int, warmup: int) -> dict[str, Any] | None:
    world = context.world
    config = TrainConfig(schedule=name, num_stages=world, num_microbatches=T, num_chunks=chunks,
                         model=ModelSpec(kind="mlp", layers=LAYERS, hidden=HIDDEN), batch_size=BATCH,
                         steps=steps + warmup, optimizer="sgd", lr=0.01, momentum=0.0,
                         trace_steps=steps + warmup)  # every step's actions
    record = run_rank(context, prepare(config))
    if record is None:
        return None
    schedule = build_schedule(config)
    report = summarize(schedule, record)
    times = report["step_times_s"][warmup:]
    cpu = [statistics.median(r.step_cpu_s[warmup:]) for r in record.ranks]
    compute_cpu = [statistics.median(sum(c for (_, op, *_), c in zip(rec, acts) if op in "FBIWU")
                                     for rec, acts in zip(r.records[warmup:], r.action_cpu_s[warmup:]))
                   for r in record.ranks]
    return {"step_time_s": statistics.median(times), "step_times_s": times, "cpu_s_per_rank": cpu,
            "compute_cpu_s_per_rank": compute_cpu, "bubble_ratio": report["bubble_ratio"],
            "bubble_ratio_simulated": report["bubble_ratio_simulated"],
            "bubble_ratio_simulated_no_dispatch": report["bubble_ratio_simulated_no_dispatch"],
            "bubble_ratio_flush": report["bubble_ratio_flush"],
            "makespan_simulated_s": report["makespan_simulated_s"], "costs": report["profiled_costs_s"],
            "losses": [record.losses[0], record.losses[-1]], "transport": record.transport}


def theirs(context: RankContext, name: str, steps: int, warmup: int) -> dict[str, Any]:
    """Median wall and per-rank CPU step time of a torch.distributed.pipelining schedule (optimizer step included)."""
    rank, world = context.process, context.world
    from torch.distributed import pipelining

    interleaved = "Interleaved" in name
    num_stages = 2 * world if interleaved else world
    per_stage = LAYERS // num_stages
    torch.manual_seed(0)
    blocks = [TorchBlock(HIDDEN) for _ in range(LAYERS)]
    mine = [k for k in range(num_stages) if k % world == rank]
    stages = [
        pipelining.PipelineStage(nn.Sequential(*blocks[k * per_stage:(k + 1) * per_stage]), k, num_stages,
                                 torch.device("cpu"))
        for k in mine
    ]
    cls = getattr(pipelining, name)
    schedule = cls(stages if interleaved else stages[0], n_microbatches=T, loss_fn=nn.functional.mse_loss)
    params = [p for s in stages for p in s.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, HIDDEN, generator=generator), torch.randn(BATCH, HIDDEN, generator=generator)
    first, last = 0 in mine, num_stages - 1 in mine
    times, cpu = [], []
    dist.barrier()
    for _ in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        args = (x,) if first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": []} if last else {}
        schedule.step(*args, **kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, statistics.median(cpu[warmup:]))
    return {"step_time_s": statistics.median(times[warmup:]), "step_times_s": times[warmup:],
            "cpu_s_per_rank": per_rank}


def bench(context: RankContext, options: dict[str, Any]) -> dict[str, Any] | None:
    rank, world = context.process, context.world
    steps, warmup = options["steps"], options["warmup"]
    results: dict[str, Any] = {"ours": {}, "theirs": {}}
    dist.barrier()
    results["load_average"] = {"start": os.getloadavg()}
    results["single_rank_s_rounds"], results["single_rank_cpu_s_rounds"] = [], []
    results["contended_single_rank_s_rounds"] = []
    # Rounds alternate the baseline, ours and theirs, so all meet the same load on a shared
    # machine (this VM's single-rank step moved between 110 and 134 ms across runs).
    for _ in range(options["rounds"]):
        if rank == 0:
            wall, cpu = single_rank_time(steps, warmup)
            results["single_rank_s_rounds"].append(wall)
            results["single_rank_cpu_s_rounds"].append(cpu)
        dist.barrier()
        # The same accumulation on every rank at once: what one rank's compute costs while the
        # others compute too (shared caches and memory bandwidth), the floor under any pipeline here.
        wall, _ = single_rank_time(steps, warmup)
        walls: list[Any] = [None] * world
        dist.all_gather_object(walls, wall)
        results["contended_single_rank_s_rounds"].append(statistics.median(walls))
        for name, chunks in OURS:
            if name in options["only"]:
                results["ours"].setdefault(name, []).append(ours(context, name, chunks, steps, warmup))
        for name in THEIRS:
            if name in options["only"]:
                results["theirs"].setdefault(name, []).append(theirs(context, name, steps, warmup))
    results["load_average"]["end"] = os.getloadavg()
    return results if rank == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="alternate ours and theirs this many times")
    parser.add_argument("--only", nargs="*", help="schedules to run (default: all)")
    parser.add_argument("--nice", type=int, default=0,
                        help="niceness of the ranks and of their session, e.g. -10 (root only): "
                             "measure as on a quieter machine")
    parser.add_argument("--transport", choices=("auto", "gloo", "shm"), default="auto",
                        help="point-to-point transport of pipeweave's schedules, as `pipeweave train --transport` "
                             "(default auto, train's default); torch's schedules always use gloo")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.nice:
        set_priority(args.nice)
    only = set(args.only or [n for n, _ in OURS] + list(THEIRS))
    payload = {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "only": only}
    results = launch(bench, payload, args.ranks, LaunchOptions(timeout_s=300, transport=args.transport))
    d = args.ranks
    results["single_rank_s"] = statistics.median(results["single_rank_s_rounds"])
    results["single_rank_cpu_s"] = statistics.median(results["single_rank_cpu_s_rounds"])
    results["ideal_1f1b_s_rounds"] = [t / d * (T + d - 1) / T for t in results["single_rank_s_rounds"]]
    results["ideal_1f1b_s"] = results["single_rank_s"] / d * (T + d - 1) / T
    results["ideal_1f1b_contended_s_rounds"] = [t / d * (T + d - 1) / T
                                                for t in results["contended_single_rank_s_rounds"]]
    results["machine"] = {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "torch": torch.__version__, "nice": args.nice,
                          "date": time.strftime("%Y-%m-%d %H:%M"), "ranks": d, "threads_per_rank": 1,
                          "transport": args.transport}
    print_results(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def set_priority(nice: int) -> None:
    """Run this process and the ranks it forks at ``nice``, against every other session too.

    Linux groups processes by session (autogroups) and ``nice`` alone only ranks
    a process within its session, so the benchmark starts its own session and
    sets that group's niceness (root only), then its own (the ranks inherit both).
    """
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError as exc:
        print(f"autogroup niceness not set ({exc}); nice applies within this session only", file=sys.stderr)
    os.nice(nice)


def _med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def print_results(r: dict[str, Any]) -> None:
    ms = 1e3
    d = r["machine"]["ranks"]
    print(f"load average {r['load_average']['start']} -> {r['load_average']['end']}, nice {r['machine']['nice']}, "
          f"pipeweave transport {r['machine'].get('transport', 'gloo')} (used: "
          f"{', '.join(sorted({x.get('transport', '?') for runs in r['ours'].values() for x in runs}))})")
    print(f"single rank, T={T} accumulation: {r['single_rank_s'] * ms:.1f} ms/step wall, "
          f"{r['single_rank_cpu_s'] * ms:.1f} ms CPU;  ideal {d}-rank 1F1B: {r['ideal_1f1b_s'] * ms:.1f} ms")
    print(f"{'schedule (median of rounds)':34} {'wall ms':>8} {'CPU ms/rank':>18} {'bubble':>7} {'sim':>7} "
          f"{'sim, no dispatch':>16}")
    for name, runs in r["ours"].items():
        cpu = "/".join(f"{statistics.median(x['cpu_s_per_rank'][k] for x in runs) * ms:.1f}" for k in range(d))
        print(f"pipeweave {name:24} {_med(runs, 'step_time_s') * ms:8.1f} {cpu:>18} "
              f"{_med(runs, 'bubble_ratio'):7.3f} {_med(runs, 'bubble_ratio_simulated'):7.3f} "
              f"{_med(runs, 'bubble_ratio_simulated_no_dispatch'):16.3f}")
    for name, runs in r["theirs"].items():
        cpu = "/".join(f"{statistics.median(x['cpu_s_per_rank'][k] for x in runs) * ms:.1f}" for k in range(d))
        print(f"torch {name:28} {_med(runs, 'step_time_s') * ms:8.1f} {cpu:>18}")
    if "1f1b" in r["ours"] and "Schedule1F1B" in r["theirs"]:
        ours_runs, their_runs = r["ours"]["1f1b"], r["theirs"]["Schedule1F1B"]
        walls = [o["step_time_s"] / t["step_time_s"] for o, t in zip(ours_runs, their_runs)]
        cpus = [sum(o["cpu_s_per_rank"]) / sum(t["cpu_s_per_rank"]) for o, t in zip(ours_runs, their_runs)]
        print(f"ours 1f1b / torch Schedule1F1B per round: wall {', '.join(f'{x:.3f}' for x in walls)}; "
              f"CPU (both ranks) {', '.join(f'{x:.3f}' for x in cpus)}")
        one = _med(ours_runs, "step_time_s")
        ideal = [o["step_time_s"] / i for o, i in zip(ours_runs, r["ideal_1f1b_s_rounds"])]
        contended = [o["step_time_s"] / i for o, i in zip(ours_runs, r.get("ideal_1f1b_contended_s_rounds", []))]
        if contended:
            print(f"single rank while every rank runs it: "
                  f"{', '.join(f'{x * ms:.1f}' for x in r['contended_single_rank_s_rounds'])} ms; ours 1f1b / "
                  f"that ideal: {', '.join(f'{x:.3f}' for x in contended)}")
        print(f"single rank per round: {', '.join(f'{x * ms:.1f}' for x in r['single_rank_s_rounds'])} ms; "
              f"ours 1f1b / ideal of the same round: {', '.join(f'{x:.3f}' for x in ideal)}")
        print(f"ours 1f1b / ideal (medians): {one / r['ideal_1f1b_s']:.3f};  ours 1f1b CPU (both ranks) / single-rank CPU: "
              f"{statistics.median(sum(o['cpu_s_per_rank']) for o in ours_runs) / r['single_rank_cpu_s']:.3f}")
    if "1f1b" in r["ours"] and "zb-h1" in r["ours"]:
        pairs = [z["step_time_s"] / o["step_time_s"] for o, z in zip(r["ours"]["1f1b"], r["ours"]["zb-h1"])]
        print(f"ours zb-h1 / ours 1f1b per round: {', '.join(f'{x:.3f}' for x in pairs)}")


if __name__ == "__main__":
    sys.exit(main())
