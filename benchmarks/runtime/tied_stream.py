"""What a tie costs on pipedream-2bw (``runtime.stage.tied_stream``): the gpt with and without ``--tie-embeddings``.

The tie adds, at every ``U`` of the first and the last stage, one message of
the tied gradient each way (the token table's size) and a sum. Neither end
should wait longer than a message takes: the first stage's half of update k
left before the last stage could reach its update k + 1, and the last
stage's half of k leaves right after the input gradient the first stage
needs before its update k; so the stream should keep its pace. This script trains the default-sized gpt (D = 2, T = 4,
batch 16, AdamW) on pipedream-2bw in rounds that alternate ``untied`` and
``tied``; per variant and round it reports the median wall time per
mini-batch (mini-batches after the first and before the last: the last holds
the stream's drain) and the median duration of a ``U`` (over both ranks; the
tie's exchange and sums are inside it), and per round the ratio tied /
untied of the mini-batch time.

Usage: ``python benchmarks/runtime/tied_stream.py [--rounds 5] [--steps 20] [--transport auto|gloo|shm] [--json FILE]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from typing import Any

from pipeweave.models import ModelSpec
from pipeweave.runtime.report.trace import step_times
from pipeweave.config import TrainConfig
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare

GPT = ModelSpec(kind="gpt", layers=4, hidden=128, heads=4, seq_len=64)
VARIANTS = {"untied": GPT, "tied": dataclasses.replace(GPT, tie_embeddings=True)}


def _run(variant: str, steps: int, transport: str) -> dict[str, float]:
    fields: dict[str, Any] = dict(schedule="pipedream-2bw", num_stages=2, num_microbatches=4, model=VARIANTS[variant],
                                  batch_size=16, steps=steps, optimizer="adamw", lr=3e-3)
    plan = prepare(TrainConfig(**fields))
    record = launch(run_rank, plan, plan.num_processes, LaunchOptions(transport=transport))
    times = step_times(record)[1:-1]
    updates = [rec[4] - rec[3] for r in record.ranks for step in r.records for rec in step if rec[1] == "U"]
    return {"step_ms": statistics.median(times) * 1e3, "u_ms": statistics.median(updates) * 1e3,
            "last_loss": record.losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--transport", default="auto", choices=("auto", "gloo", "shm"))
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    rows, ratios = [], []
    for r in range(args.rounds):
        got = {}
        for variant in VARIANTS:
            got[variant] = _run(variant, args.steps, args.transport)
            rows.append({"round": r, "variant": variant, **got[variant]})
        ratios.append(got["tied"]["step_ms"] / got["untied"]["step_ms"])
        print(f"round {r}  untied {got['untied']['step_ms']:7.2f} ms (U {got['untied']['u_ms']:5.2f})  "
              f"tied {got['tied']['step_ms']:7.2f} ms (U {got['tied']['u_ms']:5.2f})  tied/untied {ratios[-1]:.3f}",
              flush=True)
    for variant in VARIANTS:
        mine = [x for x in rows if x["variant"] == variant]
        print(f"median {variant:7s} {statistics.median(x['step_ms'] for x in mine):8.2f} ms per mini-batch, "
              f"U {statistics.median(x['u_ms'] for x in mine):6.2f} ms")
    print(f"median tied/untied {statistics.median(ratios):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
