"""Benchmark: profile-guided partitioning of a deliberately unbalanced gpt (a large vocabulary head).

For ``uniform``, ``time`` and ``memory`` it prints the partition, the step time
the simulator predicts from the per-layer profile, and the step time and
per-rank memory measured by a real ``pipeweave train`` run (its default
transport, CPU, one thread per rank). Run from the repository root:

    python benchmarks/partition/run.py [--steps 12] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pipeweave.models import ModelSpec
from pipeweave.partition import LayerCosts, MemoryProfile, PartitionContext, partition
from pipeweave.config import TrainConfig
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.profile import profile_model
from pipeweave.runtime.report.trace import summarize
from pipeweave.schedule import generate
from pipeweave.sim import CostModel, compute_metrics, simulate
from pipeweave.runtime.run.prepare import prepare


def predicted(costs: LayerCosts, counts: tuple[int, ...], schedule_name: str, stages: int, microbatches: int) -> float:
    """The simulator's step time (makespan) with the parts' profiled F, I and W."""
    bounds = partition("explicit", costs, len(counts), PartitionContext(counts=counts)).bounds
    cost = CostModel(
        f=[costs.total("forward", a, b) for a, b in bounds],
        b=[costs.total("input_grad", a, b) for a, b in bounds],
        w=[costs.total("weight_grad", a, b) for a, b in bounds],
    )
    schedule = generate(schedule_name, num_stages=stages, num_microbatches=microbatches)
    return compute_metrics(simulate(schedule, cost)).makespan


def measure(spec: ModelSpec, counts: tuple[int, ...], args: argparse.Namespace) -> dict[str, object]:
    config = TrainConfig(
        schedule=args.schedule, num_stages=args.stages, num_microbatches=args.microbatches, model=spec,
        batch_size=args.batch, steps=args.steps, optimizer="sgd", lr=0.01, momentum=0.0, layers_per_part=counts, data=args.data,
    )
    schedule = prepare(config).schedule
    record = launch(run_rank, prepare(config), schedule.num_ranks, LaunchOptions(threads=1, timeout_s=120, transport="auto"))
    summary = summarize(schedule, record)
    return {k: summary[k] for k in ("step_time_s", "peak_activation_bytes", "weight_bytes", "bubble_ratio")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each method, alternating (default 3)")
    parser.add_argument("--data", default="README.md", help="text to train on (a small file keeps start-up short)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each rank runs
    spec = ModelSpec(kind="gpt", layers=args.layers, hidden=args.hidden, heads=4, seq_len=args.seq_len,
                     vocab=args.vocab)
    costs = profile_model(spec, args.batch // args.microbatches, repeats=7, refresh=True)
    schedule = generate(args.schedule, num_stages=args.stages, num_microbatches=args.microbatches)
    profile = MemoryProfile.of_schedule(schedule, state=1.0)
    plans: dict[str, tuple[int, ...]] = {}
    for method in ("uniform", "time"):
        plans[method] = partition(method, costs, args.stages).counts
    # a limit between what memory's optimum needs and what time's split needs
    def peak(counts: tuple[int, ...]) -> float:
        bounds = partition("explicit", costs, len(counts), PartitionContext(counts=counts)).bounds
        return max(profile.memory_of(costs, k, a, b) for k, (a, b) in enumerate(bounds))

    least = min(peak(c) for c in _splits(costs.num_layers, args.stages))
    limit = (least + peak(plans["time"])) / 2
    plans["memory"] = partition("memory", costs, args.stages, PartitionContext(memory_limit=limit, profile=profile)).counts
    rows = {}
    runs: dict[str, list[dict[str, object]]] = {m: [] for m in plans}
    for _ in range(args.rounds):  # alternate the methods so that a busy spell hits them alike
        for method, counts in plans.items():
            runs[method].append(measure(spec, counts, args))
    for method, counts in plans.items():
        # the least step time of the rounds: the machine is shared, contention only adds time
        measured = min(runs[method], key=lambda r: r["step_time_s"])  # type: ignore[arg-type,return-value]
        measured["step_times_of_rounds_s"] = [r["step_time_s"] for r in runs[method]]
        rows[method] = {"layers_per_part": counts, "predicted_step_s": predicted(costs, counts, args.schedule,
                        args.stages, args.microbatches), "predicted_peak_memory": peak(counts), **measured}
        print(method, json.dumps(rows[method]), flush=True)
    result = {"model": vars(args), "memory_limit": limit, "layer_costs": costs.to_json(), "runs": rows}
    u, t = rows["uniform"], rows["time"]
    speedup_pred = u["predicted_step_s"] / t["predicted_step_s"]
    speedup_meas = u["step_time_s"] / t["step_time_s"]
    print(f"time vs uniform: predicted speed-up {speedup_pred:.3f}, measured {speedup_meas:.3f} "
          f"({(speedup_meas / speedup_pred - 1) * 100:+.1f} %)")
    print(f"memory limit {limit:.0f} B: time needs {t['predicted_peak_memory']:.0f} B, "
          f"memory's split {rows['memory']['predicted_peak_memory']:.0f} B")
    result["speedup"] = {"predicted": speedup_pred, "measured": speedup_meas}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _splits(n: int, k: int) -> list[tuple[int, ...]]:
    import itertools

    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        out.append(tuple(b - a for a, b in zip(edges, edges[1:])))
    return out


if __name__ == "__main__":
    sys.exit(main())
