"""Offload's step-time cost at 2 stages, one rank per core: measured beside the simulator's prediction.

The gpt of ``levers.py`` under 1F1B on 2 gloo ranks (this machine has 2 cores, so no rank computes in
another's bubble), exact and with ``--offload 0``, the two alternating within each round. Per round: each
run's median step (``makespan_s``), their difference (the measured cost), and the prediction: the exact
run's schedule simulated with the per-part times it profiled from itself, with and without part 0's
``OFFLOAD``/``RELOAD``, the copies on the rank's own time (``sim.levers``: the CPU runtime copies to the
file and back on its compute thread) at the rate of the runtime's copy path measured here on part 0's
microbatch (``levers._copy_rate``). Run from the repository root::

    python benchmarks/memory/offload_cost.py --rounds 5 --out benchmarks/memory/offload_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from levers import BATCH, HEADS, HIDDEN, LAYERS, SEQ, T, _copy_rate, _predicted_cost  # noqa: E402

STAGES = 2
CONFIGS = {"exact": None, "offload part 0": "0"}


def _run(offload: str | None, steps: int) -> dict[str, Any]:
    """One training run in this process's launcher: its summary (as ``train --json``) and its CPU times."""
    from pipeweave.models.spec import ModelSpec
    from pipeweave.runtime.report.trace import measured_steps, step_times, summarize
    from pipeweave.config import TrainConfig
    from pipeweave.runtime.run.job import run_rank
    from pipeweave.runtime.run.launch import LaunchOptions, launch
    from pipeweave.runtime.run.prepare import prepare

    spec = ModelSpec(kind="gpt", layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq_len=SEQ)
    plan = prepare(TrainConfig(schedule="1f1b", num_stages=STAGES, num_microbatches=T, model=spec, batch_size=BATCH,
                               steps=steps, optimizer="sgd", lr=0.1, momentum=0.0, offload=offload,
                               trace_steps=steps))
    record = launch(run_rank, plan, plan.num_processes, LaunchOptions(transport="auto"))
    summary = summarize(plan.schedule, record)
    counted = measured_steps(steps)
    times = step_times(record)
    by_op: dict[str, list[float]] = {}  # rank 0's thread CPU per step, per op
    for k in counted:
        step: dict[str, float] = {}
        for (_, op, _, _, _), cpu in zip(record.ranks[0].records[k], record.ranks[0].action_cpu_s[k]):
            step[op] = step.get(op, 0.0) + cpu
        for op, cpu in step.items():
            by_op.setdefault(op, []).append(cpu)
    return {"makespan_s": summary["makespan_s"], "profiled_costs_s": summary["profiled_costs_s"],
            "peak_activation_bytes": summary["peak_activation_bytes"],
            "step_times_s": [times[k] for k in counted], "step_min_s": min(times[k] for k in counted),
            "rank_cpu_s": [statistics.median(r.step_cpu_s[k] for k in counted) for r in record.ranks],
            "rank0_op_cpu_s": {op: statistics.median(v) for op, v in by_op.items()}}


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "stages": STAGES, "runs": {name: [] for name in CONFIGS}}
    for r in range(args.rounds):
        names = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))  # alternate which runs first
        for name in names:
            row = _run(CONFIGS[name], args.steps)
            row["load"] = _load()
            results["runs"][name].append(row)
            print(name, r, f"step {row['makespan_s']:.4f} s (min {row['step_min_s']:.4f}), rank CPU",
                  [round(c, 4) for c in row["rank_cpu_s"]], "load", row["load"], flush=True)
    # The copies' CPU time: what they take from a rank that has its core to itself (wall time on this shared
    # machine counts other processes on the machine too).
    results["copy_wall"] = _copy_rate(stages=STAGES)
    results["copy"] = rate = _copy_rate(stages=STAGES, clock=time.thread_time)
    exact, moved = results["runs"]["exact"], results["runs"]["offload part 0"]
    results["offload_cost"] = [
        {"measured_s": m["makespan_s"] - e["makespan_s"], "measured_min_s": m["step_min_s"] - e["step_min_s"],
         "rank0_cpu_s": m["rank_cpu_s"][0] - e["rank_cpu_s"][0],
         "predicted_s": _predicted_cost(e, rate, stages=STAGES)} for e, m in zip(exact, moved)]
    results["median"] = {key: statistics.median(c[key] for c in results["offload_cost"])
                         for key in ("measured_s", "measured_min_s", "rank0_cpu_s", "predicted_s")}
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
