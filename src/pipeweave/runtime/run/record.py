"""What a run measured: every rank's record, gathered on rank 0 as the run's.

Each rank fills a ``RankRecord`` (its losses, the start and end of every
action on rank 0's clock, its memory, its CPU time); ``gather_run`` collects
them on rank 0 into the ``RunRecord`` that ``launch`` returns and that
``runtime.report`` turns into summaries, traces and plots.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.config import TrainConfig
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run import streams
from pipeweave.runtime.stage.expert_parallel import traffic_of
from pipeweave.runtime.stage.shards import gathered
from pipeweave.runtime.stage.tensor_parallel import gather
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.transport.host import HostTransport
from pipeweave.schedule.ir import Action


@dataclass
class RankRecord:
    """What one rank measured; rank 0 receives every rank's."""

    rank: int
    losses: list[float]
    """Per step, this rank's share of the loss (sums of scaled microbatch losses)."""
    records: list[list[tuple[int, str, int, float, float]]]
    """Per step of the recorded window, ``(stage, op, microbatch, start s, end s)`` on rank 0's clock: a
    synchronous run's first ``LoggingConfig.trace_steps`` steps (``add_step``), a stream's every step."""
    peak_activation_bytes: int
    weight_bytes: int
    """Bytes of this rank's weights; streams: the peak of every version and extra buffer held."""
    parameters: dict[int, dict[str, torch.Tensor]]
    """Per stage on this rank, its final parameters (when collected)."""
    step_cpu_s: list[float] = field(default_factory=list)
    """Per step, CPU seconds of this rank's process (every thread, gloo's included)."""
    action_cpu_s: list[list[float]] = field(default_factory=list)
    """Per step of the recorded window, thread CPU seconds of each recorded action (parallel to ``records``)."""
    step_ends: list[float] = field(default_factory=list)
    """Per step (every step, beyond the window), the end of this rank's last action of it, on rank 0's clock."""
    versions: dict[Any, tuple[int, int]] = field(default_factory=dict)
    """Streams: per F/B/I/W action, the ``(version, target)`` it read (``runtime.stage.policy``)."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """Per evaluation, ``(steps trained, this rank's share of the held-out loss)`` (``TrainConfig.eval_every``)."""
    skipped_steps: list[int] = field(default_factory=list)
    """The steps of this run (0-based) whose update was skipped (``TrainConfig.on_nonfinite``; alike on every rank)."""
    overflow_steps: list[int] = field(default_factory=list)
    """``--precision fp16``: the steps of this run (0-based) whose gradients overflowed, their update skipped and
    the loss scale lowered (``runtime.loss_scale``; alike on every rank)."""
    loss_scales: list[float] = field(default_factory=list)
    """``--precision fp16``: per step, the loss scale its backward started from (alike on every rank)."""
    peak_tensor_bytes: int = 0
    """The process's peak tensor bytes in the measured step (``stage.tensor_bytes``: CUDA's max_memory_allocated,
    or on the CPU the tensors created in it and alive at once; 0 where not measured: streams)."""
    gradient_bytes: int = 0
    """The most gradient bytes this rank held between its actions (``runtime.replicas``: whole gradients under
    ZeRO 0 and 1, ZeRO-1's reduced slices beside them at ``U``, ZeRO-2's slices alone; 0 where no part of the
    rank is replicated over ranks)."""
    log_failure: str | None = None
    """Why this process's ``--log-dir`` log stopped (``StepLog.failure``; None: whole, or not its writer)."""
    cuda_allocated: list[int] = field(default_factory=list)
    """CUDA ranks, per step: the caching allocator's peak allocated bytes in it (``transport.timing``; empty on
    the CPU)."""
    cuda_reserved: list[int] = field(default_factory=list)
    """CUDA ranks, per step: the caching allocator's peak reserved bytes in it (empty on the CPU)."""
    averaging: list[tuple[int, int, float, float]] = field(default_factory=list)
    """AvgPipe on ranks of their own: per averaging, ``(stage, round, start s, end s)`` on rank 0's clock, from the
    all-reduce's start to its mean in hand (``runtime.stage.averaging``)."""

    expert_rows: list[dict[str, dict[int, int]]] = field(default_factory=list)
    """--expert-parallel: per step, per MoE layer of this rank (by module name), the rows (token copies) each
    of its experts received from every rank of its ``ep`` group (``stage.expert_parallel``)."""
    all_to_all_s: list[float] = field(default_factory=list)
    """--expert-parallel: per step, seconds this rank spent inside its experts' all-to-alls, F and backward."""

    def add_expert_traffic(self, workers: dict[int, StageWorker]) -> None:
        """The step's expert-parallel traffic (nothing without expert-parallel layers)."""
        taken = {name: t.take() for w in workers.values() for name, t in traffic_of(w.module).items()}
        if taken:
            self.expert_rows.append({name: rows for name, (rows, _) in taken.items()})
            self.all_to_all_s.append(sum(seconds for _, seconds in taken.values()))

    def add_step(
        self,
        loss: float,
        row: list[tuple[int, str, int, float, float]],
        cpu_ns: int,
        action_cpu_ns: list[int],
        keep: bool,
        memory: tuple[int, int] | None = None,
    ) -> None:
        """A synchronous step's loss share, process CPU time and end, and on CUDA its peak allocated and reserved
        bytes (``memory``); its rows (``records``) and their CPU times too where ``keep`` (the first
        ``LoggingConfig.trace_steps`` steps): what stays is O(1) a step beyond them."""
        self.losses.append(loss)
        self.step_cpu_s.append(cpu_ns * 1e-9)
        if memory is not None:
            self.cuda_allocated.append(memory[0])
            self.cuda_reserved.append(memory[1])
        self.step_ends.append(row[-1][4])
        if keep:
            self.records.append(row)
            self.action_cpu_s.append([c * 1e-9 for c in action_cpu_ns])


@dataclass
class RunRecord:
    """Everything a run measured, as gathered on rank 0."""

    config: TrainConfig
    ranks: list[RankRecord]
    wall_s: float
    transport: str = ""
    """What carried the point-to-point messages: ``shm``, ``gloo`` or ``nccl`` (``used_transport``)."""
    first_step: int = 0
    """Steps trained before this run (``TrainConfig.resume``): ``losses[k]`` is step ``first_step + k``."""
    first_update: int = 0
    """Updates each stage made before this run (``RunPlan.updates_done``)."""
    paused_s: float = 0.0
    """Streams: seconds between them (evaluations, checkpoints) taken out of ``records`` (``close_pauses``)."""
    save_failures: list[str] = field(default_factory=list)
    """Per checkpoint that could not be written, the one line saying why (``checkpoint.save``)."""
    final_save_failure: str | None = None
    """Why the checkpoint after the last step could not be written (None: it was, or none was asked for)."""

    @property
    def log_failure(self) -> str | None:
        """Why the ``--log-dir`` log stopped before the run's end (None: it is whole, or none was asked for)."""
        return next((r.log_failure for r in self.ranks if r.log_failure is not None), None)

    @property
    def losses(self) -> list[float]:
        """Per step, the mini-batch mean loss (every rank's share summed)."""
        return [sum(r.losses[k] for r in self.ranks) for k in range(self.config.training.steps)]

    @property
    def skipped_steps(self) -> list[int]:
        """The steps of this run (indices of ``losses``) whose update every stage skipped: a non-finite loss
        or gradient norm under ``--on-nonfinite skip`` (``runtime.run.divergence``)."""
        return list(self.ranks[0].skipped_steps)

    @property
    def overflow_steps(self) -> list[int]:
        """``--precision fp16``: the steps of this run whose gradients overflowed somewhere, their update skipped
        on every stage and the loss scale lowered (``runtime.loss_scale``)."""
        return list(self.ranks[0].overflow_steps)

    @property
    def eval_losses(self) -> list[tuple[int, float]]:
        """Per evaluation, ``(steps trained, mean held-out loss)`` (every rank's share summed)."""
        evals = self.ranks[0].eval_losses
        return [(at, sum(r.eval_losses[k][1] for r in self.ranks)) for k, (at, _) in enumerate(evals)]


def used_transport(context: RankContext) -> str:
    """This rank's point-to-point transport: ``shm`` (``runtime.transport.shm``), ``host`` (``transport.host``) or
    the process group's backend."""
    if context.transport is None:
        return str(dist.get_backend())
    return "host" if isinstance(context.transport, HostTransport) else "shm"


def seconds_since(timings: Sequence[tuple[Action, int, int]], offset: int) -> list[tuple[int, str, int, float, float]]:
    """Executor timings (perf_counter ns) as ``RankRecord.records`` rows, seconds since ``offset`` (rank 0's clock)."""
    return [(a.stage, a.op.value, a.microbatch, (t0 - offset) * 1e-9, (t1 - offset) * 1e-9) for a, t0, t1 in timings]


def final_parameters(config: TrainConfig, workers: dict[int, StageWorker]) -> dict[int, dict[str, torch.Tensor]]:
    """Per local stage, copies of its parameters when the config asks to collect them (else empty).

    Tensor-parallel shards are gathered whole (every process of the group calls this).
    """
    if not config.checkpoint.collect_parameters:
        return {}
    with gathered(workers):  # ZeRO-3's slices too
        return {s: {k: _whole(p, w).cpu().clone() for k, p in w.named_parameters().items()} for s, w in workers.items()}


def _whole(param: torch.Tensor, worker: StageWorker) -> torch.Tensor:
    return param.detach() if worker.tensor_parallel is None else gather(param, worker.tensor_parallel)


def gather_run(
    config: TrainConfig,
    mine: RankRecord,
    context: RankContext,
    started: float,
    first_step: int = 0,
    first_update: int | None = None,
) -> RunRecord | None:
    """Gather every rank's record on process 0: the ``RunRecord`` there, None elsewhere.

    Under tensor and context parallelism the record holds one process per stage rank, its ``(cp, tp)``
    coordinate 0's (its last stages' losses are the whole sequences', ``stage.context_parallel``).

    ``first_step``/``first_update``: what the resumed checkpoint had done, read
    when the run started (a run saving to the folder it resumed from rewrites it).
    """
    rank = context.process
    gathered: list[Any] | None = [None] * context.world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    assert gathered is not None
    gathered = gathered[:: config.parallel.per_stage_rank]  # per stage rank its first process's (its group runs alike)
    if config.is_stream and config.parallel.data_parallel > 1:  # replicas around the stream: their shares of the loss
        gathered = _fold_replicas(gathered, config.parallel.data_parallel)
    return RunRecord(
        config,
        sorted(gathered, key=lambda r: r.rank),
        time.perf_counter() - started,
        used_transport(context),
        first_step,
        first_step if first_update is None else first_update,
    )


def _fold_replicas(records: list[Any], replicas: int) -> list[Any]:
    """An asynchronous run's P replicas' records (in process order, the first replica's first): the first
    replica's, each rank's loss shares (training and held-out) summed over the replicas (each ran its piece of
    every microbatch)."""
    ranks = len(records) // replicas
    first = records[:ranks]
    for other in records[ranks:]:
        mine = first[other.rank]
        mine.losses = [a + b for a, b in zip(mine.losses, other.losses)]
        mine.eval_losses = [(at, a + b) for (at, a), (_, b) in zip(mine.eval_losses, other.eval_losses)]
    return first


def close_pauses(record: RunRecord) -> float:
    """Take the pauses between a run's streams (evaluations, checkpoints) out of its measured times.

    Between two streams every rank evaluates or saves, which is not the
    schedule's time. Each pause -- from the last action of a stream on any
    rank to the first action of the next on any rank, where positive -- is
    subtracted from every later time on every rank alike, so the order of
    all events is kept. Returns the seconds taken out.
    """
    removed = 0.0
    segments = streams.segments(record.config)
    for (first, steps), (nxt, _) in zip(segments, segments[1:]):
        end = max((a[4] for r in record.ranks for m in range(first, first + steps) for a in r.records[m]), default=0.0)
        start = min(
            (a[3] for r in record.ranks for m in range(nxt, record.config.training.steps) for a in r.records[m]),
            default=end,
        )
        pause = start - end
        if pause <= 0:
            continue
        removed += pause
        for r in record.ranks:
            for m in range(nxt, record.config.training.steps):
                r.records[m] = [(s, op, j, t0 - pause, t1 - pause) for s, op, j, t0, t1 in r.records[m]]
            r.step_ends[nxt:] = [t - pause for t in r.step_ends[nxt:]]
    return removed
