"""Asynchronous streams at run time: what ``--steps N`` means, the stream's data, and both executors' runs.

An asynchronous schedule is one stream across many mini-batches with no flush
(``schedule.stream``), so a run executes it once, start to end -- unless it
stops to evaluate or save (``--eval-every K``, ``--save-every K``): a stream
has no step boundary to do that at, so the run drains it after every K-th
mini-batch and starts the next (``TrainConfig.segments``), as PipeDream's
runtime flushes at the end of an epoch to validate. Each segment is a stream
of its own -- its warm-up, staleness and PipeMare delays are its own -- and
its policy takes over what the last one carried (``policy.StreamCarry``:
updates made, PipeMare's annealing count and velocity; the parameters and
optimizer state stay in the workers). A run resumed from a checkpoint starts
a new segment the same way, so training N mini-batches with a drain after k
equals training k, saving and resuming for N - k. The run's schedule, for
the simulator and the trace, is its segments concatenated
(``schedule.stream.concatenate``). Within each stream:

- ``--steps N`` means N mini-batches of ``--batch`` samples, for every
  schedule: the stream is generated for ``num_steps = N`` (AvgPipe: N / P
  rounds of one mini-batch per pipeline, so N must be a multiple of P). The
  optimizer steps this makes per stage follow from the policy (PipeDream and
  SpecTrain: one per microbatch; the others: one per mini-batch).
- Microbatch j of the stream is microbatch j mod T of mini-batch j // T, and
  mini-batch m is the data source's batch m: every schedule sees the same
  samples in the same order.
- ``losses[m]`` is mini-batch m's mean loss as its forwards computed it (with
  whatever weights they read): comparable across schedules.

The same ``RankPolicy`` (``runtime.policy``) drives the reference executor
(every rank in this process, ``run_stream_reference``) and the distributed one
(``run_stream_rank``), so their losses agree; each records the version every
F/B/I/W read and the peak weight bytes per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import torch

from pipeweave.data import DataSource, data_source, split_microbatches
from pipeweave.models import boundary
from pipeweave.models.boundary import Boundary
from pipeweave.errors import UserError
from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.lr_schedule import LrSchedule
from pipeweave.runtime.plain import TrainResult
from pipeweave.runtime.policy import PolicyOptions, RankPolicy, Read, ScheduleTables, StreamCarry
from pipeweave.runtime.reference import _Step, build_workers, run_step, trained_parameters
from pipeweave.runtime.stage import OptimizerFactory, StageWorker
from pipeweave.schedule.ir import Action, Op, Schedule

if TYPE_CHECKING:
    from pipeweave.runtime.config import TrainConfig
    from pipeweave.runtime.job import RunRecord


def stream_steps(name: str, steps: int, options: dict[str, Any]) -> int:
    """The stream's ``num_steps`` for N = ``steps`` mini-batches (AvgPipe: N / P rounds).

    Raises:
        UserError: AvgPipe with N not a multiple of P.

    Example:
        >>> stream_steps("avgpipe", 8, {"num_pipelines": 2}), stream_steps("pipedream", 8, {})
        (4, 8)
    """
    p = _pipelines(name, options)
    if steps % p:
        raise UserError(f"--steps {steps} is not a multiple of avgpipe's P={p} pipelines; give --steps {steps - steps % p + p}")
    return steps // p


def _pipelines(name: str, options: dict[str, Any]) -> int:
    """Mini-batches per round of the stream: AvgPipe's P, else 1."""
    if name != "avgpipe":
        return 1
    from pipeweave.schedule.avgpipe import DEFAULT_PIPELINES

    return int(options.get("num_pipelines", DEFAULT_PIPELINES))


def check_segment_steps(config: TrainConfig, flag: str, every: int) -> None:
    """Refuse a drain inside an AvgPipe round: every stream is whole rounds of P mini-batches."""
    p = _pipelines(config.schedule, dict(config.schedule_options))
    if every % p:
        raise UserError(f"{flag} {every} is not a multiple of avgpipe's P={p} pipelines (each stream between two "
                        f"drains is whole rounds); give {flag} {every - every % p + p}")


def segment_options(config: TrainConfig, first: int, steps: int) -> dict[str, Any]:
    """The generator options of the stream of the training's mini-batches ``first`` to ``first + steps - 1``.

    PipeMare's ``warmup_steps`` are the training's first mini-batches: a
    stream gets those of them it holds, so a run shorter than the warm-up is
    all warm-up and a later stream (after a drain, or resumed) gets what is left.

    Example:
        >>> from pipeweave.runtime.config import TrainConfig
        >>> c = TrainConfig(schedule="pipemare", schedule_options=(("warmup_steps", 3),))
        >>> segment_options(c, 2, 4), segment_options(c, 0, 2)["warmup_steps"]
        ({'warmup_steps': 1, 'num_steps': 4}, 2)
    """
    options = dict(config.schedule_options)
    warmup = options.get("warmup_steps")
    if isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 0:
        options["warmup_steps"] = min(max(0, warmup - first), steps)
    options["num_steps"] = stream_steps(config.schedule, steps, options)
    return options


def stream_rates(config: TrainConfig, schedule: Schedule, first_update: int | None = None) -> LrSchedule:
    """The learning rates of a stream's updates (``LrSchedule``): a stage's k-th update of the training takes
    step k's, the decay ending by default at this run's last update (after a checkpoint's).

    ``first_update``: updates made before this run (default: the resumed checkpoint's, read now).
    """
    from pipeweave.runtime import checkpoint

    if first_update is None:
        first_update = checkpoint.updates_done(config)
    return config.learning_rates(updates=first_update + stream_updates(schedule))


def stream_updates(schedule: Schedule) -> int:
    """Updates each stage of an asynchronous stream makes (stage 0's U actions; every stage makes as many)."""
    return sum(1 for row in schedule.actions for a in row if a.op is Op.U and a.stage == 0)


def microbatches_per_minibatch(schedule: Schedule) -> int:
    """T: the stream's microbatches over its mini-batches (AvgPipe: one per pipeline and round)."""
    return schedule.num_microbatches // (max(1, schedule.num_steps) * len(schedule.placement.pipelines))


class StreamData(Sequence[Boundary]):
    """Microbatch j of the stream: slice j mod T of the data source's batch ``first`` + j // T, fetched when first asked.

    Example:
        >>> src = data_source(ModelSpec(kind="mlp", hidden=4), batch_size=4)
        >>> d = StreamData(src, num_microbatches=2, length=6, part=0)
        >>> torch.equal(d[3], src.batch(1)[0][2:4]), len(d)
        (True, 6)
    """

    def __init__(self, source: DataSource, *, num_microbatches: int, length: int, part: int,
                 device: torch.device | str = "cpu", first: int = 0) -> None:
        self.source, self.t, self.length, self.part, self.device = source, num_microbatches, length, part, device
        self.first = first  # the data source's batch of the stream's mini-batch 0
        self._cached: tuple[int, list[Boundary]] | None = None

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, j: int) -> Boundary: ...
    @overload
    def __getitem__(self, j: slice) -> Sequence[Boundary]: ...
    def __getitem__(self, j: int | slice) -> Boundary | Sequence[Boundary]:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(self.length))]
        m = j // self.t
        if self._cached is None or self._cached[0] != m:  # the stream asks in about increasing order
            batch = self.source.batch(self.first + m)[self.part]
            self._cached = (m, [boundary.to(x, self.device) for x in split_microbatches(batch, self.t)])
        return self._cached[1][j % self.t]


def minibatch_losses(losses: dict[int, float], num_microbatches: int, num_minibatches: int) -> list[float]:
    """Per mini-batch, the sum of its microbatches' scaled losses (its mean loss), in microbatch order."""
    out = [0.0] * num_minibatches
    for j in sorted(losses):
        out[j // num_microbatches] += losses[j]
    return out


@dataclass
class StreamResult(TrainResult):
    """A reference run of a stream: ``TrainResult`` plus what the policy recorded.

    Attributes:
        versions: per F/B/I/W, ``(version, target)`` as read (``sim.versions.read_versions``'s fields).
        weight_bytes: per rank, the peak bytes of weights held (every version and extra buffer).
    """

    versions: dict[Action, Read] = field(default_factory=dict)
    weight_bytes: list[int] = field(default_factory=list)


class _StreamStep(_Step):
    """The reference walk of a stream: a rank's U follows its own backwards; the policy brackets each action."""

    def __init__(self, schedule: Schedule, workers: list[StageWorker], inputs: Sequence[Boundary],
                 targets: Sequence[Boundary], policies: dict[int, RankPolicy]) -> None:
        super().__init__(schedule, workers, inputs, targets)
        self.policy_of = {s: policies[r] for r, policy in policies.items() for s in policy.states}

    def ready(self, a: Action) -> bool:
        # U(s, k) applies the gradients its rank ran since U(s, k-1) (dataflow.consumed_gradients).
        return True if a.op is Op.U else super().ready(a)

    def run(self, a: Action) -> None:
        policy = self.policy_of[a.stage]
        policy.enter(a)
        if a.op is Op.U:
            self.workers[a.stage].update()  # no replica sum: AvgPipe's replicas train apart
        else:
            super().run(a)
        policy.exit(a)


def check_stream_model(spec: ModelSpec) -> None:
    """Tied embeddings sum gradients across stages at every update, which a stream does not synchronise."""
    if spec.tie_embeddings:
        raise UserError("tied embeddings need synchronous updates; drop --tie-embeddings for asynchronous schedules")


def run_stream_reference(
    schedule: Schedule | Sequence[Schedule],
    spec: ModelSpec,
    *,
    batch_size: int,
    optimizer_factory: OptimizerFactory | None = None,
    seed: int = 0,
    recompute: bool = False,
    data: DataSource | None = None,
    parts: list[range] | None = None,
    options: PolicyOptions | None = None,
    precision: str = "fp32",
    lr_at: Callable[[int], float] | None = None,
) -> StreamResult:
    """Run an asynchronous stream once, every stage in this process, its policy applied.

    Args:
        schedule: an asynchronous schedule (its ``num_steps`` mini-batches are the run), or the
            streams of a run that drains between them (``TrainConfig.stream_segments``), run one
            after the other on the same workers, each policy taking the last one's ``StreamCarry``.
        spec, batch_size, optimizer_factory, seed, recompute, data, parts, precision: as ``run_reference``.
        lr_at: the learning rate of each stage's k-th update (``LrSchedule.at``); None keeps the optimizer's.
        options: the policies' run-time hyperparameters.

    Raises:
        UserError: a synchronous schedule, tied embeddings, an optimizer prediction cannot follow.

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
    check_stream_model(spec)
    workers = build_workers(first, spec, batch_size=batch_size, optimizer_factory=optimizer_factory,
                            recompute=recompute, parts=parts, precision=precision)
    source = data if data is not None else data_source(spec, batch_size=batch_size, seed=seed)
    t = microbatches_per_minibatch(first)
    carry = StreamCarry()
    losses: list[float] = []
    versions: dict[Action, Read] = {}
    weight_bytes = [0] * first.num_ranks
    position = _Position()
    for seg in segments:
        for w in workers:
            w.steps_done = position.minibatches
        tables = ScheduleTables(seg)
        policies = {
            r: RankPolicy(seg, {s: workers[s] for s in seg.placement.stages_on(r)}, options, tables, lr_at, carry)
            for r in range(seg.num_ranks)
        }
        total = seg.num_microbatches
        inputs = StreamData(source, num_microbatches=t, length=total, part=0, first=position.minibatches)
        targets = StreamData(source, num_microbatches=t, length=total, part=1, first=position.minibatches)
        state = _StreamStep(seg, workers, inputs, targets, policies)
        run_step(seg, workers, [], [], state=state)
        losses += minibatch_losses(state.losses, t, total // t)
        for policy in policies.values():
            versions.update(position.versions(policy.versions))
        weight_bytes = [max(b, policies[r].peak_weight_bytes) for r, b in enumerate(weight_bytes)]
        carries = [policy.carry() for policy in policies.values()]
        carry = StreamCarry(carries[0].updates, carries[0].annealed,
                            {s: v for c in carries for s, v in c.velocity.items()})
        position.advance(seg, t)
    parameters, stage_parameters = trained_parameters(workers)
    return StreamResult(losses, parameters, stage_parameters, [w.peak_activation_bytes() for w in workers],
                        versions=versions, weight_bytes=weight_bytes)


class _Position:
    """Where a stream starts in its run: mini-batches, microbatches and updates per stage before it.

    Actions of a stream are numbered from 0; ``shift`` numbers them as the
    run's schedule does (``schedule.stream.concatenate``).
    """

    def __init__(self) -> None:
        self.minibatches = self.microbatches = self.updates = 0

    def shift(self, a: Action) -> Action:
        return Action(a.stage, a.op, a.microbatch + (self.updates if a.op is Op.U else self.microbatches))

    def versions(self, reads: dict[Action, Read]) -> dict[Action, Read]:
        return {self.shift(a): (v + self.updates, k + self.updates) for a, (v, k) in reads.items()}

    def advance(self, segment: Schedule, t: int) -> None:
        self.minibatches += segment.num_microbatches // t
        self.microbatches += segment.num_microbatches
        self.updates += stream_updates(segment)


def split_by_minibatch(records: list[tuple[Action, int, int]], t: int, num_minibatches: int
                       ) -> list[list[tuple[Action, int, int]]]:
    """A rank's records of the whole stream, grouped by mini-batch (a U joins its last backward's)."""
    groups: list[list[tuple[Action, int, int]]] = [[] for _ in range(num_minibatches)]
    backward = 0  # mini-batch of the rank's last backward
    for rec in records:
        a = rec[0]
        if a.op.computes_weight_grad:
            backward = a.microbatch // t
        groups[backward if a.op is Op.U else a.microbatch // t].append(rec)
    return groups


def run_stream_rank(rank: int, world: int, config: TrainConfig) -> RunRecord | None:
    """``job.run_rank`` for an asynchronous schedule: its streams through the ``Executor``, one after the other.

    Between two streams (``TrainConfig.segments``) nothing is in flight: the
    run evaluates and saves there, and the next stream's policy takes the
    last one's ``StreamCarry``. Records are numbered as the run's schedule
    (``TrainConfig.build_schedule``) numbers its actions.
    """
    from pipeweave.runtime import checkpoint, launch as launch_module
    from pipeweave.runtime.executor import Executor
    from pipeweave.runtime.job import (Milestones, RankRecord, build_workers as rank_workers, final_parameters,
                                       gather_run, seconds_since)
    from pipeweave.runtime.trace import align_clocks
    from pipeweave.schedule import lower
    from pipeweave.schedule.stream import concatenate

    started = time.perf_counter()
    segments = config.stream_segments()
    check_stream_model(config.model)
    device = launch_module.device_for(rank)
    workers = rank_workers(segments[0], config, rank, device)
    done = checkpoint.steps_done(config)
    carry = checkpoint.load(config, workers) if config.resume is not None else StreamCarry()
    first_update = carry.updates  # the checkpoint's, read once (a run may save over it)
    rates = stream_rates(config, concatenate(segments), first_update).at if config.lr_scheduled else None
    source = data_source(config.model, batch_size=config.batch_size, seed=config.seed, path=config.data)
    t = config.num_microbatches
    sizes = config.microbatch_sizes
    offset = align_clocks(rank, world)
    losses: list[float] = []
    timings: list[tuple[Action, int, int]] = []
    versions: dict[Action, Read] = {}
    peak_activations = peak_weights = 0
    milestones = Milestones(config, segments[0], rank, workers, device, source, done)  # any segment: same placement
    position = _Position()
    for (first, steps), seg in zip(config.segments(), segments):
        for w in workers.values():
            w.steps_done = done + first  # dropout keys: (steps before the stream, microbatch in it)
        executor = Executor(lower(seg), rank, workers, sizes[: seg.num_microbatches], device)
        _keep_replicas_apart(executor, workers)
        policy = RankPolicy(seg, workers, config.policy, lr_at=rates, carry=carry)
        executor.policy = policy
        data = StreamData(source, num_microbatches=t, length=seg.num_microbatches, part=0, device=device,
                          first=done + first)
        targets = StreamData(source, num_microbatches=t, length=seg.num_microbatches, part=1, device=device,
                             first=done + first)
        _, ran = executor.run_step(data, targets)
        mine = {j: float(x) for j, x in executor.losses_by_microbatch.items()}
        losses += minibatch_losses(mine, t, steps)
        timings += [(position.shift(a), t0, t1) for a, t0, t1 in ran]
        versions.update(position.versions(policy.versions))
        peak_activations = max(peak_activations, executor.peak_activation_bytes)
        peak_weights = max(peak_weights, policy.peak_weight_bytes)
        carry = policy.carry()
        position.advance(seg, t)
        end = first + steps
        groups = split_by_minibatch(timings, t, end)
        for m in range(first, end):
            times = seconds_since(groups[m], offset)
            launch_module.progress({"step": m, "loss": losses[m], "time": times[-1][4] if times else 0.0})
        milestones.reached(end, carry)
    records = [seconds_since(g, offset) for g in split_by_minibatch(timings, t, config.steps)]
    record: RankRecord = RankRecord(rank, losses, records, peak_activations, peak_weights,
                                    final_parameters(config, workers), eval_losses=milestones.eval_losses)
    record.versions = versions
    run = gather_run(config, record, rank, world, started, done, first_update)
    if run is not None:
        from pipeweave.runtime.stream_summary import close_pauses

        run.paused_s = close_pauses(run)
    return run


def _keep_replicas_apart(executor: Any, workers: dict[int, StageWorker]) -> None:
    """AvgPipe's replicas train apart (averaged by the policy): no gradient sums between them."""
    for w in workers.values():
        w.combine_grads = None
    executor.replicas.replicated.clear()
    executor.replicas.grad_actions.clear()
