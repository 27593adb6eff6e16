"""F&B overlap: DualPipe with and without its F&B pairs, every message delayed, measured and simulated.

Each round trains the same tiny mlp with ``dualpipe`` twice on CPU gloo ranks,
with ``--comm-delay-ms`` (every message between ranks completes that much
after its transfer, beside the rank's compute): once with the F&B pairs
overlapped (the default) and once one after the other (``--no-overlap-fb``).
A step's time is its makespan (first action's start to last action's end over
every rank); a run's is the median over its steps after the first. The
simulator's prediction for each run is the schedule timed under that run's own
measured F, I, W and dispatch times (``profile_costs``) with ``comm`` = the
delay and ``comm_rendezvous`` (a message moves once its receive is posted, as
gloo moves it).

    python benchmarks/moe/overlap.py --stages 2 --microbatches 4 --delay-ms 80 --rounds 3

It prints a Markdown table (benchmarks/moe/README.md, "F&B overlap", holds
the measured one) and, with ``--json FILE``, writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from pipeweave import ModelSpec, TrainConfig, train
from pipeweave.runtime.report.trace import chrome_trace, profile_costs
from pipeweave.runtime.run.prepare import build_schedule
from pipeweave.sim import compute_metrics, simulate


def makespans(record: Any) -> list[float]:
    """Per recorded step, seconds from its first action's start to its last action's end over every rank."""
    steps = min(len(r.records) for r in record.ranks)
    return [
        max(r.records[k][-1][4] for r in record.ranks) - min(r.records[k][0][3] for r in record.ranks)
        for k in range(steps)
    ]


def run(args: argparse.Namespace, overlap: bool, out: str) -> dict[str, Any]:
    """One training run: its median measured step, the simulator's, and its losses."""
    config = TrainConfig(
        schedule="dualpipe",
        num_stages=args.stages,
        num_microbatches=args.microbatches,
        model=ModelSpec(kind="mlp", layers=4 * args.stages, hidden=args.hidden),
        batch_size=4 * args.microbatches,
        steps=args.steps,
        optimizer="sgd",
        lr=0.05,
        transport="gloo",
        comm_delay_ms=args.delay_ms,
        overlap_fb=None if overlap else False,
        quiet=True,
        out=out,
    )
    record = train(config)
    schedule = build_schedule(config)
    measured = makespans(record)[1:]
    cost = dataclasses.replace(profile_costs(schedule, record, comm=args.delay_ms / 1000), comm_rendezvous=True)
    predicted = compute_metrics(simulate(schedule, cost)).makespan
    trace = chrome_trace(schedule, record)
    exposed = [e["args"]["exposed_us"] / 1000 for e in trace["traceEvents"] if e.get("cat") == "F&B"]
    return {
        "overlap": overlap,
        "steps_ms": [1000 * m for m in measured],
        "median_ms": 1000 * statistics.median(measured),
        "predicted_ms": 1000 * predicted,
        "pairs_per_rank": len(schedule.pairs) / schedule.num_ranks if overlap else 0,
        "losses": record.losses,
        "pair_exposed_ms": statistics.median(exposed) if exposed else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--delay-ms", type=float, default=80.0)
    p.add_argument("--steps", type=int, default=6, help="steps per run (the first is not counted)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):
            serial, paired = run(args, False, out), run(args, True, out)
            assert serial["losses"] == paired["losses"], "F&B changed the losses"
            rounds.append({"serial": serial, "overlapped": paired})
    pairs = rounds[0]["overlapped"]["pairs_per_rank"]
    print(f"dualpipe D={args.stages} T={args.microbatches}, --comm-delay-ms {args.delay_ms:g}, {pairs:g} pairs/rank")
    print("| round | serial ms (sim) | overlapped ms (sim) | gain ms | gain / (delay x pairs per rank) |")
    print("|---|---|---|---|---|")
    gains = []
    for k, r in enumerate(rounds):
        s, o = r["serial"], r["overlapped"]
        gain = s["median_ms"] - o["median_ms"]
        gains.append(gain)
        print(
            f"| {k + 1} | {s['median_ms']:.1f} ({s['predicted_ms']:.1f}) | {o['median_ms']:.1f} ({o['predicted_ms']:.1f})"
            f" | {gain:.1f} | {gain / (args.delay_ms * pairs):.2f} |"
        )
    median = statistics.median(gains)
    print(f"median gain {median:.1f} ms = {median / (args.delay_ms * pairs):.2f} x delay x pairs per rank")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        about = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit,
            "host": f"{platform.machine()} {platform.processor() or platform.platform()}, {os.cpu_count()} cores",
            "python": sys.version.split()[0],
            "args": vars(args),
        }
        with open(args.json, "w") as f:
            json.dump({"about": about, "rounds": rounds, "median_gain_ms": median}, f, indent=1)


if __name__ == "__main__":
    main()
