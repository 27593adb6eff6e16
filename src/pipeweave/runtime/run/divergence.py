"""A run that diverges: stopped at the step whose loss (or gradient norm) is not finite, or that step skipped.

``TrainConfig.on_nonfinite`` (``--on-nonfinite``) says what a step whose
loss -- summed over the ranks -- is not finite does, or, under
``--clip-grad-norm``, a step whose global gradient norm is not:

- ``stop`` (the default): the run ends after that step on every rank, with
  one line naming it (``errors.Diverged``: exit code 1, no traceback); no
  checkpoint is written after it, so the last one saved stays.
- ``skip``: no stage applies that step's update (``StageWorker.update(skip=True)``):
  parameters and optimizer state stay bitwise as they were -- under
  post-validation too, as the loss is known before any stage steps
  optimistically; a gradient that alone is not finite is rolled back
  (``weights.post_validation``: exact to float rounding). The run goes on,
  and counts the step (``RunRecord.skipped_steps``).

Every rank knows each step's loss before its first update
(``runtime.nonfinite.LossAgreement``: one asynchronous all-reduce of one
number per step), so every rank decides alike. Asynchronous runs stop only
(their stages update per microbatch: there is no step to skip): each
drained stream's losses are summed over the ranks (one all-reduce per
stream) and the run stops at the first non-finite one, before evaluating or
saving there.

A finite loss does not prove the update it leads to finite: the weights are
checked too, by all ranks together, before every checkpoint
(``checkpoint.save`` refuses non-finite ones) and at the end of the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from pipeweave.errors import Diverged
from pipeweave.runtime.nonfinite import summed_losses
from pipeweave.runtime.run import checkpoint
from pipeweave.runtime.run.prepare import RunPlan
from pipeweave.runtime.stage.post_validation import ValidatedOptimizer
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Placement


class Divergence:
    """One rank's watch over the steps of its run: stop it (``Diverged``) or count the skipped steps.

    Attributes:
        skipped_steps: the steps of this run (0-based) whose update was skipped.
    """

    def __init__(self, plan: RunPlan, workers: dict[int, StageWorker]) -> None:
        self.plan, self.workers = plan, workers
        self.skipped_steps: list[int] = []

    def after_step(self, step: int, loss: float | None, overflowed: bool = False) -> None:
        """Step ``step`` of this run is done; ``loss``: its loss summed over the ranks (``Executor.step_loss``);
        ``overflowed``: its fp16 gradients overflowed, the update skipped by the loss scaling
        (``runtime.loss_scale``), which a non-finite gradient norm then only repeats."""
        if overflowed and (loss is None or math.isfinite(loss)):
            return
        what = _nonfinite(loss, self.workers)
        if what is None:
            return
        if self.plan.config.training.on_nonfinite == "skip":
            self.skipped_steps.append(step)
            return
        self._stop(what, step)

    def after_stream(self, first: int, shares: Sequence[float], device: torch.device, group: Any = None) -> None:
        """A stream of mini-batches ``first``.. of this run drained; ``shares``: this rank's share of their losses
        (summed over ``group``: ``RankContext.pipeline_group``)."""
        for k, loss in enumerate(summed_losses(shares, device, group)):
            if not math.isfinite(loss):
                self._stop(f"the loss is {loss}", first + k)

    def at_end(self, placement: Placement) -> None:
        """The run's steps are done: refuse to end with non-finite weights (every rank calls it)."""
        checkpoint.check_finite(
            self.plan.config.checkpoint.save,
            self.plan.parts,
            placement,
            self.workers,
            where(self.plan, self.plan.config.training.steps - 1),
        )

    def _stop(self, what: str, step: int) -> None:
        config = self.plan.config
        fix = (
            "lower --lr or use --clip-grad-norm"
            if config.training.post_validation is None
            else "lower --lr or --clip-grad-norm, or give --on-nonfinite skip"
        )
        raise Diverged(f"{what} at {where(self.plan, step)}; {checkpoint.refused(config.checkpoint.save)}; {fix}")


def where(plan: RunPlan, step: int) -> str:
    """Step ``step`` (0-based, of this run) as a user reads it: ``step 3 (of this run; step 5 of the training)``."""
    return f"step {step + 1} (of this run; step {plan.steps_done + step + 1} of the training)"


def _nonfinite(loss: float | None, workers: dict[int, StageWorker]) -> str | None:
    """What was not finite in the step just done (the same on every rank), or None."""
    if loss is not None and not math.isfinite(loss):
        return f"the loss is {loss}"
    for worker in workers.values():  # post-validation: every stage validated on the same global state
        optimizer = worker.optimizer
        if isinstance(optimizer, ValidatedOptimizer) and optimizer.outcomes[-1:] == ["skipped"]:
            return f"the gradient norm is {optimizer.norms[-1]}"
    return None
