"""What a run of variable shapes pays for its per-message metadata, and that a run of fixed shapes pays nothing.

With ``TrainConfig.min_seq_len`` every message carries its own shape (one
small metadata message before it, ``transport.p2p``); a run of fixed shapes
keeps the one-time handshake. This script trains the default gpt (zb-h1,
D = 2, T = 4, batch 16) in rounds that alternate:

- ``fixed``: shapes fixed, the fast path (what every run without ``--min-seq-len`` does);
- ``meta``: ``min_seq_len = seq_len``: the same sequences, so the same compute, but every message
  preceded by its metadata -- the price of the variable path alone;
- ``varying`` (with ``--varying``): ``min_seq_len = seq_len / 4``: lengths drawn per microbatch.

Per variant and round: the median wall time per step (steps after the first, as the report counts them)
and the process CPU time per step summed over the ranks. Run it with ``PYTHONPATH`` pointing at two
checkouts to compare their ``fixed`` paths (``--variants fixed``).

Usage: ``python benchmarks/runtime/variable_shapes.py [--rounds 5] [--steps 20] [--transport auto|gloo|shm]
[--variants fixed meta varying] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from pipeweave.models import ModelSpec
from pipeweave.runtime.report.trace import measured_steps, step_times
from pipeweave.config import TrainConfig
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare

GPT = ModelSpec(kind="gpt", layers=4, hidden=128, heads=4, seq_len=64)
LENGTHS = {"fixed": None, "meta": GPT.seq_len, "varying": GPT.seq_len // 4}


def _run(variant: str, steps: int, transport: str) -> dict[str, float]:
    fields: dict[str, Any] = dict(schedule="zb-h1", num_stages=2, num_microbatches=4, model=GPT, batch_size=16,
                                  steps=steps, optimizer="adamw", lr=3e-3)
    if LENGTHS[variant] is not None:
        fields["min_seq_len"] = LENGTHS[variant]
    plan = prepare(TrainConfig(**fields))
    record = launch(run_rank, plan, plan.num_processes, LaunchOptions(transport=transport))
    counted = measured_steps(steps)
    times = step_times(record)
    cpu = [sum(r.step_cpu_s[k] for r in record.ranks) for k in counted]
    return {"step_ms": statistics.median(times[k] for k in counted) * 1e3, "cpu_ms": statistics.median(cpu) * 1e3,
            "last_loss": record.losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--transport", default="auto", choices=("auto", "gloo", "shm"))
    parser.add_argument("--variants", nargs="+", default=["fixed", "meta"], choices=tuple(LENGTHS))
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    rows = []
    for r in range(args.rounds):
        for variant in args.variants:
            row = {"round": r, "variant": variant, **_run(variant, args.steps, args.transport)}
            print(f"round {r} {variant:8s} step {row['step_ms']:8.2f} ms  cpu {row['cpu_ms']:8.2f} ms/step  "
                  f"loss {row['last_loss']:.4f}", flush=True)
            rows.append(row)
    for variant in args.variants:
        mine = [x for x in rows if x["variant"] == variant]
        print(f"median {variant:8s} step {statistics.median(x['step_ms'] for x in mine):8.2f} ms  "
              f"cpu {statistics.median(x['cpu_ms'] for x in mine):8.2f} ms/step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
