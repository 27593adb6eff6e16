"""Measured bubble of every asynchronous schedule on 2 gloo ranks, beside the simulated one and the load.

Each schedule runs as ``pipeweave train`` would (``run_rank`` through the
launcher, one thread per rank): the residual mlp, h = 256, 8 blocks, batch 256,
T = 8, momentum SGD, one stream of ``--steps`` mini-batches. Reported: the
steady-state bubble (``sim.steady`` on the measured stream), the whole
stream's, the simulator's with costs profiled in the same run, the time per
mini-batch, and the 1-minute load average before and after (this machine is
shared: a rank descheduled by another job shows up as bubble).

    python benchmarks/convergence/bubble_2ranks.py [--steps 32] [--transport auto] [--json bubble_2ranks.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from pipeweave.models import ModelSpec
from pipeweave.config import TrainConfig
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.report.stream_summary import summarize_stream
from pipeweave.schedule import SCHEDULES
from pipeweave.runtime.run.prepare import build_schedule, prepare

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32, help="mini-batches per stream (default 32)")
    parser.add_argument("--json", default=str(HERE / "bubble_2ranks.json"))
    parser.add_argument("--hidden", type=int, default=256, help="width h of the mlp (default 256, issue 3's model)")
    parser.add_argument("--transport", choices=("auto", "gloo", "shm"), default="auto",
                        help="as `pipeweave train --transport` (default auto, train's default)")
    args = parser.parse_args()
    rows = []
    for name, info in SCHEDULES.items():
        if info.synchronous:
            continue
        config = TrainConfig(schedule=name, num_stages=2, num_microbatches=8, batch_size=256, steps=args.steps,
                             model=ModelSpec(kind="mlp", layers=8, hidden=args.hidden), optimizer="sgd", lr=0.01, momentum=0.9)
        prepare(config).schedule
        before = os.getloadavg()[0]
        record = launch(run_rank, prepare(config), build_schedule(config).num_ranks, LaunchOptions(threads=1, transport=args.transport))
        report = summarize_stream(build_schedule(config), record)
        row = {"schedule": name, "transport": record.transport, "load_before": before,
               "load_after": os.getloadavg()[0],
               **{k: report[k] for k in ("bubble_ratio", "bubble_ratio_stream", "bubble_ratio_simulated",
                                         "step_time_s", "weight_bytes", "weight_bytes_simulated")}}
        rows.append(row)
        print(f"{name:14s} bubble {row['bubble_ratio']:.3f} (stream {row['bubble_ratio_stream']:.3f}, "
              f"simulated {row['bubble_ratio_simulated']:.3f})  {row['step_time_s'] * 1e3:.0f} ms/mini-batch  "
              f"{record.transport}  "
              f"load {before:.1f} -> {row['load_after']:.1f}", flush=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
