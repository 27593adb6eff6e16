"""A training run's configuration: everything a rank needs, checked before anything is spawned.

``TrainConfig`` is what ``pipeweave train`` builds from its options and every
rank receives (picklable). ``TrainConfig.check`` builds and validates the
schedule, the partition, the data split, the checkpoint to resume and the
learning rates, so an invalid configuration is one line naming the value and
the fix, not a crash on every rank. An asynchronous run's streams
(``segments``, ``stream_segments``) are part of its configuration too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeweave.data import data_source, split_microbatches
from pipeweave.errors import UserError
from pipeweave.models.precision import check as precision_check
from pipeweave.models.spec import ModelSpec, uniform_parts
from pipeweave.partition.methods import PartitionContext, explicit
from pipeweave.partition.problem import LayerCosts, Partition
from pipeweave.runtime import checkpoint
from pipeweave.runtime.lr_schedule import LrSchedule
from pipeweave.runtime.policy import PolicyOptions
from pipeweave.runtime.stage import OptimizerFactory
from pipeweave.runtime.validation_step import PostValidation, check_post_validation
from pipeweave.schedule import SCHEDULES, Schedule, generate, validate
from pipeweave.schedule.data_parallel import data_parallel


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
                f"{schedule.num_parts} layers, the model has {self.model.layers_described}; reduce --stages or "
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
        source = None
        if self.data is not None or (self.model.kind == "gpt" and self.model.vocab < 256):
            # the file is read on the first and last ranks; a bad one is one line here, not a failing rank
            source = data_source(self.model, batch_size=self.batch_size, seed=self.seed, path=self.data)
        if self.is_stream:
            from pipeweave.runtime.stream import stream_rates

            stream_rates(self, schedule)
        else:
            self.learning_rates(checkpoint.steps_done(self))
        if self.eval_every is not None:
            self._check_evaluation(source)
        return schedule

    def _check_evaluation(self, source: Any) -> None:
        if self.model.kind == "mlp":
            raise UserError("--eval-every applies to --model gpt or a custom model (the mlp fits fixed random "
                            "targets: there is nothing held out to generalise to); drop it or change --model")
        if self.model.kind == "custom" and self.model.custom.eval_dataset is None:
            raise UserError(f"--eval-every needs held-out data and {self.model.entry} has no eval_dataset; give "
                            "LayerModel(eval_dataset=...) or drop --eval-every")
        if self.data is not None and not source.held_out:  # source: --data's ByteCorpus, built by check
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
