"""A distributed training run: what every rank does in it.

``run_rank(context, plan)`` is the function each rank runs (``launch``
starts it): build its stage workers, align clocks, train ``steps`` steps
through the ``Executor`` -- evaluating and saving where due
(``Milestones``), stopping where the loss is not finite (``Divergence``) --
and gather everything measured to rank 0, which returns
it as a ``RunRecord``. An asynchronous schedule runs as streams instead
(``stream_job.run_stream_rank``). The ``RunPlan`` comes from
``prepare.prepare(config)``, run once before anything is spawned.

Example::

    plan = prepare(TrainConfig(schedule="zb-h1", num_stages=2, steps=30))
    record = launch(run_rank, plan, plan.schedule.num_ranks)
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from pipeweave.config import TrainConfig
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.executor import Executor
from pipeweave.runtime.loss_scale import LossScale, LossScaling
from pipeweave.runtime.run import checkpoint
from pipeweave.runtime.run.agreement import agreed_plan
from pipeweave.runtime.run.divergence import Divergence
from pipeweave.runtime.run.milestones import Milestones, rank_microbatches
from pipeweave.runtime.run.part_memory import part_memory
from pipeweave.runtime.run.prepare import RunPlan, learning_rates, offloaded, run_data
from pipeweave.runtime.run.pretrained_save import save_parts
from pipeweave.runtime.run.record import RankRecord, RunRecord, final_parameters, gather_run, seconds_since
from pipeweave.runtime.run.step_log import StepLog
from pipeweave.runtime.run.stream_job import run_stream_rank
from pipeweave.runtime.run.workers import build_workers, join_mesh
from pipeweave.runtime.stage.lr_schedule import set_lr
from pipeweave.runtime.stage.tensor_bytes import peak_tensor_bytes
from pipeweave.runtime.transport.clock import align_clocks
from pipeweave.runtime.transport.partner import PartnerLink, pair_groups
from pipeweave.schedule import lower
from pipeweave.schedule.ir import Op
from pipeweave.schedule.levers import Stash, StashPlan, lower_stash, partner, plan_stash
from pipeweave.schedule.lower import LoweredSchedule
from pipeweave.sim.cost import CostModel
from pipeweave.sim.levers import balanced_shares


def lowered(plan: RunPlan) -> tuple[LoweredSchedule, Stash | None]:
    """The plan's schedule lowered, with its memory actions (``schedule.levers``) where asked."""
    low = lower(plan.schedule)
    config = plan.config
    levers = StashPlan(offload=offloaded(config, plan.schedule), balance=config.memory.balance_activations)
    if not levers.offload and not levers.balance:
        return low, None
    held, mem_w, shares = None, 0.5, None
    if levers.balance:  # BPipe's shares from each part's bytes per microbatch (measured before spawning, cached)
        parts = part_memory(config, plan.parts, ("I",) if any(a.op is Op.I for a in plan.schedule.actions[0]) else ())
        held = [float(p.held) for p in parts]
        mem_w = min(1.0, max(p.stash / p.held if p.held else 0.0 for p in parts))
        costs = CostModel(activation=held, mem_w=mem_w).for_parts(
            num_parts=plan.schedule.num_parts, num_ranks=plan.schedule.num_ranks
        )
        shares = balanced_shares(plan.schedule, costs, levers)
    stash = plan_stash(plan.schedule, levers, held, mem_w, shares)
    return lower_stash(low, stash), stash


def partner_link(stash: Stash | None, rank: int, workers: dict[int, Any]) -> PartnerLink | None:
    """This rank's side of BPipe's pair (``transport.partner``); every rank creates every pair's group."""
    assert stash is not None
    num_ranks = stash.schedule.num_ranks
    groups = pair_groups(num_ranks)
    other = partner(rank, num_ranks)
    if other is None or not (stash.share[rank] > 0 or stash.share[other] > 0):
        return None  # alone, or a pair already balanced: nothing to lend
    link = PartnerLink(
        other,
        groups[rank],
        owner=stash.share[rank] > 0,
        held_now=lambda: sum(w.activation_bytes() for w in workers.values()),
    )
    link.share = stash.share[rank]
    return link


def _end_levers(link: PartnerLink | None, executor: Executor) -> int:
    """Close BPipe's link and the offload store (a rank ends without running finalizers); the rank's peak
    activation bytes, what it held for its BPipe owner included."""
    if link is not None:
        link.close()
    if executor.store is not None:
        executor.store.close()
    return max(executor.peak_activation_bytes, link.peak if link is not None else 0)


def executor_of(
    plan: RunPlan, context: RankContext, workers: dict[int, Any], low: LoweredSchedule, stash: Stash | None
) -> tuple[Executor, PartnerLink | None]:
    """The rank's executor of ``low`` with the run's options, the checkpoint resumed into its workers, and its
    side of BPipe's pair (None without ``--balance-activations``)."""
    config, rank = plan.config, context.stage_rank
    link = partner_link(stash, rank, workers) if config.memory.balance_activations else None
    executor = Executor(
        low,
        rank,
        workers,
        plan.microbatch_sizes,
        context.device,
        context=context,
        loss_scale=_loss_scale(plan, context.device),
        on_nonfinite=config.training.on_nonfinite,
        bucket_bytes=int(config.parallel.bucket_mb * 2**20),
        zero=config.parallel.zero,
        clip_norm=_clip_norm(config),
        partner=link,
        variable_shapes=config.variable_shapes,
    )
    if config.checkpoint.resume is not None:  # the workers were built sharded (ZeRO): the optimizers it loads into
        assert plan.resumed is not None
        checkpoint.load(plan.resumed.folder, plan.resumed.manifest, workers)
    return executor, link


def _scaled(scaling: LossScaling | None) -> tuple[list[int], list[float]]:
    """fp16's record: the steps that overflowed and each step's loss scale (nothing without loss scaling)."""
    if scaling is None:
        return [], []
    return [k for k, o in enumerate(scaling.overflowed) if o], list(scaling.scales)


def _loss_scale(plan: RunPlan, device: Any) -> LossScale | None:
    """``--precision fp16``'s loss scale (``runtime.loss_scale``), the resumed checkpoint's where it has one."""
    training = plan.config.training
    if training.precision != "fp16":
        return None
    scale = LossScale(
        training.loss_scale,
        growth_factor=training.loss_scale_growth,
        backoff_factor=training.loss_scale_backoff,
        growth_interval=training.loss_scale_interval,
        device=device,
    )
    saved = None if plan.resumed is None else plan.resumed.manifest.get("loss_scale")
    if saved is not None:
        scale.load_state_dict(saved)
    return scale


def run_rank(context: RankContext, plan: RunPlan) -> RunRecord | None:
    """Train on this process; process 0 returns the gathered ``RunRecord``, the others None.

    ``context.world`` is P x D x N processes; each plays stage rank ``process // N`` of the schedule
    (``transport.mesh``), the N of a tensor-parallel group alike on their shards, on rank 0's split.
    """
    plan = agreed_plan(plan)  # every rank builds rank 0's split, or every rank stops here in one line
    config = plan.config
    if config.is_stream:
        return run_stream_rank(context, plan)
    started = time.perf_counter()
    context = join_mesh(plan, context)
    process, world, rank, device = context.process, context.world, context.stage_rank, context.device
    low, stash = lowered(plan)
    workers = build_workers(plan, rank, device, context=context, row=low.actions[rank])
    done = plan.steps_done  # the data goes on from the batch after the checkpoint's last (the workers' steps_done)
    executor, link = executor_of(plan, context, workers, low, stash)
    source = run_data(config)
    offset = align_clocks(process, world)
    t = plan.schedule.num_microbatches
    mine = RankRecord(rank, [], [], 0, 0, {})
    peaks: list[int] = []  # per measured step, the process's peak tensor bytes (stage.tensor_bytes)
    milestones = Milestones(plan, plan.schedule, context, workers, source)
    scaling = executor.scaling
    milestones.loss_scale = None if scaling is None else scaling.scale
    divergence = Divergence(plan, workers)
    rates = learning_rates(config, done) if config.training.lr_scheduled else None
    log = StepLog(plan, context, rates)
    for step in range(config.training.steps):
        if rates is not None:
            for w in workers.values():
                set_lr(w.optimizer, rates.at(done + step))
        measured = step == 0 or config.memory.memory_every_step
        with peak_tensor_bytes(device, peaks) if measured else contextlib.nullcontext():
            loss, timings = executor.run_step(*rank_microbatches(source, done + step, t, device, workers))
        row = seconds_since(timings, offset)
        keep = step < config.logging.trace_steps
        mine.add_step(loss, row, executor.step_cpu_ns, executor.action_cpu_ns, keep, executor.step_memory)
        mine.add_expert_traffic(workers)
        if step == 0 and not (config.memory.memory_every_step or config.variable_shapes):  # varying shapes: every step
            for w in workers.values():
                w.track_memory_from_now(False)
        log.after_step(step, loss, row)
        if context.reporting:  # a tensor-parallel group's processes run alike: one reports
            context.progress({"step": step, "loss": loss, "time": (timings[-1][2] - offset) * 1e-9})
        divergence.after_step(step, executor.step_loss, executor.overflowed)  # stops every rank, or counts a skip
        milestones.reached(step + 1)
    log.close()
    mine.log_failure = log.failure
    divergence.at_end(plan.schedule.placement)
    mine.peak_activation_bytes = _end_levers(link, executor)
    mine.peak_tensor_bytes = max(peaks, default=0)
    mine.gradient_bytes = executor.replicas.peak_gradient_bytes
    mine.weight_bytes = sum(w.weight_bytes() for w in workers.values())
    mine.parameters = final_parameters(config, workers)
    save_parts(config, context, workers, plan.schedule.num_ranks)
    mine.eval_losses = milestones.eval_losses
    mine.skipped_steps = divergence.skipped_steps
    mine.overflow_steps, mine.loss_scales = _scaled(scaling)
    run = gather_run(config, mine, context, started, done)
    if run is not None:
        run.save_failures, run.final_save_failure = milestones.save_failures, milestones.final_save_failure
    return run


def _clip_norm(config: TrainConfig) -> float | None:
    """The norm ``runtime.clip`` clips to (None where post-validation clips, or nothing does)."""
    return (
        config.training.post_validation.max_norm
        if config.clips_by_collective and config.training.post_validation
        else None
    )
