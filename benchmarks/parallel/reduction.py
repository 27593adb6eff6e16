"""The data-parallel gradient reduction: bucketed all-reduce against the former point-to-point exchange.

Each of P processes holds a replica of one pipeline stage of a small gpt
(layers 1-2 of ``--layers 4 --hidden 256 --heads 4``, float32 gradients
filled with random values). Every round times, one after the other on the
same gradients, in alternating order:

- ``collective``: ``runtime.replicas.ReplicaReduction`` -- the part's
  gradients in buckets of ``--bucket-mb``, each all-reduced over the replica
  group (``async_op``), waited and written back, as ``pipeweave train
  --data-parallel P`` does at the part's ``U``;
- ``p2p``: the exchange pipeweave used before, rebuilt here for the
  comparison: the whole flattened fp32 gradient sent to every other replica
  (``isend``, in rank order) and every other replica's received, summed in
  rank order.

Reported per path: the median time of a reduction (every round listed) and
the bytes each rank sends: for the p2p exchange (P - 1) x the gradient, for
the all-reduce what a ring sends, 2 (P - 1) / P x the gradient (gloo's CPU
all-reduce is a ring for these sizes; the figure is the algorithm's, not a
capture). Run from the repository root::

    python benchmarks/parallel/reduction.py --ranks 2 4 --rounds 7 --out benchmarks/parallel/reduction.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.runtime.context import RankContext
from pipeweave.models import ModelSpec
from pipeweave.runtime.replicas import ReplicaReduction, _buckets
from pipeweave.runtime.run.launch import launch
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.transport.mesh import build_mesh
from pipeweave.schedule import generate
from pipeweave.schedule.data_parallel import data_parallel
from pipeweave.schedule.ir import Action, Op

SPEC = ModelSpec(kind="gpt", layers=4, hidden=256, heads=4, seq_len=64)
LAYERS = range(1, 3)


def _fill(worker: StageWorker, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in worker.module.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _p2p(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The former exchange: the whole gradient to every other replica, theirs received, summed in rank order."""
    sends = [dist.isend(flat, dst=peer, tag=7) for peer in range(world) if peer != rank]
    received = {}
    for peer in range(world):
        if peer != rank:
            received[peer] = torch.empty_like(flat)
            dist.irecv(received[peer], src=peer, tag=7).wait()
    for work in sends:
        work.wait()
    total = torch.zeros_like(flat)
    for peer in range(world):
        total += flat if peer == rank else received[peer]
    return total


def _rank(context: RankContext, args: dict[str, Any]) -> dict[str, Any] | None:
    rank, world = context.process, context.world
    schedule = data_parallel(generate("1f1b", num_stages=1, num_microbatches=1), world)
    joined = build_mesh(rank, world, schedule.placement, world, 1, torch.device("cpu"))
    worker = StageWorker(SPEC, LAYERS, batch_size=8)
    workers = {rank: worker}
    row = [Action(rank, Op.B, rank)]
    reduction = ReplicaReduction(schedule.placement, row, workers, joined.replica_groups,
                                 int(args["bucket_mb"] * 2**20))
    numel = sum(p.numel() for p in worker.module.parameters())
    times: dict[str, list[float]] = {"collective": [], "p2p": []}
    for r in range(args["warmup"] + args["rounds"]):
        order = ("collective", "p2p") if r % 2 == 0 else ("p2p", "collective")
        for path in order:
            _fill(worker, seed=1000 * r + rank)
            dist.barrier()
            start = time.perf_counter()
            if path == "collective":
                reduction.begin_step()
                reduction.after(row[0])
                reduction.hooks[rank](worker)
            else:
                _p2p(torch.cat([p.grad.reshape(-1) for p in worker.module.parameters()]), rank, world)
            elapsed = time.perf_counter() - start
            if r >= args["warmup"]:
                times[path].append(elapsed)
    gathered: list[Any] = [None] * world if rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(times, gathered, dst=0)
    if rank != 0:
        return None
    grad_bytes = 4 * numel
    buckets = len(_buckets(list(worker.module.parameters()), int(args["bucket_mb"] * 2**20)))
    out: dict[str, Any] = {"ranks": world, "gradient_bytes": grad_bytes, "buckets": buckets}
    for path in ("collective", "p2p"):
        per_round = [max(g[path][i] for g in gathered) for i in range(args["rounds"])]  # the slowest rank's
        out[path] = {"rounds_ms": [round(1e3 * t, 2) for t in per_round],
                     "median_ms": round(1e3 * statistics.median(per_round), 2)}
    out["collective"]["sent_bytes_per_rank"] = round(2 * (world - 1) / world * grad_bytes)
    out["p2p"]["sent_bytes_per_rank"] = (world - 1) * grad_bytes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(),
               "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               "torch": torch.__version__, "load_start": os.getloadavg()[0], "runs": []}
    for world in args.ranks:
        results["runs"].append(launch(_rank, vars(args), world))
    results["load_end"] = os.getloadavg()[0]
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
