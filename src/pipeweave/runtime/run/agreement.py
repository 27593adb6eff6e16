"""Every rank of a run builds the same stages: rank 0's automatic split, and a check that all hold it.

Automatic splits (``--partition time|memory``, ``--recompute auto``, zb-auto's
searched costs, ``pipeweave.pipeline(..., split_points=D)``) come from costs
measured on the machine (``runtime.profile``). Spawned ranks read what the
launcher measured, but ranks started apart -- torchrun, each node with its own
cache, or ranks started together before anything was cached -- measure apart,
and may choose different splits. Ranks holding different parts then train,
with no error, a model missing the layers between their parts (two torchrun
nodes under ``--partition time``: ``tests/runtime/test_torchrun.py``), or
wait on messages that never come. So:

- ``rank0_decides(compute)``: where the default process group exists, rank 0
  alone computes (profiles once) and every rank takes its value
  (``broadcast_object_list``: gloo and NCCL);
- ``agreed_plan(plan)``: a run's plan with rank 0's profiled choices, taken by
  every rank once the group exists and before any stage is built, then
  ``check_split``: every rank's split against rank 0's; a difference (a model
  that cut itself in each process) stops every rank with one line naming both
  splits and the fix (``errors.RanksDisagree``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from pipeweave.errors import RanksDisagree, UserError
from pipeweave.runtime.run.prepare import RunPlan, prepare

T = TypeVar("T")

PROFILED = ("layers_per_part", "recompute", "options")
"""The ``TrainConfig`` fields the command line fills from profiled costs: layer counts (``--partition``),
recomputation per part (``--recompute auto``), zb-auto's per-part times."""


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank0_decides(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0 alone, its value on every rank; ``compute()`` itself where no group of
    several processes exists. Every rank of the group must call it at the same point.

    Raises:
        UserError: rank 0's, on every rank; RuntimeError: on the others, where rank 0 raised another error
            (they stop at once instead of waiting out the group's timeout).
    """
    if not _grouped():
        return compute()
    box: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = (True, compute())
        except Exception as error:  # noqa: BLE001 - said to every rank, raised again here
            failure, box[0] = error, (False, (isinstance(error, UserError), f"{type(error).__name__}: {error}"))
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if failure is not None:
        raise failure
    if not ok:
        user, said = value
        raise UserError(said.partition(": ")[2]) if user else RuntimeError(f"rank 0 failed: {said}")
    return value  # type: ignore[no-any-return]


def agreed_plan(plan: RunPlan) -> RunPlan:
    """``plan``, or where rank 0's profiled choices (``PROFILED``) differ from this rank's, the plan prepared
    with rank 0's; its split checked against rank 0's (``check_split``). Every rank calls it once the group
    exists, before building a stage.

    Raises:
        RanksDisagree: as ``check_split``.
    """
    if not _grouped():
        return plan
    mine = {name: plan.config.get(name) for name in PROFILED}
    theirs = rank0_decides(lambda: mine)
    agreed = plan if theirs == mine else prepare(plan.config.replace(**theirs))
    check_split(agreed)
    return agreed


def split_of(plan: RunPlan) -> str:
    """The split a rank builds, in words: the cuts a custom model chose, each part's layers, and a digest of
    the schedule's actions (zb-auto searches its schedule from measured times)."""
    model = plan.config.model
    cuts = f"cut at {list(model.custom.split_points)}, " if model.kind == "custom" else ""
    parts = " | ".join(f"{r.start}-{r.stop - 1}" for r in plan.parts)
    actions = repr([[str(a) for a in row] for row in plan.schedule.actions]).encode()
    return f"{cuts}layers {parts}, schedule {hashlib.sha256(actions).hexdigest()[:8]}"


def check_split(plan: RunPlan) -> None:
    """Stop every rank, in one line, if any rank's ``split_of`` differs from rank 0's (every rank calls it).

    Raises:
        RanksDisagree: naming the first rank that differs, both splits and the fix.
    """
    if not _grouped():
        return
    splits: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(splits, split_of(plan))
    other = next((rank for rank, split in enumerate(splits) if split != splits[0]), None)
    if other is not None:
        raise RanksDisagree(
            f"ranks chose different splits of the model (rank {other}: {splits[other]}; rank 0: {splits[0]}): "
            "they measured its costs apart (torchrun, nothing cached); give every rank rank 0's cuts by name "
            "(split_points=[module names]) or layer counts (--layers-per-stage)"
        )
