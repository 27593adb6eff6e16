"""Weight-version policies at run time: the weights each F/B/I/W computes with, for both executors.

The executors call one narrow hook per compute action of a rank (``RankPolicy``):
``enter(a)`` before it and ``exit(a)`` after it. For ``F``/``B``/``I``/``W``
``enter`` makes the stage's parameters hold the weights the policy says the
action reads (DESIGN.md's table, ``sim.versions.read_versions``) and records
that version; ``exit`` puts the live weights back and frees what is no longer
needed. For ``U`` they bracket the optimizer step (copy a version aside,
velocity, step size, averaging). Synchronous schedules get no hook.

How weights are swapped: the layers keep their ``Parameter`` objects on the
autograd context (``models.layers``), not copies, so a backward computes with
whatever the parameter holds when it runs. ``enter`` points ``p.data`` at the
chosen tensors and ``exit`` points it back at the live ones, which the
optimizer updates in place.

The tensor code of each policy is in ``weights/`` (``stash``, ``double_buffer``,
``wpipe``, ``pipemare``, ``prediction``, ``avgpipe``); this module binds it to
a schedule's actions: which version each action reads, when a version is
copied aside or freed, when a stage updates or averages.

| policy | F | B / I / W | held per stage (M_theta) |
|---|---|---|---|
| stash, 2BW, WPipe | live | the copy F read | live + copies still read |
| vertical sync | the version stage 0 read | same | as stash, pending forwards too |
| none (AMPNet), averaging (AvgPipe) | live | live | 1 (AvgPipe: P replicas per rank) |
| discrepancy correction (PipeMare) | live | live - gap x velocity, in place | 2 (velocity) |
| prediction (SpecTrain) | live - s x direction | same | 2 (prediction buffer) |
| prediction, bellwether (XPipe) | cached per mini-batch and pass | same | 1 + live caches |

Prediction needs an optimizer with a next-step direction (momentum SGD, Adam,
AdamW); plain SGD is refused. Weight memory is measured after every action,
before its releases: the peak over a rank of the sum of its stages' held bytes.

A run that evaluates or saves drains its stream there and starts the next
one (``runtime.stream``); what one stream's policy hands the next, or a
checkpoint, is a ``StreamCarry``: the updates made (the learning-rate
schedule's and AvgPipe's count), PipeMare's annealing count and velocity.
A stash, a double buffer or a prediction holds nothing once drained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipeweave.errors import UserError
from pipeweave.runtime.stage.lr_schedule import set_lr
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Action, Op, Schedule, WeightPolicy
from pipeweave.sim.versions import applied_to, current_versions, staleness
from pipeweave.weights.avgpipe import default_alpha, elastic_average
from pipeweave.weights.double_buffer import DoubleBuffer
from pipeweave.weights.pipemare import DEFAULT_ANNEAL_STEPS, DEFAULT_DECAY, DiscrepancyCorrection, rescheduled_lr
from pipeweave.weights.prediction import check_predictable, predict_weights
from pipeweave.weights.stash import VerticalSyncStash, WeightStash
from pipeweave.weights.wpipe import weights_for_part

Read = tuple[int, int]  # (stored version, version it stands for): sim.versions.VersionRead's fields


@dataclass(frozen=True, kw_only=True)
class PolicyOptions:
    """Run-time hyperparameters of the asynchronous policies (the schedules carry the rest)."""

    anneal_steps: int = DEFAULT_ANNEAL_STEPS
    """PipeMare K: updates over which the rescheduled step size returns to lr (0: no rescheduling)."""
    decay: float = DEFAULT_DECAY
    """PipeMare gamma: weight of the old velocity in the moving average of updates."""
    correction: bool = True
    """PipeMare: discrepancy correction of the backward weights."""
    averaging_rate: float | None = None
    """AvgPipe alpha: pull toward the replicas' mean (None: 0.9 / P, EASGD's beta = 0.9)."""
    averaging_period: int = 1
    """AvgPipe: rounds of updates between two averagings."""

    def __post_init__(self) -> None:
        if self.anneal_steps < 0:
            raise UserError(f"--anneal-steps {self.anneal_steps} is invalid; give K >= 0 (0: no rescheduling)")
        if not 0.0 <= self.decay < 1.0:
            raise UserError(f"--decay {self.decay} is invalid; give 0 <= gamma < 1")
        if self.averaging_rate is not None and not 0.0 <= self.averaging_rate <= 1.0:
            raise UserError(f"--averaging-rate {self.averaging_rate} is invalid; give 0 <= alpha <= 1")
        if self.averaging_period < 1:
            raise UserError(f"--averaging-period {self.averaging_period} is invalid; give an integer >= 1")


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

    def __init__(self, worker: StageWorker, store: WeightStash, tables: ScheduleTables, stage: int, vertical: bool) -> None:
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


class _Corrected(_Stage):
    """PipeMare: step size rescheduled by the stage's delay; backward weights extrapolated back."""

    def __init__(self, worker: StageWorker, tables: ScheduleTables, stage: int, options: PolicyOptions,
                 carry: StreamCarry) -> None:
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
            group["lr"] = lr if k < 0 or self.options.anneal_steps == 0 else rescheduled_lr(
                lr, self.delay, self.annealed + k, self.options.anneal_steps)
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


def _stage_state(schedule: Schedule, stage: int, worker: StageWorker, tables: ScheduleTables,
                 options: PolicyOptions, carry: StreamCarry) -> _Stage:
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
        return _Corrected(worker, tables, stage, options, carry)
    if policy is WeightPolicy.BELLWETHER_PREDICTION:
        return _Bellwether(worker, tables)
    if policy is WeightPolicy.PREDICTION:
        return _Predicted(worker, tables)
    if policy in (WeightPolicy.NONE, WeightPolicy.AVERAGING):
        return _Stage(worker)
    raise ValueError(f"no run-time policy for {policy}")


class RankPolicy:
    """The hook one rank's executor calls around each compute action of an asynchronous schedule.

    Args:
        schedule: the (asynchronous) schedule.
        workers: this rank's stage workers, by stage.
        options: PipeMare's and AvgPipe's hyperparameters.
        lr_at: the learning rate of a stage's k-th update (``LrSchedule.at``), before PipeMare's
            rescheduling; None keeps the optimizer's.
        carry: what the run's previous stream (or a checkpoint) left (``StreamCarry``).

    Attributes:
        versions: per F/B/I/W run, ``(version, target)`` as ``sim.versions.read_versions`` defines them.
        peak_weight_bytes: the most weight bytes (every version and extra buffer) the rank held at once.

    Example:
        policy = RankPolicy(schedule, workers)
        policy.enter(a); run(a); policy.exit(a)
    """

    def __init__(self, schedule: Schedule, workers: dict[int, StageWorker], options: PolicyOptions | None = None,
                 tables: ScheduleTables | None = None, lr_at: Callable[[int], float] | None = None,
                 carry: StreamCarry | None = None) -> None:
        self.options = options or PolicyOptions()
        self.lr_at = lr_at
        self.before = carry or StreamCarry()
        tables = tables or ScheduleTables(schedule)
        self.schedule = schedule
        self.states = {s: _stage_state(schedule, s, w, tables, self.options, self.before) for s, w in workers.items()}
        self.bytes = {s: w.weight_bytes() for s, w in workers.items()}
        self.versions: dict[Action, Read] = {}
        self.peak_weight_bytes = 0
        self._live: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its live data) while swapped
        self._averaging = self._averaging_groups(schedule, workers)

    def enter(self, a: Action) -> None:
        state = self.states[a.stage]
        if a.op is Op.U:
            if self.lr_at is not None:
                state.set_base_lr(self.lr_at(self.before.updates + state.version))
            state.before_update()
            return
        tensors, read = state.read(a)
        self.versions[a] = read
        if tensors is not None:
            for p, t in zip(state.params, tensors):
                self._live.append((p, p.data))
                p.data = t

    def exit(self, a: Action) -> None:
        state = self.states[a.stage]
        if a.op is Op.U:
            state.after_update()
            self._average(a.stage)
        self._measure()
        for p, live in self._live:
            p.data = live
        self._live.clear()
        if a.op is not Op.U:
            state.done(a)

    def carry(self) -> StreamCarry:
        """What this stream leaves the next (call it once the stream has drained)."""
        updates = max((state.version for state in self.states.values()), default=0)  # every stage makes as many
        corrected = {s: state for s, state in self.states.items() if isinstance(state, _Corrected)}
        annealed = self.before.annealed + max((max(0, c.version - c.warmup) for c in corrected.values()), default=0)
        return StreamCarry(self.before.updates + updates, annealed,
                           {s: [v.clone() for v in c.correction.velocity] for s, c in corrected.items()})

    def held_bytes(self) -> int:
        """Weight bytes held now by this rank's stages."""
        return sum(state.copies() * self.bytes[s] for s, state in self.states.items())

    def _measure(self) -> None:
        self.peak_weight_bytes = max(self.peak_weight_bytes, self.held_bytes())

    # ---- AvgPipe -------------------------------------------------------------------
    def _averaging_groups(self, schedule: Schedule, workers: dict[int, StageWorker]) -> dict[int, tuple[int, ...]]:
        if schedule.policy is not WeightPolicy.AVERAGING:
            return {}
        groups = {s: schedule.placement.replicas(s) for s in workers}
        for s, replicas in groups.items():
            if not set(replicas) <= set(workers):
                raise UserError(f"avgpipe: the replicas {replicas} of stage {s} must share its rank")
        self._rounds: dict[int, int] = {}
        return groups

    def _average(self, stage: int) -> None:
        """AvgPipe: once every replica of the part has made round r's update, pull them together."""
        replicas = self._averaging.get(stage)
        if not replicas or len(replicas) < 2:
            return
        part = self.schedule.placement.stage_part[stage]
        done = min(self.states[s].version for s in replicas)
        if done <= self._rounds.get(part, 0):
            return
        self._rounds[part] = done
        if (self.before.updates + done) % self.options.averaging_period == 0:
            alpha = self.options.averaging_rate
            alpha = default_alpha(len(replicas)) if alpha is None else alpha
            elastic_average([self.states[s].params for s in replicas], alpha)
