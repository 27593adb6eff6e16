"""One process of a run: its place in the mesh, and its stage workers, built from the model's seed as plain
training builds its layers (split over its tensor-parallel group, if any)."""

from __future__ import annotations

import dataclasses

import torch

from pipeweave.runtime.process import device_for
from pipeweave.runtime.run.plan import RunPlan, optimizer_factory
from pipeweave.runtime.stage.post_validation import install_post_validation
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.transport import mesh
from pipeweave.runtime.transport.mesh import Mesh, build_mesh
from pipeweave.schedule import Schedule


def join_mesh(plan: RunPlan, process: int, world: int) -> tuple[Mesh, torch.device]:
    """Process ``process`` of ``world``: its mesh (every group created and installed: every process calls this
    at its start) and its device."""
    device = device_for(process)
    joined = build_mesh(process, world, plan.schedule.placement, plan.config.parallel.data_parallel,
                        plan.config.parallel.tensor_parallel, device)
    mesh.install(joined)
    return joined, device


def build_workers(plan: RunPlan, rank: int, device: torch.device,
                  schedule: Schedule | None = None) -> dict[int, StageWorker]:
    """A ``StageWorker`` per stage of ``schedule`` (default: the plan's) placed on stage rank ``rank``.

    Under tensor parallelism (the installed ``transport.mesh``) each splits its layers over the process's
    ``tp`` group. With ``--clip-grad-norm`` each stage's optimizer is the post-validated one
    (``stage.post_validation``), unless the run clips by a collective (``TrainConfig.clips_by_collective``).
    """
    config = plan.config
    schedule = schedule if schedule is not None else plan.schedule
    joined = mesh.active()
    tp = None if joined is None else joined.tensor_parallel_group
    if tp is not None:
        tp = dataclasses.replace(tp, sequence_parallel=config.parallel.sequence_parallel)
    modes = config.memory.recompute_of(schedule.num_parts)
    workers = {
        s: StageWorker(config.model, plan.parts[schedule.placement.stage_part[s]], batch_size=config.data.batch_size,
                       optimizer_factory=optimizer_factory(config), recompute=modes[schedule.placement.stage_part[s]],
                       device=device, precision=config.training.precision, tensor_parallel=tp,
                       compress=config.memory.compress_activations is not None)
        for s in schedule.placement.stages_on(rank)
    }
    if config.training.post_validation is not None and not config.clips_by_collective:  # (else runtime.clip, at U)
        install_post_validation(config.training.post_validation, schedule, workers, config.training.optimizer, config.training.lr,
                                config.training.momentum)
    return workers
