"""The reference executor: any schedule, every stage in one process, deterministically.

``run_reference`` trains a synchronous schedule step by step;
``run_stream_reference`` runs an asynchronous stream (or the streams of a run
that drains between them) once, its weight policy applied (``runtime.stream``).
Both walk the schedule in this process (``runtime.walk``). It is the oracle of
the distributed executor's tests and a fast path for convergence studies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeweave.data import DataSource, data_source, step_microbatches
from pipeweave.errors import UserError
from pipeweave.models.boundary import Boundary
from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.plain import TrainResult
from pipeweave.runtime.stage.averaging import LocalExchange
from pipeweave.runtime.stage.lr_schedule import set_lr
from pipeweave.runtime.stage.policy import PolicyOptions, RankPolicy, Read, ScheduleTables, StreamCarry
from pipeweave.runtime.stage.tied import TiedGradients
from pipeweave.runtime.stage.tied_stream import StreamTies
from pipeweave.runtime.stage.worker import Combine, OptimizerFactory, StageWorker
from pipeweave.runtime.stream import (
    StreamData,
    StreamPosition,
    check_stream_model,
    microbatches_per_minibatch,
    minibatch_losses,
)
from pipeweave.runtime.walk import Walk, build_workers, mean_replica_gradients, run_step, trained_parameters
from pipeweave.schedule.dataflow import consumed_gradients
from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.schedule.round_robin import averages_replicas, minibatch_pipelines
from pipeweave.sim.recompute import Recompute


def run_reference(
    schedule: Schedule,
    spec: ModelSpec,
    *,
    steps: int,
    batch_size: int,
    optimizer_factory: OptimizerFactory | None = None,
    seed: int = 0,
    recompute: Recompute = False,
    data: DataSource | None = None,
    parts: list[range] | None = None,
    precision: str = "fp32",
    lr_at: Callable[[int], float] | None = None,
) -> TrainResult:
    """Train with ``schedule`` for ``steps`` steps, every stage in this process.

    Args:
        schedule: a synchronous schedule (one step; it is repeated each step), or an
            asynchronous stream, run once (``steps`` = its mini-batches; default policy options).
        spec: the model.
        steps: optimizer steps.
        batch_size: samples per mini-batch, split into ``schedule.num_microbatches``.
        optimizer_factory: builds each stage's optimizer (default SGD, lr 0.1).
        seed: data seed.
        recompute: activation recomputation: one mode for every part or one per part (``sim.recompute``).
        data: a data source (default ``data_source(spec, ...)``).
        parts: layer range per part (default ``uniform_parts``).
        precision: ``fp32`` or ``bf16`` (``models.precision``).
        lr_at: the learning rate of step k (of a stream: of each stage's k-th update), ``LrSchedule.at``;
            None keeps the optimizers'.

    Raises:
        UserError: a stream of another length than ``steps``, more parts than layers, fewer samples than microbatches.

    Example:
        >>> from pipeweave.schedule import generate
        >>> spec = ModelSpec(kind="mlp", layers=2, hidden=8)
        >>> r = run_reference(generate("1f1b", num_stages=2, num_microbatches=2), spec, steps=2, batch_size=4)
        >>> len(r.losses), sorted(r.parameters)[0]
        (2, '0.down.bias')
    """
    if not schedule.is_synchronous:  # a stream: run once, its mini-batches are the steps (runtime.stream)
        _check_stream_steps(schedule, steps)
        return run_stream_reference(
            schedule,
            spec,
            batch_size=batch_size,
            optimizer_factory=optimizer_factory,
            seed=seed,
            recompute=recompute,
            data=data,
            parts=parts,
            precision=precision,
            lr_at=lr_at,
        )
    workers = build_workers(
        schedule,
        spec,
        batch_size=batch_size,
        optimizer_factory=optimizer_factory,
        recompute=recompute,
        parts=parts,
        precision=precision,
    )
    ties = TiedGradients(schedule.placement, dict(enumerate(workers)))  # ties.hooks: the tied stages' U run them
    source = data if data is not None else data_source(spec, batch_size=batch_size, seed=seed)
    t = schedule.num_microbatches
    losses = [
        _step(schedule, workers, step_microbatches(source, step, t), None if lr_at is None else lr_at(step), ties)
        for step in range(steps)
    ]
    parameters, stage_parameters = trained_parameters(workers)
    peaks = [w.peak_activation_bytes() for w in workers]
    return TrainResult(losses, parameters, stage_parameters, peaks)


def _check_stream_steps(schedule: Schedule, steps: int) -> None:
    """A stream's mini-batches are the run's steps: refuse another count."""
    minibatches = schedule.num_steps * minibatch_pipelines(schedule)
    if steps != minibatches:
        raise UserError(
            f"the asynchronous {schedule.name} stream covers {minibatches} mini-batches, not "
            f"steps={steps}; generate it with num_steps for {steps} mini-batches"
        )


def _step(
    schedule: Schedule,
    workers: list[StageWorker],
    microbatches: tuple[list[Boundary], list[Boundary]],
    lr: float | None,
    ties: TiedGradients,
) -> float:
    """One synchronous step on ``microbatches`` (inputs, targets; at learning rate ``lr``, if given); the
    mini-batch mean loss."""
    if lr is not None:
        for worker in workers:
            set_lr(worker.optimizer, lr)
    return run_step(schedule, workers, *microbatches, combine=ties.hooks)


@dataclass
class StreamResult(TrainResult):
    """A reference run of a stream: ``TrainResult`` plus what the policy recorded.

    Attributes:
        versions: per F/B/I/W, ``(version, target)`` as read (``sim.versions.read_versions``'s fields).
        weight_bytes: per rank, the peak bytes of weights held (every version and extra buffer).
    """

    versions: dict[Action, Read] = field(default_factory=dict)
    weight_bytes: list[int] = field(default_factory=list)


class _StreamWalk(Walk):
    """The reference walk of a stream: a rank's U follows its own backwards; the policy brackets each action."""

    def __init__(
        self,
        schedule: Schedule,
        workers: list[StageWorker],
        inputs: Sequence[Boundary],
        targets: Sequence[Boundary],
        policies: dict[int, RankPolicy],
        exchange: LocalExchange | None = None,
    ) -> None:
        super().__init__(schedule, workers, inputs, targets)
        self.policy_of = {s: policies[r] for r, policy in policies.items() for s in policy.states}
        self.exchange = exchange
        self.ties = StreamTies(schedule, dict(enumerate(workers)))  # its hooks: what the tied stages' U run
        self.averaged = ReplicaMeans(schedule, workers) if averages_replicas(schedule) else None

    def ready(self, a: Action) -> bool:
        # U(s, k) applies the gradients its rank ran since U(s, k-1) (dataflow.consumed_gradients); a tied
        # stage's also its partner's half (runtime.stage.tied_stream), as the distributed U waits for it.
        # AvgPipe on ranks of their own: a U applies the averaging of the round before, as the distributed U
        # waits for its all-reduce; every replica must have sent that round.
        # PipeDream's replicated stages (1F1B-RR): a U waits for its replicas' gradients, as their all-reduce does.
        if a.op is Op.U:
            waiting = self.policy_of[a.stage].waiting_on(a.stage)
            if waiting is not None and self.exchange is not None and not self.exchange.complete(*waiting):
                return False
            if self.averaged is not None and not self.averaged.ready(a):
                return False
        return self.ties.ready(a.stage) if a.op is Op.U else super().ready(a)

    def run(self, a: Action) -> None:
        policy = self.policy_of[a.stage]
        policy.enter(a)
        if a.op is Op.U:
            # No replica sum: AvgPipe's replicas train apart; 1F1B-RR's average (``ReplicaMeans``), before
            # the rest, as the distributed executor's ``average_over``. A tied stage's U sums its ties (tied_stream).
            tie = self.ties.hooks.get(a.stage)
            combine = tie if self.averaged is None else self.averaged.hook(a, then=tie)
            self.workers[a.stage].update(combine=combine)
        else:
            super().run(a)
            if self.averaged is not None and a.op.computes_weight_grad:
                self.averaged.done.add(a)
        policy.exit(a)


class ReplicaMeans:
    """PipeDream's replicated stages in one process: ``U(s, k)`` of every replica of a part waits for the
    gradients each replica's own ``U(r, k)`` applies, and the first of them sets every replica's gradients to
    their mean (what the replicas' all-reduce gives, ``runtime.replicas.all_reduce_gradients``)."""

    def __init__(self, schedule: Schedule, workers: list[StageWorker]) -> None:
        self.placement, self.workers = schedule.placement, workers
        self.consumed = consumed_gradients(schedule)
        self.done: set[Action] = set()  # weight-gradient actions run
        self.averaged: set[tuple[int, int]] = set()  # (part, update)

    def ready(self, a: Action) -> bool:
        replicas = self.placement.replicas(a.stage)
        return all(g in self.done for r in replicas for g in self.consumed[Action(r, Op.U, a.microbatch)])

    def hook(self, a: Action, then: Combine | None = None) -> Combine:
        """What ``a`` (a ``U``) runs first: its part's mean, once per update; then ``then``."""

        def average(worker: StageWorker) -> None:
            key = (self.placement.stage_part[a.stage], a.microbatch)
            if key not in self.averaged:
                self.averaged.add(key)
                mean_replica_gradients([self.workers[r] for r in self.placement.replicas(a.stage)])
            if then is not None:
                then(worker)

        return average


def run_stream_reference(
    schedule: Schedule | Sequence[Schedule],
    spec: ModelSpec,
    *,
    batch_size: int,
    optimizer_factory: OptimizerFactory | None = None,
    seed: int = 0,
    recompute: Recompute = False,
    data: DataSource | None = None,
    parts: list[range] | None = None,
    options: PolicyOptions | None = None,
    precision: str = "fp32",
    lr_at: Callable[[int], float] | None = None,
) -> StreamResult:
    """Run an asynchronous stream once, every stage in this process, its policy applied.

    Args:
        schedule: an asynchronous schedule (its ``num_steps`` mini-batches are the run), or the
            streams of a run that drains between them (``runtime.run.streams.stream_schedules``), run one
            after the other on the same workers, each policy taking the last one's ``StreamCarry``.
        spec, batch_size, optimizer_factory, seed, recompute, data, parts, precision: as ``run_reference``.
        lr_at: the learning rate of each stage's k-th update (``LrSchedule.at``); None keeps the optimizer's.
        options: the policies' run-time hyperparameters.

    Raises:
        UserError: a synchronous schedule, tied parameters on a stream other than pipedream-2bw or with
            ``lr_at`` (``runtime.stage.tied_stream``), an optimizer prediction cannot follow.

    Example:
        >>> from pipeweave.schedule import generate
        >>> s = generate("pipedream", num_stages=2, num_microbatches=2, num_steps=3)
        >>> r = run_stream_reference(s, ModelSpec(kind="mlp", layers=2, hidden=8), batch_size=4)
        >>> len(r.losses), r.versions[Action(0, Op.B, 2)]
        (3, (1, 1))
    """
    segments = [schedule] if isinstance(schedule, Schedule) else list(schedule)
    first = segments[0]
    if first.is_synchronous:
        raise UserError(f"schedule {first.name} is synchronous; run it with run_reference")
    check_stream_model(spec, first.name, lr_at is not None)
    workers = build_workers(
        first,
        spec,
        batch_size=batch_size,
        optimizer_factory=optimizer_factory,
        recompute=recompute,
        parts=parts,
        precision=precision,
    )
    source = data if data is not None else data_source(spec, batch_size=batch_size, seed=seed)
    t = microbatches_per_minibatch(first)
    result = StreamResult([], {}, [], [], weight_bytes=[0] * first.num_ranks)
    carry, position = StreamCarry(), StreamPosition()
    for seg in segments:
        carry = _run_stream(seg, workers, source, t, options, lr_at, carry, position, result)
        position.advance(seg, t)
    result.parameters, result.stage_parameters = trained_parameters(workers)
    result.peak_activation_bytes = [w.peak_activation_bytes() for w in workers]
    return result


def _run_stream(
    stream: Schedule,
    workers: list[StageWorker],
    source: DataSource,
    t: int,
    options: PolicyOptions | None,
    lr_at: Callable[[int], float] | None,
    carry: StreamCarry,
    position: StreamPosition,
    result: StreamResult,
) -> StreamCarry:
    """Walk one stream of a run (``position``: where it starts) into ``result``; what its policies carry on."""
    for w in workers:
        w.start_at(position.minibatches)
    tables = ScheduleTables(stream)
    exchange = LocalExchange(len(stream.placement.replicas(0)))  # used by AvgPipe on ranks of their own only
    policies = {
        r: RankPolicy(
            stream, {s: workers[s] for s in stream.placement.stages_on(r)}, options, tables, lr_at, carry, exchange
        )
        for r in range(stream.num_ranks)
    }
    total = stream.num_microbatches
    inputs, targets = (
        StreamData(source, num_microbatches=t, length=total, part=part, first=position.minibatches) for part in (0, 1)
    )
    state = _StreamWalk(stream, workers, inputs, targets, policies, exchange)
    run_step(stream, workers, [], [], state=state)
    state.ties.drain()
    result.losses += minibatch_losses(state.losses, t, total // t)
    for policy in policies.values():
        result.versions.update(position.versions(policy.versions))
    result.weight_bytes = [max(b, policies[r].peak_weight_bytes) for r, b in enumerate(result.weight_bytes)]
    carries = [policy.carry() for policy in policies.values()]
    return StreamCarry(carries[0].updates, carries[0].annealed, {s: v for c in carries for s, v in c.velocity.items()})
