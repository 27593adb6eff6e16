"""What the machine does to a pipeline stage's compute: each stage alone, then all at once, no messages.

The runtime benchmark (``bench_vs_torch.py``) compares a 2-rank pipeline with
the ideal ``t_1 / D x (T + D - 1) / T`` from the whole model trained on one
rank alone. That ideal assumes a stage computes in exactly ``1/D`` of the
whole model's time whether or not the other ranks compute at the same time.
This script measures that assumption on the benchmark's model, without any
runtime in the way: every rank builds its stage (the uniform split of the
8-block mlp) and runs its 1F1B sequence of F, B and U on local tensors, in
three phases per round:

- ``whole``: rank 0 runs the whole model (every block, one microbatch at a
  time, F then B), the others wait: the single-rank baseline's compute;
- ``alone``: each rank in turn runs its stage while the others wait;
- ``together``: every rank runs its stage at once (as in a pipeline).

It prints, per rank, the median F and B per microbatch in each phase, and
``F + B`` summed over the ranks against the whole model's. No messages are
sent in any phase, so any difference between ``alone`` and ``together`` is
the machine (shared caches, memory bandwidth, the host), not pipeweave.

Usage: ``python benchmarks/runtime/stage_contention.py [--steps 30] [--rounds 3] [--json FILE]``.
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
from pipeweave.models import ModelSpec
from pipeweave.models.spec import uniform_parts
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule import generate

HIDDEN, LAYERS, BATCH, T = 256, 8, 256, 8


def _run(worker: StageWorker, ops: list[tuple[str, int]], steps: int, last: bool) -> dict[str, float]:
    """Median seconds of F, B and U over ``steps`` repetitions of ``ops`` (after two warm-up repetitions)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, HIDDEN, generator=generator)
    y = torch.randn(BATCH, HIDDEN, generator=generator)
    grad = torch.randn(BATCH // T, HIDDEN, generator=generator)
    size = BATCH // T
    times: dict[str, list[float]] = {"F": [], "B": [], "U": []}
    clock = time.perf_counter
    for step in range(steps + 2):
        for op, j in ops:
            start = clock()
            if op == "F":
                worker.forward(j, x[size * j:size * (j + 1)].clone(), target=y[size * j:size * (j + 1)] if last else None)
            elif op == "B":
                worker.backward(j, None if last else grad)
            else:
                worker.update()
            if step >= 2:
                times[op].append(clock() - start)
    return {op: statistics.median(v) for op, v in times.items()}


def measure(context: RankContext, options: dict[str, Any]) -> dict[str, Any] | None:
    rank, world = context.process, context.world
    spec = ModelSpec(kind="mlp", layers=LAYERS, hidden=HIDDEN)
    parts = uniform_parts(LAYERS, world)
    row = generate("1f1b", num_stages=world, num_microbatches=T).actions[rank]
    ops = [(a.op.value, a.microbatch) for a in row if a.op.value in ("F", "B", "U")]
    stage = StageWorker(spec, parts[rank], batch_size=BATCH, track_memory=False)
    whole = StageWorker(spec, range(LAYERS), batch_size=BATCH, track_memory=False) if rank == 0 else None
    plain = [(op, j) for j in range(T) for op in ("F", "B")] + [("U", 0)]
    out: dict[str, list[Any]] = {"whole": [], "alone": [], "together": []}
    for _ in range(options["rounds"]):
        dist.barrier()
        if whole is not None:
            out["whole"].append(_run(whole, plain, options["steps"], last=True))
        dist.barrier()
        alone: Any = None
        for turn in range(world):
            if turn == rank:
                alone = _run(stage, ops, options["steps"], last=rank == world - 1)
            dist.barrier()
        out["alone"].append(alone)
        dist.barrier()
        out["together"].append(_run(stage, ops, options["steps"], last=rank == world - 1))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered} if rank == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    start_load = os.getloadavg()
    result = launch(measure, {"steps": args.steps, "rounds": args.rounds}, args.ranks, LaunchOptions(timeout_s=600))
    ranks = result["ranks"]
    ms = 1e3
    print(f"load average {start_load[0]:.2f} -> {os.getloadavg()[0]:.2f}; {args.ranks} ranks, "
          f"{args.rounds} rounds of {args.steps} steps")
    for k in range(args.rounds):
        whole = ranks[0]["whole"][k]
        fb_whole = whole["F"] + whole["B"]
        line = [f"round {k}: whole model alone F+B {fb_whole * ms:.2f} ms per microbatch"]
        for phase in ("alone", "together"):
            per = [r[phase][k]["F"] + r[phase][k]["B"] for r in ranks]
            line.append(f"{phase}: " + " + ".join(f"{p * ms:.2f}" for p in per)
                        + f" = {sum(per) * ms:.2f} ({sum(per) / fb_whole:.3f} of whole)")
        print(";  ".join(line))
    for phase in ("alone", "together"):
        for r, rank in enumerate(ranks):
            med = {op: statistics.median(x[op] for x in rank[phase]) * ms for op in ("F", "B", "U")}
            print(f"rank {r} {phase:8s}: F {med['F']:.2f}  B {med['B']:.2f}  U {med['U']:.2f} ms (medians of rounds)")
    if args.json:
        result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                             "date": time.strftime("%Y-%m-%d %H:%M"), "load_average_start": start_load,
                             "load_average_end": os.getloadavg()}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
