"""torch.distributed.pipelining's runtime on pipeweave's searched schedules against torch's built-in schedules.

One model for all: the residual MLP of ``benchmarks/runtime`` (8 blocks of LayerNorm -> Linear(h,4h) -> GELU ->
Linear(4h,h), h = 256), batch 256 in T = 8 microbatches, MSE, SGD, on gloo, one thread per rank; one stage per
rank cuts it in D parts, two stages per rank in 2D. Every approach is torch's own runtime:

- torch's built-in schedule classes (``Schedule1F1B``, ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``);
- pipeweave's schedules, written by ``pipeweave simulate --csv`` and loaded into ``_PipelineScheduleRuntime``
  with ``_load_csv``: ``zb-auto`` and ``zb-v-auto`` as ``pipeweave search`` finds them for F = I = W (the
  search's unit costs), and the registry's ``zb-h1`` for reference.

Each round runs every approach (the order reversed every other round, so that all meet the same load) and records
its median step time over ``--steps`` steps after ``--warmup``, optimizer step included. The JSON holds every round.
Usage: ``python benchmarks/interop/bench_torch_runtime.py [--ranks 2] [--rounds 5] [--steps 8] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HIDDEN, LAYERS, BATCH, T = 256, 8, 256, 8  # benchmarks/runtime's model and batch

TORCH = (
    ("Schedule1F1B", 1),
    ("ScheduleGPipe", 1),
    ("ScheduleInterleaved1F1B", 2),
    ("ScheduleInterleavedZeroBubble", 2),
    ("ScheduleZBVZeroBubble", 2),
    ("ScheduleDualPipeV", 2),
)
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


class Block(nn.Module):
    """x + Linear(GELU(Linear(LayerNorm(x)))), widening 4x: benchmarks/runtime's residual block."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def export(ranks: int, folder: Path) -> dict[str, dict[str, Any]]:
    """pipeweave's schedules as torch's CSV, through the commands a user runs; per name its file and stage ranks."""
    from pipeweave.cli import main
    from pipeweave.schedule import read_csv

    sizes = ["--stages", str(ranks), "--microbatches", str(T)]
    out = {}
    for name, search, simulate in (
        ("zb-auto", ["search", *sizes], None),
        ("zb-v-auto", ["search", *sizes, "--v-shape"], None),
        ("zb-h1", None, ["-s", "zb-h1", *sizes]),
    ):
        path = folder / f"{name}.csv"
        with contextlib.redirect_stdout(io.StringIO()):
            if search is not None:
                assert main([*search, "--csv", str(folder / f"{name}-found.csv")]) == 0
                simulate = ["--from-csv", str(folder / f"{name}-found.csv")]
            assert main(["simulate", *simulate, "--csv", str(path)]) == 0
        out[name] = {"csv": str(path), "stage_rank": list(read_csv(path).placement.stage_rank)}
    return out


def _stages(rank: int, stage_rank: list[int]) -> tuple[list[Any], list[int]]:
    from torch.distributed.pipelining import PipelineStage

    num_stages = len(stage_rank)
    per_stage = LAYERS // num_stages
    torch.manual_seed(0)
    blocks = [Block(HIDDEN) for _ in range(LAYERS)]
    mine = [s for s, r in enumerate(stage_rank) if r == rank]
    parts = [nn.Sequential(*blocks[s * per_stage : (s + 1) * per_stage]) for s in mine]
    return [PipelineStage(p, s, num_stages, torch.device("cpu")) for p, s in zip(parts, mine)], mine


def _placement(name: str, world: int, per_rank: int) -> list[int]:
    n = world * per_rank
    if name in V_SHAPED:
        return [s if s < world else n - 1 - s for s in range(n)]
    return [s % world for s in range(n)]


def step_time(rank: int, world: int, approach: dict[str, Any], steps: int, warmup: int) -> float:
    """Median wall time of one step (schedule + optimizer) of ``approach`` on this rank."""
    from torch.distributed.pipelining import schedules

    stage_rank = approach["stage_rank"]
    stages, mine = _stages(rank, stage_rank)
    if "csv" in approach:
        schedule = schedules._PipelineScheduleRuntime(stages, n_microbatches=T, loss_fn=nn.functional.mse_loss)
        schedule._load_csv(approach["csv"])
    else:
        cls = getattr(schedules, approach["class"])
        multi = issubclass(cls, schedules.PipelineScheduleMulti)
        schedule = cls(stages if multi else stages[0], n_microbatches=T, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.01)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, HIDDEN, generator=generator), torch.randn(BATCH, HIDDEN, generator=generator)
    first, last = 0 in mine, len(stage_rank) - 1 in mine
    times = []
    dist.barrier()
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        kwargs: dict[str, Any] = {"target": y, "losses": []} if last else {}
        schedule.step(*((x,) if first else ()), **kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return statistics.median(times[warmup:])


def _rank(rank: int, options: dict[str, Any]) -> None:
    world = options["world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{options['store']}", rank=rank, world_size=world)
    rounds: dict[str, list[float]] = {}
    names = list(options["approaches"])
    for r in range(options["rounds"]):
        for name in names if r % 2 == 0 else names[::-1]:
            t = step_time(rank, world, options["approaches"][name], options["steps"], options["warmup"])
            every: list[Any] = [None] * world
            dist.all_gather_object(every, t)
            rounds.setdefault(name, []).append(max(every))  # the step ends when its slowest rank does
    if rank == 0:
        Path(options["out"]).write_text(json.dumps(rounds))
    dist.destroy_process_group()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="interop-"))
    approaches: dict[str, dict[str, Any]] = {
        name: {"class": name, "stage_rank": _placement(name, args.ranks, per_rank)} for name, per_rank in TORCH
    }
    approaches.update({f"pipeweave {k}": v for k, v in export(args.ranks, folder).items()})
    options = {
        "world": args.ranks,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "approaches": approaches,
        "store": str(folder / "store"),
        "out": str(folder / "rounds.json"),
    }
    load_start = os.getloadavg()
    mp.start_processes(_rank, args=(options,), nprocs=args.ranks, join=True, start_method="fork")
    rounds = json.loads(Path(options["out"]).read_text())
    results = {
        "step_time_s_rounds": rounds,
        "step_time_s_median": {k: statistics.median(v) for k, v in rounds.items()},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": _commit(),
            "load_average": {"start": load_start, "end": os.getloadavg()},
        },
        "setup": {"ranks": args.ranks, "threads_per_rank": 1, "hidden": HIDDEN, "layers": LAYERS, "batch": BATCH,
                  "microbatches": T, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds},
    }
    for name, times in rounds.items():
        print(f"{name:32s} " + " ".join(f"{1000 * t:7.1f}" for t in times) + f"   median {1000 * statistics.median(times):7.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
