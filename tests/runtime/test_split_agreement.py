"""Every rank builds rank 0's split, or every rank stops in one line (``runtime.run.agreement``).

Ranks that measured a model apart choose different automatic splits; before
this check such ranks trained a model missing the layers that fell between
their parts, with no error (torchrun cases, slow: ``test_torchrun.py``). Here
two spawned gloo ranks are handed different choices directly: a plan whose
layer counts differ on rank 1 trains rank 0's; a model that cut itself
differently on rank 1 (``split_by_rank.named``) stops both ranks with one
line; ``pipeweave.pipeline(..., split_points=D)`` called once the group exists
takes rank 0's profiled cuts on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from config_defaults import train_config

from pipeweave.errors import RanksDisagree, UserError
from pipeweave.models import ModelSpec
from pipeweave.models.custom import load_model
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.agreement import rank0_decides
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, RankFailure, launch
from pipeweave.runtime.run.prepare import prepare

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

FILE = Path(__file__).resolve().with_name("split_by_rank.py")


def _cases(context: RankContext, cache: str) -> tuple[list[Any], Any, str, list[str]]:
    """On each rank: the cuts ``pipeline(..., split_points=2)`` chose (rank 1 measuring its own costs), the run
    of a plan whose layer counts differ on rank 1, what stopped the run of a model cut apart, and what rank 1
    raised where rank 0 failed to decide (every rank's)."""
    rank, world = context.process, context.world
    os.environ.update(RANK=str(rank), PIPEWEAVE_CACHE=cache)  # split_by_rank: this rank measures its own costs
    cuts: list[Any] = [None] * world
    dist.all_gather_object(cuts, load_model(f"{FILE}:profiled").split_points)
    counts = (1, 3) if rank == 0 else (3, 1)  # what each measured alone
    record = run_rank(context, prepare(dataclasses.replace(COUNTED, layers_per_part=counts)))
    stop = ""
    try:
        run_rank(context, prepare(NAMED))
    except RanksDisagree as error:
        stop = str(error)
    failures = []
    for error in (UserError("give D >= 1"), KeyError("blocks")):
        try:
            rank0_decides(functools.partial(_raise, error))
        except Exception as raised:  # noqa: BLE001 - what each rank raises is the point
            failures.append(f"{type(raised).__name__}: {raised}")
    every: list[Any] = [None] * world
    dist.all_gather_object(every, failures)
    return cuts, record, stop, every


def _raise(error: Exception) -> None:
    raise error


COUNTED = train_config(
    schedule="1f1b",
    num_stages=2,
    num_microbatches=2,
    model=ModelSpec(kind="mlp", layers=4, hidden=8),
    batch_size=4,
    steps=1,
    collect_parameters=True,
)
NAMED = train_config(
    schedule="1f1b",
    num_stages=2,
    num_microbatches=2,
    batch_size=4,
    steps=1,
    model=ModelSpec(kind="custom", entry=f"{FILE}:named"),
    optimizer="sgd",
)
STOP = (
    "ranks chose different splits of the model (rank 1: cut at ['3'], layers 0-0 | 1-1, schedule {0}; "
    "rank 0: cut at ['2'], layers 0-0 | 1-1, schedule {0}): they measured its costs apart (torchrun, "
    "nothing cached); give every rank rank 0's cuts by name (split_points=[module names]) or layer counts "
    "(--layers-per-stage)"
)


def test_ranks_take_rank_0s_split_or_stop_in_one_line(tmp_path: Path) -> None:
    cuts, record, stop, failures = launch(_cases, str(tmp_path / "cache"), 2, LaunchOptions(timeout_s=60))
    assert cuts == [("2",), ("2",)]  # rank 1 alone cuts before child 4
    assert not (tmp_path / "cache" / "rank1").exists()  # rank 0 alone profiled
    layers = [sorted({name.split(".")[0] for name in r.parameters[r.rank]}) for r in record.ranks]
    assert layers == [["0"], ["1", "2", "3"]]  # rank 0's 1 + 3
    assert stop == STOP.format(stop.split("schedule ")[1][:8])
    assert failures == [
        ["UserError: give D >= 1", "KeyError: 'blocks'"],  # rank 0's own, then what rank 1 hears
        ["UserError: give D >= 1", "RuntimeError: rank 0 failed: KeyError: 'blocks'"],
    ]


@pytest.mark.slow
def test_the_launcher_says_the_split_mismatch_in_one_line() -> None:
    with pytest.raises(RankFailure) as failure:
        launch(run_rank, prepare(NAMED), 2, LaunchOptions(timeout_s=60, quiet_errors=True))
    cause = failure.value.cause
    assert cause == STOP.format(cause.split("schedule ")[1][:8])
