"""One process of a run: its place in the mesh, and its stage workers, each built by ordered steps.

A stage of a run is built as torchtitan's ``parallelize_*`` makes a model
parallel: step by step, each a function of the stage under construction and
the run, nothing patched afterwards. In order (``stage.build.STEPS``, then ``RUN_STEPS``)::

    stage.build.split_layers           the part's layers, from the model's seed: plain training's, cut over the
                                       process's tp group as they are built (--tensor-parallel)
    stage.build.apply_tensor_parallel  sequence parallelism over the tp group (--sequence-parallel)
    stage.build.apply_context_parallel ring attention over the process's cp group (--context-parallel)
    stage.build.apply_expert_parallel  the MoE layers' share of the experts of the process's ep group
                                       (--expert-parallel)
    stage.build.apply_recompute        selective recomputation (--recompute)
    stage.build.place                  on the device, the W store wired in, the activation meter
    stage.build.apply_memory_levers    compressed saved tensors (--compress-activations); kept per microbatch
                                       where the lowered schedule moves them (--offload, --balance-activations)
    stage.build.apply_optimizer        the optimizer (--optimizer, --lr, --momentum)
    apply_sharding                     ZeRO-1, 2 or 3 over the part's data-parallel replicas (--zero)
    apply_weight_policy                the post-validated step (--clip-grad-norm on a straight schedule)

The stage's own options (``_options``) come from the run's configuration; the
first six steps take them, the run's two take the ``RankBuild``. The result
is sealed (``StageWorker.from_stage``). What a rank does with its stages'
gradients at each ``U`` (replicas' sums, ties, clipping) is its executor's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeweave.runtime.context import RankContext
from pipeweave.runtime.replicas import shard_replica
from pipeweave.runtime.run.prepare import RunPlan, optimizer_factory
from pipeweave.runtime.stage import build
from pipeweave.runtime.stage.build import Stage, StageOptions
from pipeweave.runtime.stage.compiled import BACKEND
from pipeweave.runtime.stage.post_validation import validated_optimizer
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.transport.mesh import ExpertParallel, build_mesh
from pipeweave.schedule import Schedule
from pipeweave.schedule.ir import Action


def join_mesh(plan: RunPlan, context: RankContext) -> RankContext:
    """``context`` in the run's mesh, every group created, with the run's ``--comm-delay-ms`` (every process calls
    this at its start)."""
    context = dataclasses.replace(context, comm_delay=plan.config.launch.comm_delay_ms / 1000)
    return context.with_mesh(
        build_mesh(
            context.process,
            context.world,
            plan.schedule.placement,
            plan.config.parallel.data_parallel,
            plan.config.parallel.tensor_parallel,
            context.device,
            plan.config.parallel.context_parallel,
            plan.config.parallel.expert_parallel,
        )
    )


@dataclass(frozen=True)
class RankBuild:
    """What the run's steps of a stage read: the run, the schedule, the stage's number, the rank's context."""

    plan: RunPlan
    schedule: Schedule
    index: int
    context: RankContext


def apply_sharding(stage: Stage, run: RankBuild) -> None:
    """ZeRO over the part's replicas on other ranks (``replicas.shard_replica``): the optimizer state (1) or the
    layers too (3, FSDP2). Where a part's replicas are not on several ranks, nothing."""
    config, mesh = run.plan.config, run.context.mesh
    part = run.schedule.placement.stage_part[run.index]
    if not config.parallel.zero or mesh is None or part not in mesh.replica_groups:
        return
    dp_mesh = mesh.device_mesh["dp"] if config.parallel.zero == 3 and mesh.device_mesh is not None else None
    shard_replica(
        stage, config.parallel.zero, mesh.replica_groups[part], dp_mesh, int(config.parallel.bucket_mb * 2**20)
    )


def apply_weight_policy(stage: Stage, run: RankBuild) -> None:
    """With ``--clip-grad-norm``, the post-validated step (``stage.post_validation``), unless the run clips by a
    collective at ``U`` (``TrainConfig.clips_by_collective``: ``runtime.clip``, the executor's)."""
    config = run.plan.config
    if config.training.post_validation is not None and not config.clips_by_collective:
        stage.optimizer = validated_optimizer(
            config.training.post_validation,
            run.schedule,
            run.index,
            stage,
            config.training.optimizer,
            config.training.lr,
            config.training.momentum,
            run.context,
        )


RunStep = Callable[[Stage, RankBuild], None]
RUN_STEPS: tuple[RunStep, ...] = (apply_sharding, apply_weight_policy)
"""The run's steps of a stage, in order, after the stage's own (``stage.build.STEPS``; module docstring)."""


def build_workers(
    plan: RunPlan,
    rank: int,
    device: torch.device,
    schedule: Schedule | None = None,
    context: RankContext | None = None,
    row: Sequence[Action] = (),
) -> dict[int, StageWorker]:
    """A ``StageWorker`` per stage of ``schedule`` (default: the plan's) placed on stage rank ``rank``, built by
    the stage's steps then the run's (module docstring).

    ``context``: the rank's (its mesh: the tp group the layers are split over, the replicas' groups ZeRO
    shards over); ``row``: the rank's lowered actions, whose memory actions say which stages keep what
    autograd saves per microbatch.
    """
    schedule = schedule if schedule is not None else plan.schedule
    context = context if context is not None else RankContext()
    workers = {}
    for s in schedule.placement.stages_on(rank):
        stage = Stage(_options(plan, schedule, s, device, context, row))
        run = RankBuild(plan, schedule, s, context)
        for step in build.STEPS:
            step(stage, stage.options)
        for run_step in RUN_STEPS:
            run_step(stage, run)
        workers[s] = StageWorker.from_stage(stage)
    return workers


def _options(
    plan: RunPlan, schedule: Schedule, s: int, device: torch.device, context: RankContext, row: Sequence[Action]
) -> StageOptions:
    """Stage ``s``'s own options, from the run's configuration."""
    config, part = plan.config, schedule.placement.stage_part[s]
    tp = None if context.mesh is None else context.mesh.tensor_parallel_group
    if tp is not None:
        tp = dataclasses.replace(tp, sequence_parallel=config.parallel.sequence_parallel)
    return build.stage_options(
        config.model,
        plan.parts[part],
        batch_size=config.data.batch_size,
        optimizer_factory=optimizer_factory(config),
        recompute=config.memory.recompute_of(schedule.num_parts)[part],
        device=device,
        precision=config.training.precision,
        tensor_parallel=tp,
        context_parallel=None if context.mesh is None else context.mesh.context_parallel_group,
        expert_parallel=_expert_parallel(context),
        compress=config.memory.compress_activations is not None,
        stashing=any(a.op.is_memory and a.stage == s for a in row),
        steps_done=plan.steps_done,
        compile=BACKEND if config.training.compile else None,
    )


def _expert_parallel(context: RankContext) -> ExpertParallel | None:
    """The process's ``ep`` group, its all-to-alls delayed as the run's messages are (``--comm-delay-ms``)."""
    ep = None if context.mesh is None else context.mesh.expert_parallel_group
    if ep is None or not context.comm_delay:
        return ep
    return dataclasses.replace(ep, delayed=context.delayed)
