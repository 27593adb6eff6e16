"""Which weights each action of one stage reads, per weight policy (the per-stage half of ``stage.policy``).

``stage_reads`` picks, for a stage of an asynchronous schedule, the adapter of
its policy: ``read(a)`` gives the tensors action ``a`` computes with (None:
the live ones) and the version they stand for, ``done(a)`` frees what no later
action reads, ``before_update``/``after_update`` bracket the optimizer step.
``ScheduleTables`` holds what they look up in the schedule (versions,
staleness), computed once per stream; ``PolicyOptions`` the policies' run-time
hyperparameters and ``StreamCarry`` what one stream hands the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeweave.config.policy import PolicyOptions  # noqa: F401  (re-exported: a section of the configuration)
from pipeweave.runtime.stage.lr_schedule import set_lr
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Action, Op, Schedule, WeightPolicy
from pipeweave.sim.versions import applied_to, current_versions, staleness
from pipeweave.weights.double_buffer import DoubleBuffer
from pipeweave.weights.pipemare import DiscrepancyCorrection, rescheduled_lr
from pipeweave.weights.prediction import check_predictable, predict_weights
from pipeweave.weights.stash import VerticalSyncStash, WeightStash
from pipeweave.weights.wpipe import weights_for_part

Read = tuple[int, int]  # (stored version, version it stands for): sim.versions.VersionRead's fields


@dataclass
class StreamCarry:
    """What a drained stream's policy hands the next stream of the run (``RankPolicy.carry``).

    Attributes:
        updates: updates every stage made before this stream (k of the learning-rate schedule,
            AvgPipe's averaging rounds).
        annealed: PipeMare: updates after its synchronous warm-up (k of the step-size rescheduling).
        velocity: PipeMare: per stage, its moving average of updates, in parameter order.
    """

    updates: int = 0
    annealed: int = 0
    velocity: dict[int, list[torch.Tensor]] = field(default_factory=dict)


class ScheduleTables:
    """What every rank derives from the order alone, once per schedule."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.target = applied_to(schedule)  # (stage, mb) -> the update its gradient goes into
        self.now = current_versions(schedule)
        corrected = schedule.policy is WeightPolicy.DISCREPANCY_CORRECTION
        self.delay = staleness(schedule) if corrected else ()
        self.warmup = _warmup_updates(schedule) if corrected else 0
        self.last: dict[tuple[int, int], Action] = {}  # (stage, mb) -> its last backward action
        self.last_of_pass: dict[tuple[int, bool, int], Action] = {}  # XPipe: (stage, is F, k) -> last action
        for row in schedule.actions:
            for a in row:
                if a.op.is_backward:
                    self.last[(a.stage, a.microbatch)] = a
                if a.op is not Op.U:
                    k = self.target.get((a.stage, a.microbatch), self.now[a])
                    self.last_of_pass[(a.stage, a.op is Op.F, k)] = a

    def stage0_version(self, microbatch: int) -> int:
        """Vertical sync: the version stage 0 of the microbatch's pipeline reads (PipeDream sends it along)."""
        return self.now[Action(self.schedule.route(microbatch)[0], Op.F, microbatch)]


class _Stage:
    """One stage's policy state; the base reads the live weights (AMPNet, AvgPipe)."""

    def __init__(self, worker: StageWorker) -> None:
        self.worker = worker
        self.params = list(worker.module.parameters())
        self.version = 0  # updates done: the live weights are this version

    def read(self, a: Action) -> tuple[list[torch.Tensor] | None, Read]:
        """The tensors ``a`` computes with (None: the live ones) and the version they are."""
        return None, (self.version, self.version)

    def done(self, a: Action) -> None:
        """After ``a`` (and after the live weights are back)."""

    def set_base_lr(self, lr: float) -> None:
        """The learning rate of the coming update before the policy's own changes (``--lr-schedule``)."""
        set_lr(self.worker.optimizer, lr)

    def before_update(self) -> None:
        pass

    def after_update(self) -> None:
        self.version += 1

    def copies(self) -> int:
        """Weight-sized buffers held now, the live weights included."""
        return 1


class _Stored(_Stage):
    """Stash, vertical sync, double buffer: the backward reads the copy its forward read."""

    def __init__(
        self, worker: StageWorker, store: WeightStash, tables: ScheduleTables, stage: int, vertical: bool
    ) -> None:
        super().__init__(worker)
        self.store, self.tables, self.stage, self.vertical = store, tables, stage, vertical

    def read(self, a: Action) -> tuple[list[torch.Tensor] | None, Read]:
        j = a.microbatch
        if a.op is Op.F:
            first = self.tables.schedule.route(j)[0] == self.stage
            version = self.tables.stage0_version(j) if self.vertical and not first else None
            tensors = self.store.weights_for_forward(j, version)
        else:
            tensors = self.store.weights_for_backward(j)
        v = self.store.read_version(j)
        return (None if tensors is self.store.params else tensors), (v, v)

    def done(self, a: Action) -> None:
        if self.tables.last.get((a.stage, a.microbatch)) == a:
            self.store.release(a.microbatch)

    def before_update(self) -> None:
        self.store.before_update()

    def after_update(self) -> None:
        super().after_update()
        self.store.after_update()

    def copies(self) -> int:
        return self.store.versions_held()


class Corrected(_Stage):
    """PipeMare: step size rescheduled by the stage's delay; backward weights extrapolated back."""

    def __init__(
        self, worker: StageWorker, tables: ScheduleTables, stage: int, options: PolicyOptions, carry: StreamCarry
    ) -> None:
        super().__init__(worker)
        self.correction = DiscrepancyCorrection(self.params, decay=options.decay, velocity=carry.velocity.get(stage))
        self.annealed = carry.annealed
        self.delay = tables.delay[stage]
        self.options = options
        self.warmup = tables.warmup
        self.base_lr = [float(g["lr"]) for g in worker.optimizer.param_groups]
        self.forward_version: dict[int, int] = {}
        self.applied = 0  # gap applied in place by the running backward

    def read(self, a: Action) -> tuple[list[torch.Tensor] | None, Read]:
        if a.op is Op.F:
            self.forward_version[a.microbatch] = self.version
            return None, (self.version, self.version)
        f = self.forward_version[a.microbatch]
        gap = self.version - f
        if gap and self.options.correction and a.op is not Op.W:  # W reads no weights
            self.correction.extrapolate(gap)  # in place: no third copy
            self.applied = gap
        return None, (self.version, f)

    def done(self, a: Action) -> None:
        if self.applied:
            self.correction.restore(self.applied)
            self.applied = 0
        if a.op.computes_weight_grad:  # the microbatch's last backward
            self.forward_version.pop(a.microbatch, None)

    def set_base_lr(self, lr: float) -> None:
        self.base_lr = [lr] * len(self.base_lr)  # PipeMare's rescheduling scales the scheduled rate

    def before_update(self) -> None:
        k = self.version - self.warmup  # the synchronous warm-up keeps lr; the stream's updates count from 0
        for group, lr in zip(self.worker.optimizer.param_groups, self.base_lr):
            group["lr"] = (
                lr
                if k < 0 or self.options.anneal_steps == 0
                else rescheduled_lr(lr, self.delay, self.annealed + k, self.options.anneal_steps)
            )
        self.correction.before_update()

    def after_update(self) -> None:
        super().after_update()
        self.correction.after_update()
        for group, lr in zip(self.worker.optimizer.param_groups, self.base_lr):
            group["lr"] = lr  # the rescheduled rate was this update's: the next stream reads the base rate

    def copies(self) -> int:
        return 2


def _warmup_updates(schedule: Schedule) -> int:
    """PipeMare: mini-batches of the synchronous warm-up, read from the order.

    A warm-up mini-batch m ends in a flush: on the first stage, no forward of
    mini-batch m + 1 runs before its update ``U(0, m)``; in the stream, the
    next mini-batch's forwards run ahead of it. A stream whose every
    mini-batch is flushed (all warm-up, or a single mini-batch) is all warm-up.
    """
    first = schedule.route(0)[0]
    row = schedule.actions[schedule.placement.stage_rank[first]]
    t = schedule.num_microbatches // max(1, schedule.num_steps)
    updates = [i for i, a in enumerate(row) if a.stage == first and a.op is Op.U]
    warm = 0
    for m, u in enumerate(updates[:-1]):
        if any(a.stage == first and a.op is Op.F and a.microbatch >= (m + 1) * t for a in row[:u]):
            return warm
        warm = m + 1
    return len(updates)


class _Predicted(_Stage):
    """SpecTrain: each action predicts the weights s updates ahead into one persistent buffer."""

    def __init__(self, worker: StageWorker, tables: ScheduleTables) -> None:
        super().__init__(worker)
        check_predictable(worker.optimizer)
        self.tables = tables
        self.buffer = [torch.empty_like(p) for p in self.params]

    def read(self, a: Action) -> tuple[list[torch.Tensor] | None, Read]:
        k = self.tables.target.get((a.stage, a.microbatch), self.version)
        s = k - self.version
        if s == 0 or a.op is Op.W:  # W reads no weights
            return None, (self.version, k)
        predict_weights(self.worker.optimizer, self.params, s, out=self.buffer)
        return self.buffer, (self.version, k)

    def copies(self) -> int:
        return 2


class _Bellwether(_Stage):
    """XPipe: the first microbatch of a mini-batch predicts once per pass; the others reuse it."""

    def __init__(self, worker: StageWorker, tables: ScheduleTables) -> None:
        super().__init__(worker)
        check_predictable(worker.optimizer)
        self.tables = tables
        self.cache: dict[tuple[bool, int], tuple[list[torch.Tensor], int]] = {}

    def _key(self, a: Action) -> tuple[bool, int]:
        return a.op is Op.F, self.tables.target.get((a.stage, a.microbatch), self.version)

    def read(self, a: Action) -> tuple[list[torch.Tensor] | None, Read]:
        key = self._key(a)
        if key not in self.cache:  # the bellwether
            s = key[1] - self.version
            self.cache[key] = (predict_weights(self.worker.optimizer, self.params, s), self.version)
        tensors, version = self.cache[key]
        return tensors, (version, key[1])

    def done(self, a: Action) -> None:
        key = self._key(a)
        if self.tables.last_of_pass.get((a.stage, *key)) == a:
            del self.cache[key]

    def copies(self) -> int:
        return 1 + len(self.cache)


def stage_reads(
    schedule: Schedule,
    stage: int,
    worker: StageWorker,
    tables: ScheduleTables,
    options: PolicyOptions,
    carry: StreamCarry,
) -> _Stage:
    policy = schedule.policy
    params = list(worker.module.parameters())
    if policy is WeightPolicy.STASH:
        return _Stored(worker, WeightStash(params), tables, stage, vertical=False)
    if policy is WeightPolicy.VERTICAL_SYNC:
        pending = {j: tables.stage0_version(j) for j in schedule.microbatches_of(stage)}
        return _Stored(worker, VerticalSyncStash(params, pending), tables, stage, vertical=True)
    if policy is WeightPolicy.DOUBLE_BUFFER:
        part = schedule.placement.stage_part[stage]
        grouped = schedule.num_parts == 2 * schedule.num_ranks  # WPipe's two groups
        store = weights_for_part(part, schedule.num_ranks, params) if grouped else DoubleBuffer(params)
        return _Stored(worker, store, tables, stage, vertical=False)
    if policy is WeightPolicy.DISCREPANCY_CORRECTION:
        return Corrected(worker, tables, stage, options, carry)
    if policy is WeightPolicy.BELLWETHER_PREDICTION:
        return _Bellwether(worker, tables)
    if policy is WeightPolicy.PREDICTION:
        return _Predicted(worker, tables)
    if policy in (WeightPolicy.NONE, WeightPolicy.AVERAGING):
        return _Stage(worker)
    raise ValueError(f"no run-time policy for {policy}")
