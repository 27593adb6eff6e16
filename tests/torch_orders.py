"""torch.distributed.pipelining's own schedule classes' orders, computed without processes.

Its ``PipelineScheduleMulti`` subclasses build ``pipeline_order`` (every rank's actions) in their constructor
from the stages of one rank; stand-in stages with the attributes the constructor reads suffice.
"""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.distributed.pipelining import schedules

TORCH_CLASSES = (
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)


def torch_order(cls_name: str, num_ranks: int, num_microbatches: int) -> dict[int, list]:
    """``schedules.<cls_name>``'s ``pipeline_order`` for two stages per rank (looped, or V-shaped for ZBV and DualPipeV)."""
    cls = getattr(schedules, cls_name)
    n = 2 * num_ranks
    ids = (0, n - 1) if cls_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") else (0, num_ranks)
    stages = [
        SimpleNamespace(num_stages=n, group_size=num_ranks, group_rank=0, stage_index=i, submod=torch.nn.Linear(1, 1))
        for i in ids
    ]
    return cls(stages, n_microbatches=num_microbatches, loss_fn=torch.nn.functional.mse_loss).pipeline_order


def write_torch_csv(order: dict[int, list], path: Path) -> None:
    """As torch's ``_dump_csv`` writes it: one row per rank, None as an empty cell."""
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(["" if a is None else str(a) for a in order[r]] for r in sorted(order))
