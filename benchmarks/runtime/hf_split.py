"""A transformers GPT-2 split at the same point by torch.distributed.pipelining and by pipeweave.pipeline, 1F1B.

The model: ``GPT2LMHeadModel`` from a config (4 blocks, width 128, 4 heads,
256 tokens of bytes, 64 positions; untied, since torch's stages would not
sum a tied embedding's gradients), behind a wrapper returning its logits;
cross-entropy on the next byte of the standard library's sources; batch 16
in T = 4 microbatches; SGD; 2 ranks on one thread each. Both split it
before ``transformer.h.2`` (torch: ``pipeline(..., split_spec={...:
SplitPoint.BEGINNING})`` then ``Schedule1F1B``; pipeweave:
``pipeweave.pipeline(..., ["m.transformer.h.2"])`` then its 1f1b through
``run_rank``, the code ``pipeweave train`` runs, on ``--transport``, default train's).
Rounds alternate the two in one process group, so both meet the same load.
Step times: median of ``--steps`` steps after ``--warmup``, optimizer step
included. Usage: ``python benchmarks/runtime/hf_split.py [--steps 10] [--rounds 5] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pipeweave
from pipeweave.runtime.context import RankContext
from pipeweave.models import ModelSpec
from pipeweave.models.hf import ByteWindows
from pipeweave.runtime.report.trace import summarize
from pipeweave.config import TrainConfig
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import build_schedule, prepare

CONFIG = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 256, "n_positions": 64, "resid_pdrop": 0.0,
          "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False, "tie_word_embeddings": False}
SEQ, BATCH, T, LR = 64, 16, 4, 0.05
SPLIT = "m.transformer.h.2"


class Logits(nn.Module):
    """The transformers model, returning its logits (both splitters take one tensor out)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        self.m = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.m(tokens).logits  # type: ignore[no-any-return]


class NextByte(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(bytes, the next bytes) windows of the standard library's sources."""

    def __init__(self) -> None:
        self.windows = ByteWindows(SEQ + 1).tokens

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows[i, :-1], self.windows[i, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def model() -> Any:
    """pipeweave's side: the module as written, split by ``pipeweave.pipeline`` (every rank loads this)."""
    data = NextByte()
    return pipeweave.pipeline(Logits(), (data.windows[:BATCH // T, :-1],), [SPLIT], loss=loss_fn, dataset=data)


def ours(context: RankContext, steps: int, warmup: int) -> dict[str, Any] | None:
    world = context.world
    config = TrainConfig(schedule="1f1b", num_stages=world, num_microbatches=T, batch_size=BATCH,
                         model=ModelSpec(kind="custom", entry=f"{os.path.abspath(__file__)}:model"),
                         steps=steps + warmup, optimizer="sgd", lr=LR, momentum=0.0)
    record = run_rank(context, prepare(config))
    if record is None:
        return None
    times = summarize(build_schedule(config), record)["step_times_s"][warmup:]
    return {"step_time_s": statistics.median(times), "step_times_s": times, "transport": record.transport}


def theirs(context: RankContext, steps: int, warmup: int) -> dict[str, Any] | None:
    rank = context.process
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    data = NextByte()
    x, y = data.windows[:BATCH, :-1], data.windows[:BATCH, 1:]
    pipe = pipeline(Logits(), mb_args=(x[:BATCH // T],), split_spec={SPLIT: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=T, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=LR)
    times = []
    dist.barrier()
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"step_time_s": statistics.median(times[warmup:]), "step_times_s": times[warmup:]} if rank == 0 else None


def bench(context: RankContext, options: dict[str, Any]) -> dict[str, Any] | None:
    rank = context.process
    results: dict[str, Any] = {"ours": [], "theirs": [], "load_average": {"start": os.getloadavg()}}
    for _ in range(options["rounds"]):  # alternating: both meet the same load
        results["ours"].append(ours(context, options["steps"], options["warmup"]))
        results["theirs"].append(theirs(context, options["steps"], options["warmup"]))
    results["load_average"]["end"] = os.getloadavg()
    return results if rank == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--transport", choices=("auto", "gloo", "shm"), default="auto",
                        help="pipeweave's point-to-point transport, as `pipeweave train --transport` (default auto, "
                             "train's default: shared memory here); torch's schedule always uses gloo")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    payload = {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
    results = launch(bench, payload, 2, LaunchOptions(timeout_s=600, transport=args.transport))
    ratios = [o["step_time_s"] / t["step_time_s"] for o, t in zip(results["ours"], results["theirs"])]
    results["ratio_rounds"], results["ratio_median"] = ratios, statistics.median(ratios)
    results["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results["transport"] = args.transport
    for k, (o, t, r) in enumerate(zip(results["ours"], results["theirs"], ratios)):
        print(f"round {k}: pipeweave 1f1b {1e3 * o['step_time_s']:.1f} ms, torch Schedule1F1B "
              f"{1e3 * t['step_time_s']:.1f} ms, ratio {r:.3f}")
    print(f"median ratio pipeweave / torch: {results['ratio_median']:.3f}; load average {results['load_average']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
