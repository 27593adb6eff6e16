"""An asynchronous run on one rank: its streams through the ``Executor``, one after the other (``runtime.stream``).

Between two streams (``streams.segments``) nothing is in flight: the run
checks the stream's losses (``divergence``), evaluates and saves there, and
the next stream's policy takes the last one's ``StreamCarry``. Records are numbered as the run's schedule (the streams
concatenated) numbers its actions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pipeweave.runtime.context import RankContext
from pipeweave.runtime.executor import Executor, Record
from pipeweave.runtime.run import checkpoint, checkpoint_state
from pipeweave.runtime.run.divergence import Divergence
from pipeweave.runtime.run.milestones import Milestones
from pipeweave.runtime.run.prepare import RunPlan, run_data, stream_rates
from pipeweave.runtime.run.pretrained_save import save_parts
from pipeweave.runtime.run.record import (
    RankRecord,
    RunRecord,
    close_pauses,
    final_parameters,
    gather_run,
    seconds_since,
)
from pipeweave.runtime.run.sizes import replica_microbatch_sizes
from pipeweave.runtime.run.step_log import StepLog
from pipeweave.runtime.run.workers import build_workers, join_mesh
from pipeweave.runtime.stage.averaging import CollectiveExchange
from pipeweave.runtime.stage.policy import RankPolicy, Read, StreamCarry
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.stream import (
    StreamData,
    StreamPosition,
    check_stream_model,
    minibatch_losses,
    split_by_minibatch,
)
from pipeweave.runtime.transport.clock import align_clocks
from pipeweave.schedule import Schedule, lower
from pipeweave.schedule.ir import Action, WeightPolicy
from pipeweave.schedule.round_robin import averages_replicas


@dataclass
class _Streamed:
    """What a rank's streams measured so far, numbered as the run's schedule."""

    losses: list[float] = field(default_factory=list)
    timings: list[Record] = field(default_factory=list)
    versions: dict[Action, Read] = field(default_factory=dict)
    peak_activations: int = 0
    peak_weights: int = 0
    position: StreamPosition = field(default_factory=StreamPosition)
    averaging: list[tuple[int, int, int, int]] = field(default_factory=list)


def run_stream_rank(context: RankContext, plan: RunPlan) -> RunRecord | None:
    """``job.run_rank`` for an asynchronous schedule: its streams through the ``Executor``, one after the other."""
    started = time.perf_counter()
    config = plan.config
    check_stream_model(config.model, config.schedule.name, config.training.lr_scheduled)
    context = join_mesh(plan, context)
    joined, rank, device = context.mesh, context.stage_rank, context.device
    assert joined is not None
    workers = build_workers(plan, rank, device, plan.streams[0], context)
    carry = StreamCarry()
    if config.checkpoint.resume is not None:
        assert plan.resumed is not None
        apart = checkpoint_state.apart_replicas(plan.schedule.placement, workers)
        carry = checkpoint.load(plan.resumed.folder, plan.resumed.manifest, workers, apart)
    rates = stream_rates(config, plan.schedule, plan.updates_done).at if config.training.lr_scheduled else None
    source = run_data(config)
    offset = align_clocks(context.process, context.world)
    milestones = Milestones(plan, plan.streams[0], context, workers, source)  # any stream: same placement
    done = _Streamed()
    divergence = Divergence(plan, workers)
    log, exchange = StepLog(plan, context, None), _exchange(plan.streams[0], joined)
    for (first, steps), stream in zip(plan.segments, plan.streams):
        policy = RankPolicy(stream, workers, config.policy, lr_at=rates, carry=carry, exchange=exchange)
        _run_stream(plan, stream, (first, steps), context, workers, source, policy, done)
        carry = policy.carry()
        done.averaging += policy.averaging_events  # the drain applied the last ones
        end = first + steps
        groups = split_by_minibatch(done.timings, config.schedule.num_microbatches, end)
        for m in range(first, end):
            times = seconds_since(groups[m], offset)
            if context.reporting:  # a tensor-parallel group's processes run alike: one reports
                context.progress({"step": m, "loss": done.losses[m], "time": times[-1][4] if times else 0.0})
            log.after_step(m, done.losses[m], times)
        # Stops every rank before saving here.
        divergence.after_stream(first, done.losses[first:end], device, context.pipeline_group)
        milestones.reached(end, carry)
    log.close()
    divergence.at_end(plan.streams[0].placement)
    records = [
        seconds_since(g, offset)
        for g in split_by_minibatch(done.timings, config.schedule.num_microbatches, config.training.steps)
    ]
    save_parts(config, context, workers, plan.streams[0].num_ranks)
    mine = RankRecord(
        rank,
        done.losses,
        records,
        done.peak_activations,
        done.peak_weights,
        final_parameters(config, workers),
        eval_losses=milestones.eval_losses,
        log_failure=log.failure,
    )
    mine.versions = done.versions
    mine.averaging = [(s, n, (t0 - offset) * 1e-9, (t1 - offset) * 1e-9) for s, n, t0, t1 in done.averaging]
    mine.step_ends = [group[-1][4] if group else 0.0 for group in records]
    run = gather_run(config, mine, context, started, plan.steps_done, plan.updates_done)
    if run is not None:
        run.paused_s = close_pauses(run)
        run.save_failures, run.final_save_failure = milestones.save_failures, milestones.final_save_failure
    return run


def _run_stream(
    plan: RunPlan,
    stream: Schedule,
    segment: tuple[int, int],
    context: RankContext,
    workers: dict[int, StageWorker],
    source: Any,
    policy: RankPolicy,
    done: _Streamed,
) -> None:
    """Run one stream of the run (``segment``: its first mini-batch of this run, and how many) into ``done``.

    Data-parallel replicas around the stream (``joined.outside``) each run their piece of every microbatch.
    """
    (first, steps), t = segment, plan.config.schedule.num_microbatches
    joined, device = context.mesh, context.device
    assert joined is not None
    piece = (joined.dp_rank, joined.data_parallel) if joined.outside else (0, 1)
    sizes = replica_microbatch_sizes(plan.config, piece[0]) if joined.outside else plan.microbatch_sizes
    for w in workers.values():
        w.start_at(plan.steps_done + first)  # dropout keys: (steps before the stream, microbatch in it)
    # AvgPipe's replicas train apart (averaged by the policy): no gradient sums between them. PipeDream's
    # hybrid: every update sums the gradients of the replicas laid out around the stream; its replicated
    # stages (1F1B-RR): every update averages those of the part's replicas, as DDP does in PipeDream.
    executor = Executor(
        lower(stream),
        joined.stage_rank,
        workers,
        sizes[: stream.num_microbatches],
        device,
        policy=policy,
        combine_replicas=False,
        context=context,
        sum_over=joined.dp_group if joined.outside else None,
        average_over=_part_group(stream, joined) if averages_replicas(stream) else None,
    )
    data, targets = (
        StreamData(
            source,
            num_microbatches=t,
            length=stream.num_microbatches,
            part=part,
            device=device,
            first=plan.steps_done + first,
            piece=piece,
        )
        for part in (0, 1)
    )
    _, ran = executor.run_step(data, targets)
    mine = {j: float(x) for j, x in executor.losses_by_microbatch.items()}
    done.losses += minibatch_losses(mine, t, steps)
    done.timings += [(done.position.shift(a), t0, t1) for a, t0, t1 in ran]
    done.versions.update(done.position.versions(policy.versions))
    done.peak_activations = max(done.peak_activations, executor.peak_activation_bytes)
    done.peak_weights = max(done.peak_weights, policy.peak_weight_bytes)
    done.position.advance(stream, t)


def _part_group(stream: Schedule, mesh: Any) -> Any:
    """The group of the replicas of this rank's part (1F1B-RR, one stage per rank), None for an unreplicated one."""
    (stage,) = stream.placement.stages_on(mesh.stage_rank)
    return mesh.replica_groups.get(stream.placement.stage_part[stage])


def _exchange(stream: Schedule, mesh: Any) -> CollectiveExchange | None:
    """AvgPipe on ranks of their own: its replicas average by an all-reduce over their ranks' groups."""
    if stream.policy is not WeightPolicy.AVERAGING or not mesh.replica_groups:
        return None
    return CollectiveExchange(mesh.replica_groups, len(stream.placement.replicas(0)))
