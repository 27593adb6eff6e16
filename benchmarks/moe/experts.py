"""Expert parallelism measured: tokens per expert over a run, and the all-to-all's share of a step.

Trains a mixture-of-experts gpt (8 experts, top-2, every block) with
``--expert-parallel 2`` over ``--data-parallel 2`` on 2 pipeline ranks (1F1B,
4 processes, gloo on the CPU) for a few steps, ROUNDS times, each round a
fresh launch. From each run's record (``RankRecord.expert_rows`` and
``all_to_all_s``, counted by the dispatchers: ``runtime.stage.expert_parallel``):

- tokens per expert: per layer, the rows (token copies) each expert received
  over the run, from every rank of its ``ep`` group; their spread (max / mean,
  1 when balanced) per step and over the run;
- the all-to-all's share of a step: per rank and step after the first, the
  seconds inside the experts' all-to-alls (dispatch and combine, forward and
  backward, the counts' exchange excluded) over the step's time (between the
  ends of the rank's last actions of consecutive steps).

Run from the repository root::

    python benchmarks/moe/experts.py --out benchmarks/moe/experts.json

The all-to-all's time is what a rank waits inside it, its peers' lateness
included: on a loaded machine a rank that reaches the exchange first waits
for the others there, as a collective makes it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pipeweave.config import ModelSpec, TrainConfig
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare

MODEL = ModelSpec(kind="gpt", layers=4, hidden=64, heads=4, seq_len=64, moe_experts=8, moe_top_k=2)
FIELDS = dict(
    schedule="1f1b", num_stages=2, num_microbatches=4, batch_size=32, steps=8, data_parallel=2, expert_parallel=2
)
COMMAND = (  # the same run from the command line (its JSON record holds no per-expert rows)
    "pipeweave train -s 1f1b --stages 2 --microbatches 4 --batch 32 --steps 8 --model gpt --layers 4 --hidden 64 "
    "--heads 4 --seq-len 64 --moe-experts 8 --moe-top-k 2 --data-parallel 2 --expert-parallel 2"
)


def one_round() -> dict[str, Any]:
    """One run's tokens per expert and all-to-all shares."""
    config = TrainConfig(model=MODEL, **FIELDS)
    record = launch(run_rank, prepare(config), 4, LaunchOptions(timeout_s=600))
    tokens: dict[str, dict[int, int]] = {}
    steps = len(record.ranks[0].expert_rows)
    by_step: dict[str, dict[int, list[int]]] = {}  # per layer and expert, its rows in each step
    per_step: list[float] = []  # per step and layer, the spread max / mean of its experts' rows
    shares: list[float] = []
    for r in record.ranks:
        for step in r.expert_rows:
            for layer, rows in step.items():
                for expert, n in rows.items():
                    tokens.setdefault(layer, {}).setdefault(expert, 0)
                    tokens[layer][expert] += n
                    by_step.setdefault(layer, {}).setdefault(expert, []).append(n)
        ends = r.step_ends
        shares += [a2a / (ends[k] - ends[k - 1]) for k, a2a in enumerate(r.all_to_all_s) if k > 0]
    for k in range(steps):
        for layer in tokens:
            rows = [n for r in record.ranks if layer in r.expert_rows[k] for n in r.expert_rows[k][layer].values()]
            per_step.append(max(rows) / statistics.mean(rows))
    spread = {layer: max(rows.values()) / statistics.mean(rows.values()) for layer, rows in tokens.items()}
    return {
        "tokens_per_expert": {layer: dict(sorted(rows.items())) for layer, rows in sorted(tokens.items())},
        "tokens_per_expert_per_step": {
            layer: {e: rows[e] for e in sorted(rows)} for layer, rows in sorted(by_step.items())
        },
        "spread_run": spread,
        "spread_step_median": statistics.median(per_step),
        "spread_step_max": max(per_step),
        "all_to_all_share_median": statistics.median(shares),
        "all_to_all_share_max": max(shares),
        "step_s_median": statistics.median(
            e - b for r in record.ranks for b, e in zip(r.step_ends[:-1], r.step_ends[1:])
        ),
        "loss": record.losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU (gloo)",
        "torch": torch.__version__,
        "command": " ".join(["python", "benchmarks/moe/experts.py", *sys.argv[1:]]),
        "train_command": COMMAND,
        "load_start": os.getloadavg()[0],
        "rounds": [one_round() for _ in range(args.rounds)],
    }
    out["load_end"] = os.getloadavg()[0]
    rounds = out["rounds"]
    out["median"] = {
        key: statistics.median(r[key] for r in rounds)
        for key in ("all_to_all_share_median", "all_to_all_share_max", "spread_step_median", "step_s_median")
    }
    sys.stdout.write(json.dumps(out, indent=1) + "\n")
    if args.out:  # the same JSON, kept beside the README
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
