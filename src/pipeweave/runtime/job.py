"""A distributed training run: its configuration, and what every rank does in it.

``TrainConfig`` is checked before anything is spawned (``TrainConfig.check``
builds and validates the schedule, the partition and the data split), so an
invalid configuration is one line, not a crash on every rank. ``run_rank`` is
the function each rank runs: build its stage workers, align clocks, train for
``steps`` steps through the ``Executor``, and gather everything measured to
rank 0, which returns it as a ``RunRecord``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.data import data_source, split_microbatches
from pipeweave.data.corpus import read_text_file, split_blocks
from pipeweave.errors import UserError
from pipeweave.models import boundary
from pipeweave.models.precision import check as precision_check
from pipeweave.models.spec import ModelSpec, uniform_parts
from pipeweave.partition.methods import PartitionContext, explicit
from pipeweave.partition.problem import LayerCosts, Partition
from pipeweave.runtime import checkpoint, launch as launch_module
from pipeweave.runtime.executor import Executor
from pipeweave.runtime.lr_schedule import LrSchedule, set_lr
from pipeweave.runtime.policy import PolicyOptions
from pipeweave.runtime.stage import OptimizerFactory, StageWorker
from pipeweave.runtime.trace import align_clocks
from pipeweave.runtime.validation_step import PostValidation, check_post_validation, install_post_validation
from pipeweave.schedule import SCHEDULES, Schedule, generate, lower, validate
from pipeweave.schedule.data_parallel import data_parallel
from pipeweave.schedule.evaluation import forward_only
from pipeweave.schedule.ir import Action, Op

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a rank needs to take part in a run (picklable)."""

    schedule: str = "1f1b"
    """Registry name of the schedule."""
    num_stages: int = 2
    """D: pipeline ranks."""
    num_microbatches: int = 4
    """T: microbatches per step."""
    num_chunks: int | None = None
    """v: chunks per rank, for schedules that take it."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The model."""
    batch_size: int = 8
    """Samples per step (split into T microbatches, the last ones may be smaller)."""
    steps: int = 10
    """Optimizer steps."""
    lr: float = 0.1
    """Learning rate."""
    optimizer: str = "sgd"
    """``sgd`` or ``adamw``."""
    recompute: bool = False
    """Activation recomputation on every stage."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``: every forward under bfloat16 autocast (``models.precision``)."""
    seed: int = 0
    """Data seed (the model's seed is ``model.seed``)."""
    data: str | None = None
    """gpt only: a text file instead of the built-in corpus."""
    collect_parameters: bool = False
    """Send every stage's final parameters to rank 0 (tests)."""
    layers_per_part: tuple[int, ...] | None = None
    """Layer count of each part (``pipeweave.partition``); None: uniform."""
    data_parallel: int = 1
    """P: pipeline replicas (``schedule.data_parallel``); the batch is the global batch, T per replica."""
    memory_every_step: bool = False
    """Count activation bytes (saved-tensor hooks) in every step, not only the first.

    Every step holds the same tensors (same microbatch sizes, same schedule), so
    the first step's peak is every step's; the hooks cost a few % of compute time.
    """
    momentum: float = 0.0
    """SGD momentum (SpecTrain predicts along its velocity)."""
    schedule_options: tuple[tuple[str, Any], ...] = ()
    """Options of the schedule's generator, e.g. ``(("warmup_steps", 2),)`` (asynchronous schedules)."""
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    """Run-time hyperparameters of the asynchronous weight policies (``runtime.policy``)."""
    post_validation: PostValidation | None = None
    """Clip and skip without a barrier: optimistic step, exact rollback (``runtime.validation_step``)."""
    save: str | None = None
    """Write a checkpoint to this folder after the last step (``runtime.checkpoint``)."""
    save_every: int | None = None
    """With ``save``: also every this many steps (each replaces the previous)."""
    lr_schedule: str = "constant"
    """``constant``, ``cosine`` or ``linear`` decay after ``lr_warmup`` warm-up steps (``runtime.lr_schedule``)."""
    lr_warmup: int = 0
    """Steps of linear warm-up to ``lr``."""
    lr_decay_steps: int | None = None
    """The step where the decay ends; None: the last step of this run (give it when resuming)."""
    eval_every: int | None = None
    """Evaluate every this many steps and after the last: the mean loss of ``eval_batches`` held-out batches."""
    eval_batches: int = 4
    """Held-out batches per evaluation (``ByteCorpus.eval_batch``), the same ones every time."""
    resume: str | None = None
    """Start from the checkpoint in this folder: its parameters, optimizer state and step (``runtime.checkpoint``)."""

    def __post_init__(self) -> None:
        precision_check(self.precision)
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optimizer {self.optimizer!r} is unknown; choose one of: {', '.join(OPTIMIZERS)}")
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if value < 1:
                raise UserError(f"--{name.replace('_size', '')} {value} is invalid; give an integer >= 1")
        if not self.lr > 0:
            raise UserError(f"--lr {self.lr} is invalid; give a learning rate > 0")
        if self.save_every is not None and (self.save_every < 1 or self.save is None):
            raise UserError(f"--save-every {self.save_every} is invalid; give an integer >= 1 together with --save DIR")
        if self.eval_every is not None and self.eval_every < 1:
            raise UserError(f"--eval-every {self.eval_every} is invalid; give an integer >= 1")
        if self.eval_batches < 1:
            raise UserError(f"--eval-batches {self.eval_batches} is invalid; give an integer >= 1")
        if not 0.0 <= self.momentum < 1.0:
            raise UserError(f"--momentum {self.momentum} is invalid; give 0 <= momentum < 1")

    @property
    def is_stream(self) -> bool:
        """An asynchronous schedule: one stream of ``steps`` mini-batches (``runtime.stream``)."""
        info = SCHEDULES.get(self.schedule)
        return info is not None and not info.synchronous

    def build_schedule(self) -> Schedule:
        """The schedule of this run (raises ScheduleError, a UserError, if it cannot be built).

        An asynchronous run: its streams (``stream_segments``) as one schedule (``schedule.stream.concatenate``).
        """
        if self.is_stream:
            from pipeweave.schedule.stream import concatenate

            return concatenate(self.stream_segments())
        base = generate(self.schedule, num_stages=self.num_stages, num_microbatches=self.num_microbatches,
                        num_chunks=self.num_chunks, **dict(self.schedule_options))
        return data_parallel(base, self.data_parallel) if self.data_parallel != 1 else base

    def segments(self) -> list[tuple[int, int]]:
        """An asynchronous run's streams, as ``(first step of this run, steps)``.

        A stream has no step boundary to evaluate or save at, so the run drains
        it after every ``eval_every``-th and ``save_every``-th step (of this run,
        as synchronous runs count them) and goes on with a new stream; without
        them the run is one stream. A drain is a flush: the segments' staleness
        starts over (``runtime.stream``).

        Example:
            >>> TrainConfig(schedule="pipedream", steps=7, eval_every=3).segments()
            [(0, 3), (3, 3), (6, 1)]
        """
        from pipeweave.runtime.stream import check_segment_steps

        cuts = {self.steps}
        for flag, every in (("--eval-every", self.eval_every), ("--save-every", self.save_every)):
            if every is not None and every < self.steps:
                check_segment_steps(self, flag, every)
                cuts.update(range(every, self.steps, every))
        bounds = [0, *sorted(cuts)]
        return [(a, b - a) for a, b in zip(bounds, bounds[1:])]

    def stream_segments(self) -> list[Schedule]:
        """An asynchronous run's streams, one per ``segments`` entry, each generated for its steps."""
        from pipeweave.runtime.stream import segment_options

        done = checkpoint.steps_done(self)
        return [generate(self.schedule, num_stages=self.num_stages, num_microbatches=self.num_microbatches,
                         num_chunks=self.num_chunks, **segment_options(self, done + first, steps))
                for first, steps in self.segments()]

    def layer_ranges(self, schedule: Schedule) -> list[range]:
        """The layers of each part: ``layers_per_part``, checked, or uniform."""
        if self.layers_per_part is None:
            return uniform_parts(self.model.num_layers, schedule.num_parts)
        counts = Partition(self.layers_per_part)
        explicit(LayerCosts.uniform(self.model.num_layers), schedule.num_parts, PartitionContext(counts=counts.counts))
        return [range(a, b) for a, b in counts.bounds]

    def check(self) -> Schedule:
        """Validate everything that can be validated without spawning; returns the schedule.

        Raises:
            UserError: one line naming the value and the fix.
        """
        schedule = self.build_schedule()
        if not schedule.is_synchronous and self.data_parallel != 1:
            raise UserError(f"{self.schedule} is asynchronous; --data-parallel applies to synchronous schedules, drop it")
        if not schedule.is_synchronous:
            from pipeweave.runtime.stream import check_stream_model

            check_stream_model(self.model)
        validate(schedule)
        if self.model.num_layers < schedule.num_parts:
            raise UserError(
                f"{schedule.num_parts} parts ({self.schedule}, D={self.num_stages}) need at least "
                f"{schedule.num_parts} layers, the model has {self.model.num_layers}; reduce --stages or "
                + ("give the model more layers" if self.model.kind == "custom" else "increase --layers")
            )
        per_batch = self.num_microbatches * self.data_parallel if self.is_stream else schedule.num_microbatches
        if self.batch_size < per_batch:
            raise UserError(f"--batch {self.batch_size} cannot make {per_batch} microbatches; "
                            "increase --batch or reduce --microbatches")
        self.layer_ranges(schedule)
        if self.model.kind == "custom":
            self.probe_model()
        if self.post_validation is not None:
            check_post_validation(schedule)
        checkpoint.check(self)
        if self.is_stream:
            from pipeweave.runtime.stream import stream_rates

            stream_rates(self, schedule)
        else:
            self.learning_rates(checkpoint.steps_done(self))
        if self.eval_every is not None:
            self._check_evaluation()
        return schedule

    def _check_evaluation(self) -> None:
        if self.model.kind == "mlp":
            raise UserError("--eval-every applies to --model gpt or a custom model (the mlp fits fixed random "
                            "targets: there is nothing held out to generalise to); drop it or change --model")
        if self.model.kind == "custom" and self.model.custom.eval_dataset is None:
            raise UserError(f"--eval-every needs held-out data and {self.model.entry} has no eval_dataset; give "
                            "LayerModel(eval_dataset=...) or drop --eval-every")
        if self.data is not None and not split_blocks(len(read_text_file(self.data)), self.model.seq_len)[1]:
            raise UserError(f"--data {self.data} is too short to hold out a window of seq_len+1="
                            f"{self.model.seq_len + 1} bytes for evaluation; give a longer file or drop --eval-every")

    @property
    def lr_scheduled(self) -> bool:
        """Whether the learning rate moves (a warm-up or a decay): each update then sets its own."""
        return self.lr_schedule != "constant" or self.lr_warmup > 0

    def learning_rates(self, first_step: int = 0, updates: int | None = None) -> LrSchedule:
        """The learning rate of every step of the training (``runtime.lr_schedule``), ``first_step`` steps done.

        An asynchronous stream counts its stages' ``updates`` (``stream_updates``) instead of steps:
        each stage's k-th update takes the rate of step k.
        """
        end = updates if updates is not None else first_step + self.steps
        decay = self.lr_decay_steps if self.lr_decay_steps is not None else end
        return LrSchedule(self.lr_schedule, self.lr, self.lr_warmup, decay)

    def optimizer_factory(self) -> OptimizerFactory:
        lr = self.lr
        if self.optimizer == "adamw":
            return lambda params: torch.optim.AdamW(params, lr=lr)
        momentum = self.momentum
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)

    @property
    def microbatch_sizes(self) -> list[int]:
        t = self.num_microbatches * self.data_parallel  # every replica's microbatches
        sizes = [len(m) for m in split_microbatches(torch.empty(self.batch_size, 0), t)]
        return sizes * self.steps if self.is_stream else sizes  # a stream: every mini-batch's

    def largest_message_bytes(self, schedule: Schedule) -> int:
        """Bytes of the largest point-to-point message a run sends (what a shared-memory ring must hold).

        A microbatch's activation or input gradient (float32, (b, h) for the
        mlp, (b, seq, h) for the gpt, a custom model's largest as ``probe_model``
        finds it) and, where parts are replicated (Chimera,
        GEMS, DualPipe), a part's whole gradient, counted from its layers.
        """
        if self.model.kind == "custom":
            per_sample = self.probe_model()
        else:
            per_sample = self.model.hidden * (self.model.seq_len if self.model.kind == "gpt" else 1) * 4
        largest = max(self.microbatch_sizes) * per_sample
        placement = schedule.placement
        if any(len(placement.replicas(s)) > 1 for s in range(placement.num_stages)):
            largest = max(largest, int(max(self.part_weight_bytes(schedule))))  # float32, as sent
        return largest

    def probe_model(self) -> int:
        """A custom model, checked by running two samples through it: the largest bytes per sample between layers.

        Raises:
            UserError: a layer or the loss that does not fit the ``LayerModel`` contract (``models.custom.probe``).
        """
        return _probe(self.model, self.seed)

    def part_weight_bytes(self, schedule: Schedule) -> list[float]:
        """Bytes of one copy of each part's weights (M_theta), counted from the model's layers."""
        from pipeweave.models.spec import build_layers

        return [float(sum(p.numel() * p.element_size() for layer in build_layers(self.model, list(part))
                          for p in layer.parameters())) for part in self.layer_ranges(schedule)]


@functools.lru_cache(maxsize=None)
def _probe(spec: ModelSpec, seed: int) -> int:
    """``TrainConfig.probe_model``, once per model and data seed in a process."""
    from pipeweave.models.custom import probe
    from pipeweave.models.spec import layer_seed

    inputs, targets = data_source(spec, batch_size=2, seed=seed).batch(0)
    return probe(spec.custom, [layer_seed(spec, k) for k in range(spec.num_layers)], inputs, targets)


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
    paused_s: float = 0.0
    """Streams: seconds between them (evaluations, checkpoints) taken out of ``records`` (``stream.close_pauses``)."""

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
    evaluator: Executor | None = None
    eval_losses: list[tuple[int, float]] = []
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
        last = step + 1 == config.steps
        if config.eval_every is not None and (last or (step + 1) % config.eval_every == 0):
            if evaluator is None:
                evaluator = Executor(lower(forward_only(schedule)), rank, workers, config.microbatch_sizes, device,
                                     evaluate=True)
            eval_losses.append((done + step + 1, evaluate(evaluator, source, config, t, device)))
            launch_module.progress({"eval": len(eval_losses) - 1, "loss": eval_losses[-1][1]})
        if config.save is not None and (last or (step + 1) % (config.save_every or config.steps) == 0):
            checkpoint.save(config, schedule, workers, rank, done + step + 1)
    mine = RankRecord(rank, losses, records, executor.peak_activation_bytes,
                      sum(w.weight_bytes() for w in workers.values()), final_parameters(config, workers),
                      step_cpu, action_cpu, eval_losses=eval_losses)
    return gather_run(config, mine, rank, world, started, done)


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
               first_step: int = 0) -> RunRecord | None:
    """Gather every rank's record on rank 0: the ``RunRecord`` there, None elsewhere."""
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    assert gathered is not None
    return RunRecord(config, sorted(gathered, key=lambda r: r.rank), time.perf_counter() - started,
                     used_transport(), first_step)


def stream_updates(schedule: Schedule) -> int:
    """Updates each stage of an asynchronous stream makes (stage 0's U actions; every stage makes as many)."""
    return sum(1 for row in schedule.actions for a in row if a.op is Op.U and a.stage == 0)
