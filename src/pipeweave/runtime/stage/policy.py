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
| prediction (SpecTrain) | the optimizer's next step taken s times | same | 2 (prediction buffer) |
| prediction, bellwether (XPipe) | cached per mini-batch and pass | same | 1 + live caches |

Prediction follows any optimizer of ``weights.optimizers`` (its next step from
its state); plain SGD, which has none, is refused. Weight memory is measured after every action,
before its releases: the peak over a rank of the sum of its stages' held bytes.

A run that evaluates or saves drains its stream there and starts the next
one (``runtime.stream``); what one stream's policy hands the next, or a
checkpoint, is a ``StreamCarry``: the updates made (the learning-rate
schedule's and AvgPipe's count), PipeMare's annealing count and velocity.
A stash, a double buffer or a prediction holds nothing once drained.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeweave.errors import UserError
from pipeweave.runtime.stage.averaging import DelayedAveraging, Exchange
from pipeweave.runtime.stage.reads import Corrected, PolicyOptions, Read, ScheduleTables, StreamCarry, stage_reads
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Action, Op, Schedule, WeightPolicy
from pipeweave.weights.avgpipe import default_alpha, elastic_average

# What a run configures and carries between streams, defined beside the per-stage adapters (stage.reads).
__all__ = ["PolicyOptions", "RankPolicy", "Read", "ScheduleTables", "StreamCarry"]


class RankPolicy:
    """The hook one rank's executor calls around each compute action of an asynchronous schedule.

    Args:
        schedule: the (asynchronous) schedule.
        workers: this rank's stage workers, by stage.
        options: PipeMare's and AvgPipe's hyperparameters.
        lr_at: the learning rate of a stage's k-th update (``LrSchedule.at``), before PipeMare's
            rescheduling; None keeps the optimizer's.
        carry: what the run's previous stream (or a checkpoint) left (``StreamCarry``).
        exchange: AvgPipe on ranks of their own: how this rank's replicas meet the others
            (``runtime.stage.averaging``).

    Attributes:
        versions: per F/B/I/W run, ``(version, target)`` as ``sim.versions.read_versions`` defines them.
        peak_weight_bytes: the most weight bytes (every version and extra buffer) the rank held at once.

    Example:
        policy = RankPolicy(schedule, workers)
        policy.enter(a); run(a); policy.exit(a)
    """

    def __init__(
        self,
        schedule: Schedule,
        workers: dict[int, StageWorker],
        options: PolicyOptions | None = None,
        tables: ScheduleTables | None = None,
        lr_at: Callable[[int], float] | None = None,
        carry: StreamCarry | None = None,
        exchange: Exchange | None = None,
    ) -> None:
        self.options = options or PolicyOptions()
        self.lr_at = lr_at
        self.before = carry or StreamCarry()
        tables = tables or ScheduleTables(schedule)
        self.schedule = schedule
        self.states = {s: stage_reads(schedule, s, w, tables, self.options, self.before) for s, w in workers.items()}
        self.bytes = {s: w.weight_bytes() for s, w in workers.items()}
        self.versions: dict[Action, Read] = {}
        self.peak_weight_bytes = 0
        self._live: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its live data) while swapped
        self._delayed = self._delayed_averaging(schedule, workers, exchange)
        self._averaging = {} if self._delayed else self._averaging_groups(schedule, workers)

    def enter(self, a: Action) -> None:
        state = self.states[a.stage]
        if a.op is Op.U:
            if self.lr_at is not None:
                state.set_base_lr(self.lr_at(self.before.updates + state.version))
            if self._delayed:
                self._delayed.apply(a.stage, state.params)
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
            if self._delayed:
                self._delayed.after_update(a.stage, self.before.updates + state.version, state.params)
        self._measure()
        for p, live in self._live:
            p.data = live
        self._live.clear()
        if a.op is not Op.U:
            state.done(a)

    def carry(self) -> StreamCarry:
        """What this stream leaves the next (call it once the stream has drained; an averaging still in flight
        is applied first)."""
        if self._delayed:
            self._delayed.drain({s: state.params for s, state in self.states.items()})
        updates = max((state.version for state in self.states.values()), default=0)  # every stage makes as many
        corrected = {s: state for s, state in self.states.items() if isinstance(state, Corrected)}
        annealed = self.before.annealed + max((max(0, c.version - c.warmup) for c in corrected.values()), default=0)
        return StreamCarry(
            self.before.updates + updates,
            annealed,
            {s: [v.clone() for v in c.correction.velocity] for s, c in corrected.items()},
        )

    def held_bytes(self) -> int:
        """Weight bytes held now by this rank's stages."""
        return sum(state.copies() * self.bytes[s] for s, state in self.states.items())

    def _measure(self) -> None:
        self.peak_weight_bytes = max(self.peak_weight_bytes, self.held_bytes())

    # ---- AvgPipe -------------------------------------------------------------------
    @property
    def averaging_events(self) -> list[tuple[int, int, int, int]]:
        """AvgPipe on ranks of their own: per exchange, (stage, round, start ns, end ns) (``DelayedAveraging``)."""
        return self._delayed.events if self._delayed else []

    def waiting_on(self, stage: int) -> tuple[int, int] | None:
        """AvgPipe on ranks of their own: (part, round) of the averaging the stage's next ``U`` applies, or None."""
        return self._delayed.waiting_on(stage) if self._delayed else None

    def _delayed_averaging(
        self, schedule: Schedule, workers: dict[int, StageWorker], exchange: Exchange | None
    ) -> DelayedAveraging | None:
        placement = schedule.placement
        if schedule.policy is not WeightPolicy.AVERAGING or not workers:
            return None
        replicas = placement.replicas(next(iter(workers)))
        if len(replicas) < 2 or len({placement.stage_rank[s] for s in replicas}) == 1:
            return None  # the replicas share a rank: averaged in place (``_average``)
        if exchange is None:
            raise UserError("avgpipe with pipelines on ranks of their own needs an exchange between its replicas")
        part_of = {s: placement.stage_part[s] for s in workers}
        alpha = self.options.averaging_rate
        return DelayedAveraging(exchange, part_of, len(replicas), self.options.averaging_period, alpha)

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
