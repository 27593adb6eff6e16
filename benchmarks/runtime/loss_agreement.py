"""What agreeing on every step's loss costs (``runtime.nonfinite.LossAgreement``, ``--on-nonfinite``).

Every synchronous step of a run posts one asynchronous all-reduce of one
float64 and waits for it at its first ``U`` (``skip``) or at its end
(``stop``, the default). In one process group of 2 ranks (one thread each)
this script measures, in rounds that alternate the three ways so that all
meet the same load:

- ``none``: the executor without the agreement (what a run did before it);
- ``stop`` and ``skip``: with it, waited at the step's end and at the first ``U``;

per way the median over rounds of the wall time per step (a barrier before
and after each block of steps, nothing between the steps, as in a run) and
the process CPU time per step summed over the ranks, and per way with the
agreement the median and largest time a rank spent waiting in
``LossAgreement.total``. Beside them, the round trip of one blocking
all-reduce of one float64 (what the wait would cost if it did not overlap).

Usage: ``python benchmarks/runtime/loss_agreement.py [--schedule zb-h1] [--model bench|tiny] [--steps 30]
[--rounds 5] [--json FILE]``; ``bench`` is the runtime benchmark's mlp (h = 256, 8 blocks, batch 256, T = 8).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.runtime.context import RankContext
from pipeweave.data import data_source
from pipeweave.models import ModelSpec
from pipeweave.runtime.executor import Executor
from pipeweave.runtime.nonfinite import LossAgreement
from pipeweave.runtime.process import device_for
from pipeweave.config import TrainConfig
from pipeweave.runtime.run.milestones import rank_microbatches
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.run.workers import build_workers
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.schedule import lower

MODELS = {"bench": (ModelSpec(kind="mlp", layers=8, hidden=256), 256, 8),
          "tiny": (ModelSpec(kind="mlp", layers=4, hidden=32), 16, 8)}
WAYS = (None, "stop", "skip")


class _Timed(LossAgreement):
    """The agreement, timing each wait."""

    waits: list[float] = []

    def total(self) -> float:
        start = time.perf_counter()
        value = super().total()
        _Timed.waits.append(time.perf_counter() - start)
        return value


def _round_trip(repeats: int) -> list[float]:
    share = torch.zeros(1, dtype=torch.float64)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(share, async_op=True).wait()
        times.append(time.perf_counter() - start)
    return times


def bench(context: RankContext, payload: dict[str, Any]) -> dict[str, Any] | None:
    rank, world = context.process, context.world
    spec, batch, t = MODELS[payload["model"]]
    config = TrainConfig(schedule=payload["schedule"], num_stages=world, num_microbatches=t, model=spec,
                         batch_size=batch, steps=10, optimizer="sgd", lr=1e-3, momentum=0.0)
    plan, device = prepare(config), device_for(rank)
    workers = build_workers(plan, rank, device)
    executors = {way: Executor(lower(plan.schedule), rank, workers, plan.microbatch_sizes, device, on_nonfinite=way)
                 for way in WAYS}
    for way in ("stop", "skip"):
        executors[way].agreement.__class__ = _Timed
    source = data_source(spec, batch_size=batch)
    data = rank_microbatches(source, 0, t, device, workers)
    found: dict[str, Any] = {str(way): {"wall_s": [], "cpu_s": [], "waits_s": []} for way in WAYS}
    for _ in range(payload["rounds"]):
        for way in WAYS:
            executors[way].run_step(*data)  # warm-up
            _Timed.waits = []
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(payload["steps"]):
                executors[way].run_step(*data)
            dist.barrier()
            found[str(way)]["wall_s"].append((time.perf_counter() - wall) / payload["steps"])
            found[str(way)]["cpu_s"].append((time.process_time() - cpu) / payload["steps"])
            found[str(way)]["waits_s"] += _Timed.waits
    found["round_trip_s"] = _round_trip(1000)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(found, gathered, dst=0)
    return _summary(gathered) if gathered is not None else None


def _summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for way in map(str, WAYS):
        walls = [max(r[way]["wall_s"][k] for r in ranks) for k in range(len(ranks[0][way]["wall_s"]))]
        cpus = [sum(r[way]["cpu_s"][k] for r in ranks) for k in range(len(ranks[0][way]["cpu_s"]))]
        out[way] = {"wall_ms": statistics.median(walls) * 1e3, "wall_ms_rounds": [w * 1e3 for w in walls],
                    "cpu_ms": statistics.median(cpus) * 1e3,
                    "wait_us_median_max": [[statistics.median(r[way]["waits_s"]) * 1e6, max(r[way]["waits_s"]) * 1e6]
                                           for r in ranks] if way != "None" else None}
    trips = ranks[0]["round_trip_s"]
    out["round_trip_us_median_min"] = [statistics.median(trips) * 1e6, min(trips) * 1e6]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="zb-h1")
    parser.add_argument("--model", choices=sorted(MODELS), default="bench")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    start = os.getloadavg()
    payload = {"schedule": args.schedule, "model": args.model, "steps": args.steps, "rounds": args.rounds}
    results = launch(bench, payload, 2, LaunchOptions(timeout_s=300))
    results.update(payload, load_average={"start": start, "end": os.getloadavg()}, torch=torch.__version__,
                   machine=platform.processor() or platform.machine())
    text = json.dumps(results, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
