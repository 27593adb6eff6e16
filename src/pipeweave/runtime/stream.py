"""Asynchronous streams at run time: what ``--steps N`` means, the stream's data, and both executors' runs.

An asynchronous schedule is one stream across many mini-batches with no flush
(``schedule.stream``), so a run executes it once, start to end -- unless it
stops to evaluate or save (``--eval-every K``, ``--save-every K``): a stream
has no step boundary to do that at, so the run drains it after every K-th
mini-batch and starts the next (``runtime.run.streams.segments``), as PipeDream's
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

The same ``RankPolicy`` (``runtime.stage.policy``) drives the reference executor
(every rank in this process, ``run_stream_reference``) and the distributed one
(``run_stream_rank``), so their losses agree; each records the version every
F/B/I/W read and the peak weight bytes per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch

from pipeweave.data import DataSource, split_microbatches
from pipeweave.errors import UserError
from pipeweave.models import boundary
from pipeweave.models.boundary import Boundary
from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.stage.policy import Read
from pipeweave.runtime.stage.tied_stream import check_stream_ties
from pipeweave.schedule.avgpipe import DEFAULT_PIPELINES
from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.schedule.round_robin import minibatch_pipelines


def stream_steps(name: str, steps: int, options: dict[str, Any]) -> int:
    """The stream's ``num_steps`` for N = ``steps`` mini-batches (AvgPipe: N / P rounds).

    Raises:
        UserError: AvgPipe with N not a multiple of P.

    Example:
        >>> stream_steps("avgpipe", 8, {"num_pipelines": 2}), stream_steps("pipedream", 8, {})
        (4, 8)
    """
    p = pipelines_per_round(name, options)
    if steps % p:
        raise UserError(
            f"--steps {steps} is not a multiple of avgpipe's P={p} pipelines; give --steps {steps - steps % p + p}"
        )
    return steps // p


def pipelines_per_round(name: str, options: dict[str, Any]) -> int:
    """Mini-batches per round of the stream: AvgPipe's P, else 1."""
    if name != "avgpipe":
        return 1
    return int(options.get("num_pipelines", DEFAULT_PIPELINES))


def stream_updates(schedule: Schedule) -> int:
    """Updates each stage of an asynchronous stream makes (stage 0's U actions; every stage makes as many)."""
    return sum(1 for row in schedule.actions for a in row if a.op is Op.U and a.stage == 0)


def microbatches_per_minibatch(schedule: Schedule) -> int:
    """T: the stream's microbatches over its mini-batches (AvgPipe: one per pipeline and round)."""
    return schedule.num_microbatches // (max(1, schedule.num_steps) * minibatch_pipelines(schedule))


class StreamData(Sequence[Boundary]):
    """Microbatch j of the stream: slice j mod T of the data source's batch ``first`` + j // T, fetched when first asked.

    ``piece=(p, P)``: data-parallel replica p of P takes the p-th of P pieces of every microbatch, so that the
    P replicas together run each microbatch of the single pipeline (``runtime.run.stream_job``).

    Example:
        >>> from pipeweave.data import data_source
        >>> src = data_source(ModelSpec(kind="mlp", hidden=4), batch_size=4)
        >>> d = StreamData(src, num_microbatches=2, length=6, part=0)
        >>> torch.equal(d[3], src.batch(1)[0][2:4]), len(d)
        (True, 6)
    """

    def __init__(
        self,
        source: DataSource,
        *,
        num_microbatches: int,
        length: int,
        part: int,
        device: torch.device | str = "cpu",
        first: int = 0,
        piece: tuple[int, int] = (0, 1),
    ) -> None:
        self.source, self.t, self.length, self.part, self.device = source, num_microbatches, length, part, device
        self.piece = piece
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
            microbatches = replica_pieces(self.source.batch(self.first + m)[self.part], self.t, self.piece)
            self._cached = (m, [boundary.to(x, self.device) for x in microbatches])
        return self._cached[1][j % self.t]


def replica_pieces(batch: Boundary, num_microbatches: int, piece: tuple[int, int]) -> list[Boundary]:
    """``batch`` split into ``num_microbatches``, each cut to data-parallel replica p's piece of P
    (``piece=(p, P)``; the whole microbatches for (0, 1))."""
    microbatches = split_microbatches(batch, num_microbatches)
    p, pieces = piece
    return microbatches if pieces == 1 else [split_microbatches(x, pieces)[p] for x in microbatches]


def minibatch_losses(losses: dict[int, float], num_microbatches: int, num_minibatches: int) -> list[float]:
    """Per mini-batch, the sum of its microbatches' scaled losses (its mean loss), in microbatch order."""
    out = [0.0] * num_minibatches
    for j in sorted(losses):
        out[j // num_microbatches] += losses[j]
    return out


def check_stream_model(spec: ModelSpec, schedule: str, lr_scheduled: bool) -> None:
    """A tie trains on the streams whose rule ``runtime.stage.tied_stream`` defines (2BW, a constant rate): one
    line for the others."""
    check_stream_ties(spec, schedule, lr_scheduled)


class StreamPosition:
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


def split_by_minibatch(
    records: list[tuple[Action, int, int]], t: int, num_minibatches: int
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
