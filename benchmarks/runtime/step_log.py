"""What ``--log-dir`` costs the step of the process that writes it (``runtime.run.step_log.StepLog``).

In one process (a gloo group of one), ``StepLog.after_step`` is called ``--calls``
times with a step's worth of action records, as the writing rank calls it after
every step: its row of figures, the post of the step's all-reduce, the wait for
the previous one, and the hand-over of the previous step's scalars to the
writer thread (which builds the protobufs and writes the event file beside the
step). Prints the median and the 90th percentile per call.

Usage: ``python benchmarks/runtime/step_log.py [--calls 2000]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from pipeweave.runtime.context import RankContext
from pipeweave.models import ModelSpec
from pipeweave.config import TrainConfig
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.run.step_log import StepLog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        plan = prepare(TrainConfig(schedule="1f1b", num_stages=1, num_microbatches=4, batch_size=8, steps=10,
                                   model=ModelSpec(kind="mlp", layers=2, hidden=8), optimizer="sgd", lr=0.1,
                                   momentum=0.0, log_dir=folder))
        actions = [("F", j) for j in range(4)] + [("B", j) for j in range(4)] + [("U", 0)]
        records = [(0, op, j, 1e-3 * i, 1e-3 * i + 8e-4) for i, (op, j) in enumerate(actions)]
        log = StepLog(plan, RankContext(), None)
        took = []
        for step in range(args.calls):
            start = time.perf_counter()
            log.after_step(step, 1.0, records)
            took.append(time.perf_counter() - start)
        log.close()
    dist.destroy_process_group()
    took.sort()
    print(f"after_step: median {statistics.median(took) * 1e6:.0f} us, "
          f"p90 {took[int(0.9 * len(took))] * 1e6:.0f} us over {args.calls} calls")


if __name__ == "__main__":
    main()
