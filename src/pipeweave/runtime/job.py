"""A distributed training run: what every rank does in it, and what it measured.

The run's configuration is ``runtime.config.TrainConfig``, checked before
anything is spawned. ``run_rank`` is the function each rank runs: build its
stage workers, align clocks, train for ``steps`` steps through the
``Executor``, and gather everything measured to rank 0, which returns it as a
``RunRecord``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipeweave.data import data_source, split_microbatches
from pipeweave.models import boundary
from pipeweave.runtime import checkpoint, launch as launch_module
from pipeweave.runtime.config import TrainConfig
from pipeweave.runtime.executor import Executor
from pipeweave.runtime.lr_schedule import set_lr
from pipeweave.runtime.stage import StageWorker
from pipeweave.runtime.trace import align_clocks
from pipeweave.runtime.validation_step import install_post_validation
from pipeweave.schedule import Schedule, lower
from pipeweave.schedule.evaluation import forward_only
from pipeweave.schedule.ir import Action

if TYPE_CHECKING:
    from pipeweave.runtime.policy import StreamCarry

@dataclass
class RankRecord:
    """What one rank measured; rank 0 receives every rank's."""

    rank: int
    losses: list[float]
    """Per step, this rank's share of the loss (sums of scaled microbatch losses)."""
    records: list[list[tuple[int, str, int, float, float]]]
    """Per step, ``(stage, op, microbatch, start s, end s)`` on rank 0's clock."""
    peak_activation_bytes: int
    weight_bytes: int
    """Bytes of this rank's weights; streams: the peak of every version and extra buffer held."""
    parameters: dict[int, dict[str, torch.Tensor]]
    """Per stage on this rank, its final parameters (when collected)."""
    step_cpu_s: list[float] = field(default_factory=list)
    """Per step, CPU seconds of this rank's process (every thread, gloo's included)."""
    action_cpu_s: list[list[float]] = field(default_factory=list)
    """Per step, thread CPU seconds of each recorded action (parallel to ``records``)."""
    versions: dict[Any, tuple[int, int]] = field(default_factory=dict)
    """Streams: per F/B/I/W action, the ``(version, target)`` it read (``runtime.policy``)."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """Per evaluation, ``(steps trained, this rank's share of the held-out loss)`` (``TrainConfig.eval_every``)."""


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
    """Updates each stage made before this run (a stream's: ``checkpoint.updates_done``; else ``first_step``)."""
    paused_s: float = 0.0
    """Streams: seconds between them (evaluations, checkpoints) taken out of ``records`` (``stream_summary.close_pauses``)."""

    @property
    def losses(self) -> list[float]:
        """Per step, the mini-batch mean loss (every rank's share summed)."""
        return [sum(r.losses[k] for r in self.ranks) for k in range(self.config.steps)]

    @property
    def eval_losses(self) -> list[tuple[int, float]]:
        """Per evaluation, ``(steps trained, mean held-out loss)`` (every rank's share summed)."""
        evals = self.ranks[0].eval_losses
        return [(at, sum(r.eval_losses[k][1] for r in self.ranks)) for k, (at, _) in enumerate(evals)]


def used_transport() -> str:
    """This rank's point-to-point transport: ``shm`` (``runtime.shm``) or the process group's backend."""
    from pipeweave.runtime import shm

    return "shm" if shm.active() is not None else str(dist.get_backend())


def build_workers(schedule: Schedule, config: TrainConfig, rank: int, device: torch.device) -> dict[int, StageWorker]:
    """The stage workers of ``rank``, built from the model's seed (equal to plain training's layers)."""
    parts = config.layer_ranges(schedule)
    workers = {
        s: StageWorker(config.model, parts[schedule.placement.stage_part[s]], batch_size=config.batch_size,
                       optimizer_factory=config.optimizer_factory(), recompute=config.recompute, device=device,
                       precision=config.precision)
        for s in schedule.placement.stages_on(rank)
    }
    if config.post_validation is not None:  # replaces each stage's optimizer (runtime.validation_step)
        install_post_validation(config.post_validation, schedule, workers, config.optimizer, config.lr,
                                config.momentum)
    return workers


def run_rank(rank: int, world: int, config: TrainConfig) -> RunRecord | None:
    """Train on this rank; rank 0 returns the gathered ``RunRecord``, the others None."""
    if config.is_stream:
        from pipeweave.runtime.stream import run_stream_rank

        return run_stream_rank(rank, world, config)
    started = time.perf_counter()
    schedule = config.build_schedule()
    device = launch_module.device_for(rank)
    workers = build_workers(schedule, config, rank, device)
    done = checkpoint.steps_done(config)  # the data goes on from the batch after the checkpoint's last
    if config.resume is not None:
        checkpoint.load(config, workers)
    for w in workers.values():
        w.steps_done = done
    executor = Executor(lower(schedule), rank, workers, config.microbatch_sizes, device)
    source = data_source(config.model, batch_size=config.batch_size, seed=config.seed, path=config.data)
    offset = align_clocks(rank, world)
    t = schedule.num_microbatches
    losses, records = [], []
    step_cpu: list[float] = []
    action_cpu: list[list[float]] = []
    milestones = Milestones(config, schedule, rank, workers, device, source, done)
    rates = config.learning_rates(done) if config.lr_scheduled else None
    for step in range(config.steps):
        if rates is not None:
            for w in workers.values():
                set_lr(w.optimizer, rates.at(done + step))
        loss, timings = executor.run_step(*_microbatches(source, done + step, t, device, workers))
        losses.append(loss)
        step_cpu.append(executor.step_cpu_ns * 1e-9)
        action_cpu.append([c * 1e-9 for c in executor.action_cpu_ns])
        if step == 0 and not config.memory_every_step:
            for w in workers.values():
                w.track_memory = False
        records.append(seconds_since(timings, offset))
        launch_module.progress({"step": step, "loss": loss, "time": (timings[-1][2] - offset) * 1e-9})
        milestones.reached(step + 1)
    mine = RankRecord(rank, losses, records, executor.peak_activation_bytes,
                      sum(w.weight_bytes() for w in workers.values()), final_parameters(config, workers),
                      step_cpu, action_cpu, eval_losses=milestones.eval_losses)
    return gather_run(config, mine, rank, world, started, done)


class Milestones:
    """What a rank does where a step (or a drained stream) of the run ends: evaluate and save, when due.

    ``--eval-every N`` evaluates after every N-th step of the run and after the
    last, through the forward-only pipeline of ``schedule`` (built at the first
    evaluation); ``--save``/``--save-every N`` write the checkpoint likewise.

    Attributes:
        eval_losses: per evaluation, ``(steps trained, this rank's share of the held-out loss)``.
    """

    def __init__(self, config: TrainConfig, schedule: Schedule, rank: int, workers: dict[int, StageWorker],
                 device: torch.device, source: Any, done: int) -> None:
        self.config, self.schedule, self.rank, self.workers = config, schedule, rank, workers
        self.device, self.source, self.done = device, source, done
        self.eval_losses: list[tuple[int, float]] = []
        self._evaluator: Executor | None = None

    def reached(self, end: int, carry: StreamCarry | None = None) -> None:
        """``end`` steps of this run are done and nothing is in flight; ``carry``: a stream's policy state."""
        config = self.config
        last = end == config.steps
        if config.eval_every is not None and (last or end % config.eval_every == 0):
            if self._evaluator is None:
                evaluation = forward_only(self.schedule)
                self._evaluator = Executor(lower(evaluation), self.rank, self.workers,
                                           config.microbatch_sizes[: evaluation.num_microbatches], self.device,
                                           evaluate=True)
            loss = evaluate(self._evaluator, self.source, config, self._evaluator.lowered.schedule.num_microbatches,
                            self.device)
            self.eval_losses.append((self.done + end, loss))
            launch_module.progress({"eval": len(self.eval_losses) - 1, "loss": loss})
        if config.save is not None and (last or end % (config.save_every or config.steps) == 0):
            checkpoint.save(config, self.schedule, self.workers, self.rank, self.done + end, carry=carry)


def evaluate(evaluator: Executor, source: Any, config: TrainConfig, t: int, device: torch.device) -> float:
    """This rank's share of the mean loss over the held-out batches, through the forward-only schedule."""
    total = sum(evaluator.run_step(*_microbatches(source, k, t, device, evaluator.workers, held_out=True))[0]
                for k in range(config.eval_batches))
    return total / config.eval_batches


def _microbatches(source: Any, k: int, t: int, device: torch.device, workers: dict[int, StageWorker], *,
                  held_out: bool = False) -> tuple[list[boundary.Boundary], list[boundary.Boundary]]:
    """Batch ``k``'s inputs and targets (held-out batch ``k``), each split into ``t`` microbatches on ``device``.

    Only a rank with a first or a last stage draws the batch (the inputs go to
    the first stage, the targets to the last, as DeepSpeed's pipeline engine
    loads them); a rank with neither gets empty lists and loads nothing.
    """
    if not any(w.is_first or w.is_last for w in workers.values()):
        return [], []
    inputs, targets = source.eval_batch(k) if held_out else source.batch(k)
    return ([boundary.to(m, device) for m in split_microbatches(inputs, t)],
            [boundary.to(m, device) for m in split_microbatches(targets, t)])


def seconds_since(timings: Sequence[tuple[Action, int, int]], offset: int) -> list[tuple[int, str, int, float, float]]:
    """Executor timings (perf_counter ns) as ``RankRecord.records`` rows, seconds since ``offset`` (rank 0's clock)."""
    return [(a.stage, a.op.value, a.microbatch, (t0 - offset) * 1e-9, (t1 - offset) * 1e-9) for a, t0, t1 in timings]


def final_parameters(config: TrainConfig, workers: dict[int, StageWorker]) -> dict[int, dict[str, torch.Tensor]]:
    """Per local stage, copies of its parameters when the config asks to collect them (else empty)."""
    if not config.collect_parameters:
        return {}
    return {s: {k: p.detach().cpu().clone() for k, p in w.named_parameters().items()} for s, w in workers.items()}


def gather_run(config: TrainConfig, mine: RankRecord, rank: int, world: int, started: float,
               first_step: int = 0, first_update: int | None = None) -> RunRecord | None:
    """Gather every rank's record on rank 0: the ``RunRecord`` there, None elsewhere.

    ``first_step``/``first_update``: what the resumed checkpoint had done, read
    when the run started (a run saving to the folder it resumed from rewrites it).
    """
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    assert gathered is not None
    return RunRecord(config, sorted(gathered, key=lambda r: r.rank), time.perf_counter() - started,
                     used_transport(), first_step, first_step if first_update is None else first_update)
