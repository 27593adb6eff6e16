"""The stage workers of one rank of a run, built from the model's seed as plain training builds its layers."""

from __future__ import annotations

import torch

from pipeweave.runtime.run.plan import RunPlan, optimizer_factory
from pipeweave.runtime.stage.post_validation import install_post_validation
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule import Schedule


def build_workers(plan: RunPlan, rank: int, device: torch.device,
                  schedule: Schedule | None = None) -> dict[int, StageWorker]:
    """A ``StageWorker`` per stage of ``schedule`` (default: the plan's) placed on ``rank``.

    With ``--clip-grad-norm`` each stage's optimizer is the post-validated one (``stage.post_validation``).
    """
    config = plan.config
    schedule = schedule if schedule is not None else plan.schedule
    workers = {
        s: StageWorker(config.model, plan.parts[schedule.placement.stage_part[s]], batch_size=config.batch_size,
                       optimizer_factory=optimizer_factory(config), recompute=config.recompute, device=device,
                       precision=config.precision)
        for s in schedule.placement.stages_on(rank)
    }
    if config.post_validation is not None:
        install_post_validation(config.post_validation, schedule, workers, config.optimizer, config.lr,
                                config.momentum)
    return workers
