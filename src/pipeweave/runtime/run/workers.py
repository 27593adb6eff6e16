"""One process of a run: its place in the mesh, and its stage workers, built from the model's seed as plain
training builds its layers (split over its tensor-parallel group, if any)."""

from __future__ import annotations

import dataclasses

import torch

from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.plan import RunPlan, optimizer_factory
from pipeweave.runtime.stage.post_validation import install_post_validation
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.transport.mesh import build_mesh
from pipeweave.schedule import Schedule


def join_mesh(plan: RunPlan, context: RankContext) -> RankContext:
    """``context`` in the run's mesh, every group created (every process calls this at its start)."""
    return context.with_mesh(build_mesh(context.process, context.world, plan.schedule.placement,
                                        plan.config.data_parallel, plan.config.tensor_parallel, context.device))


def build_workers(plan: RunPlan, rank: int, device: torch.device,
                  schedule: Schedule | None = None, context: RankContext | None = None) -> dict[int, StageWorker]:
    """A ``StageWorker`` per stage of ``schedule`` (default: the plan's) placed on stage rank ``rank``.

    Under tensor parallelism (``context.mesh``) each splits its layers over the process's
    ``tp`` group. With ``--clip-grad-norm`` each stage's optimizer is the post-validated one
    (``stage.post_validation``), unless the run clips by a collective (``TrainConfig.clips_by_collective``).
    """
    config = plan.config
    schedule = schedule if schedule is not None else plan.schedule
    context = context if context is not None else RankContext()
    joined = context.mesh
    tp = None if joined is None else joined.tensor_parallel_group
    if tp is not None:
        tp = dataclasses.replace(tp, sequence_parallel=config.sequence_parallel)
    modes = config.recompute_of(schedule.num_parts)
    workers = {
        s: StageWorker(config.model, plan.parts[schedule.placement.stage_part[s]], batch_size=config.batch_size,
                       optimizer_factory=optimizer_factory(config), recompute=modes[schedule.placement.stage_part[s]],
                       device=device, precision=config.precision, tensor_parallel=tp,
                       compress=config.compress_activations is not None)
        for s in schedule.placement.stages_on(rank)
    }
    if config.post_validation is not None and not config.clips_by_collective:  # (else runtime.clip, at U)
        install_post_validation(config.post_validation, schedule, workers, config.optimizer, config.lr,
                                config.momentum, context)
    return workers
