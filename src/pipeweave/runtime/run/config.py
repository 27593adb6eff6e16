"""A training run's configuration: a plain, picklable description, its values checked.

``TrainConfig`` is what ``pipeweave train`` builds from its options (or a user
writes). It holds values only: ``check`` (run on construction) refuses a value
that is invalid on its own -- a wrong type, a count below 1 -- in one line
naming the option and the fix. What follows from the values together (the
schedule, the parts, the streams, the checkpoint to resume) is resolved once
per run by ``runtime.run.plan.prepare``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields
from typing import Any

from pipeweave.data import longest_sequence
from pipeweave.errors import UserError
from pipeweave.models.hf import is_hf
from pipeweave.models.precision import check as precision_check
from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.stage.policy import PolicyOptions
from pipeweave.runtime.stage.post_validation import PostValidation
from pipeweave.schedule import SCHEDULES, Schedule
from pipeweave.sim.parallel import ZERO_STAGES
from pipeweave.sim.recompute import parse_recompute, per_part, spelled


OPTIMIZERS = ("sgd", "adamw")
ON_NONFINITE = ("stop", "skip")
MAX_BUCKET_MB = 4096.0


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a rank needs to take part in a run (picklable)."""

    schedule: str = "1f1b"
    """Registry name of the schedule (with ``schedule_file``: the file it came from)."""
    schedule_file: Schedule | None = None
    """A synchronous schedule of one pipeline written by hand (``pipeweave train --schedule-file``), used
    instead of generating ``schedule``; ``num_stages`` and ``num_microbatches`` are its own."""
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
    recompute: bool | str = "none"
    """Activation recomputation (``sim.recompute``): ``none``, ``selective`` or ``full`` for every part, or one
    mode per part comma-separated; True means ``full``, False ``none``. Kept in its one spelling (``spelled``)."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``: every forward under bfloat16 autocast (``models.precision``)."""
    seed: int = 0
    """Data seed (the model's seed is ``model.seed``)."""
    data: str | None = None
    """gpt only: a text file instead of the built-in corpus."""
    min_seq_len: int | None = None
    """gpt only: sequences of variable length, each microbatch of each step cut to its own length drawn from
    ``[min_seq_len, model.seq_len]`` (``data.ByteCorpus``); their shapes travel with every message
    (``transport.p2p``). None: every sequence ``seq_len`` long."""
    collect_parameters: bool = False
    """Send every stage's final parameters to rank 0 (tests)."""
    layers_per_part: tuple[int, ...] | None = None
    """Layer count of each part (``pipeweave.partition``); None: uniform."""
    data_parallel: int = 1
    """P: pipeline replicas (``schedule.data_parallel``); the batch is the global batch, T per replica."""
    tensor_parallel: int = 1
    """N: processes splitting every stage's layers (``models.tensor_parallel``); a run has P x D x N processes
    on one device mesh (``runtime.transport.mesh``)."""
    sequence_parallel: bool = False
    """With ``tensor_parallel`` > 1 (gpt only): the activations between the tensor-parallel regions sharded along
    the sequence over ``tp`` (``runtime.stage.sequence_parallel``; Korthikanti et al. 2022)."""
    zero: int = 0
    """ZeRO stage of data parallelism (``runtime.zero``): 0 (every replica keeps everything), 1 (optimizer state
    sharded over the replicas, parameters all-gathered after each step) or 3 (parameters and optimizer state
    sharded; a part's parameters gathered before each F, B and I and freed after)."""
    bucket_mb: float = 25.0
    """MiB of gradients per all-reduce of the replicas' gradients (``runtime.replicas``)."""
    memory_every_step: bool = False
    """Count activation bytes (saved-tensor hooks) in every step, not only the first.

    Every step holds the same tensors (same microbatch sizes, same schedule), so
    the first step's peak is every step's; the hooks cost a few % of compute time.
    Sequences of variable length (``min_seq_len``) are counted in every step regardless.
    """
    momentum: float = 0.0
    """SGD momentum (SpecTrain predicts along its velocity)."""
    schedule_options: tuple[tuple[str, Any], ...] = ()
    """Options of the schedule's generator, e.g. ``(("warmup_steps", 2),)`` (asynchronous schedules)."""
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    """Run-time hyperparameters of the asynchronous weight policies (``runtime.stage.policy``)."""
    post_validation: PostValidation | None = None
    """Clip and skip without a barrier: optimistic step, exact rollback (``runtime.stage.post_validation``)."""
    on_nonfinite: str = "stop"
    """A step whose loss (or post-validated gradient norm) is not finite: ``stop`` the run, or ``skip`` its update."""
    save: str | None = None
    """Write a checkpoint to this folder after the last step (``runtime.run.checkpoint``)."""
    save_every: int | None = None
    """With ``save``: also every this many steps (each a new checkpoint; ``keep_checkpoints`` are kept)."""
    keep_checkpoints: int = 2
    """The newest checkpoints of the run kept in ``save`` (older ones are removed once a newer one is whole)."""
    overwrite: bool = False
    """Save into a folder holding another run's checkpoints, removing them once this run's first one is whole."""
    lr_schedule: str = "constant"
    """``constant``, ``cosine`` or ``linear`` decay after ``lr_warmup`` warm-up steps (``runtime.stage.lr_schedule``)."""
    lr_warmup: int = 0
    """Steps of linear warm-up to ``lr``."""
    lr_decay_steps: int | None = None
    """The step where the decay ends; None: the last step of this run (give it when resuming)."""
    eval_every: int | None = None
    """Evaluate every this many steps and after the last: the mean loss of ``eval_batches`` held-out batches."""
    eval_batches: int = 4
    """Held-out batches per evaluation (``ByteCorpus.eval_batch``), the same ones every time."""
    log_dir: str | None = None
    """Write every step's loss, learning rate, throughput, bubble and memory here as TensorBoard event files
    (``runtime.run.step_log``), from the process with the loss."""
    resume: str | None = None
    """Start from the checkpoint in this folder (the newest complete one in it): its parameters, optimizer state
    and step (``runtime.run.checkpoint``). ``"auto"``: from the newest in ``save`` if there is one, else afresh,
    ``steps`` then counting the whole training (``plan.resolve_auto``)."""
    offload: str | None = None
    """``all`` or part numbers, comma-separated: parts whose saved activations go to host memory after F and come back before the backward
    (``schedule.stash``; on CPU a memory-mapped file on local disk, on CUDA pinned memory)."""
    balance_activations: bool = False
    """BPipe (``schedule.stash``): a rank above its pair's mean sends a share of every microbatch's saved
    activations to rank D-1-r after F and takes it back before the backward (``transport.partner``)."""
    compress_activations: str | None = None
    """``bf16``: saved activations stashed in bfloat16 from F to the backward (lossy; ``runtime.stage.stash``)."""

    def __post_init__(self) -> None:
        if isinstance(self.recompute, (bool, str)):  # any other type: check() names it
            object.__setattr__(self, "recompute", spelled(parse_recompute(self.recompute)))
        self.check()

    def recompute_of(self, num_parts: int) -> tuple[str, ...]:
        """The recomputation mode of each of ``num_parts`` parts.

        Raises:
            UserError: a per-part list of another length.
        """
        return per_part(self.recompute, num_parts)

    @property
    def recomputes(self) -> bool:
        """Whether any part recomputes."""
        return any(m != "none" for m in parse_recompute(self.recompute))

    def check(self) -> None:
        """Refuse a value that is invalid on its own, in one line naming the option and the fix.

        Raises:
            UserError: a value of the wrong type or out of range.

        Example:
            >>> TrainConfig(batch_size="16")
            Traceback (most recent call last):
            ...
            pipeweave.errors.UserError: batch_size='16' is a str; give an integer >= 1
        """
        _check_types(self)
        precision_check(self.precision)
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optimizer {self.optimizer!r} is unknown; choose one of: {', '.join(OPTIMIZERS)}")
        if self.on_nonfinite not in ON_NONFINITE:
            raise UserError(f"--on-nonfinite {self.on_nonfinite!r} is unknown; choose one of: "
                            f"{', '.join(ON_NONFINITE)}")
        for name in ("steps", "batch_size", "data_parallel", "tensor_parallel", "eval_batches"):
            value = getattr(self, name)
            if value < 1:
                raise UserError(f"--{_FLAGS.get(name, name)} {value} is invalid; give an integer >= 1")
        if not self.lr > 0:
            raise UserError(f"--lr {self.lr} is invalid; give a learning rate > 0")
        if self.save_every is not None and (self.save_every < 1 or self.save is None):
            raise UserError(f"--save-every {self.save_every} is invalid; give an integer >= 1 together with --save DIR")
        if self.keep_checkpoints < 1:
            raise UserError(f"--keep-checkpoints {self.keep_checkpoints} is invalid; give an integer >= 1 (the "
                            "newest checkpoints kept in --save)")
        if self.resume == "auto" and self.save is None:
            raise UserError("--resume auto resumes the newest checkpoint in --save DIR; give --save DIR too (or "
                            "--resume DIR)")
        if self.eval_every is not None and self.eval_every < 1:
            raise UserError(f"--eval-every {self.eval_every} is invalid; give an integer >= 1")
        if self.zero not in ZERO_STAGES:
            raise UserError(f"--zero {self.zero} is invalid; choose one of: {', '.join(map(str, ZERO_STAGES))}")
        if not 0 < self.bucket_mb <= MAX_BUCKET_MB:  # nan too
            raise UserError(f"--bucket-mb {self.bucket_mb} is invalid; give MiB > 0 and at most {MAX_BUCKET_MB:g}")
        if not 0.0 <= self.momentum < 1.0:
            raise UserError(f"--momentum {self.momentum} is invalid; give 0 <= momentum < 1")
        if self.schedule_file is not None:
            _check_schedule_file(self, self.schedule_file)
        if self.min_seq_len is not None:
            _check_min_seq_len(self, self.min_seq_len)

    @property
    def is_stream(self) -> bool:
        """An asynchronous schedule: one stream of ``steps`` mini-batches (``runtime.stream``)."""
        if self.schedule_file is not None:
            return False
        info = SCHEDULES.get(self.schedule)
        return info is not None and not info.synchronous

    @property
    def clips_by_collective(self) -> bool:
        """``--clip-grad-norm`` with tensor or data parallelism: one all-reduce of the norm at ``U``
        (``runtime.clip``) instead of post-validation, which passes whole stages' norms down one pipeline."""
        return self.post_validation is not None and (self.tensor_parallel > 1 or self.data_parallel > 1)

    @property
    def variable_shapes(self) -> bool:
        """Whether the per-sample shapes of the messages change from microbatch to microbatch."""
        return self.min_seq_len is not None

    @property
    def lr_scheduled(self) -> bool:
        """Whether the learning rate moves (a warm-up or a decay): each update then sets its own."""
        return self.lr_schedule != "constant" or self.lr_warmup > 0


# The option of a field where its name differs (messages name what the user typed).
_FLAGS = {"batch_size": "batch", "num_stages": "stages", "num_microbatches": "microbatches",
          "num_chunks": "chunks", "data_parallel": "data-parallel", "tensor_parallel": "tensor-parallel",
          "eval_batches": "eval-batches"}
_INTS = ("num_stages", "num_microbatches", "batch_size", "steps", "seed", "data_parallel", "tensor_parallel", "zero",
         "lr_warmup", "eval_batches", "keep_checkpoints")
_OPTIONAL_INTS = ("num_chunks", "save_every", "lr_decay_steps", "eval_every", "min_seq_len")
_FLOATS = ("lr", "momentum", "bucket_mb")
_STRS = ("schedule", "optimizer", "precision", "lr_schedule", "on_nonfinite", "recompute")
_OPTIONAL_STRS = ("data", "save", "resume", "offload", "compress_activations", "log_dir")
_BOOLS = ("collect_parameters", "memory_every_step", "overwrite", "balance_activations", "sequence_parallel")


def _check_min_seq_len(config: TrainConfig, length: int) -> None:
    """Variable lengths: a model of sequences (the gpt's corpus, a custom model's dataset), cut no longer than
    its sequences, on a synchronous schedule."""
    longest = longest_sequence(config.model)
    if not 1 <= length <= longest:
        where = "" if config.model.kind == "gpt" or is_hf(config.model.entry) else " (the dataset's sequences)"
        flag = "--seq-len " if not where else ""
        raise UserError(f"--min-seq-len {length} is invalid; give a length in [1, {flag}{longest}]{where}")
    if config.is_stream:
        raise UserError(f"--min-seq-len applies to synchronous schedules; {config.schedule} is asynchronous; drop "
                        "--min-seq-len or use a synchronous schedule")


def _check_schedule_file(config: TrainConfig, schedule: Schedule) -> None:
    """A schedule from a file is synchronous, and the run's sizes are its own (one line otherwise)."""
    if not schedule.is_synchronous:
        raise UserError(f"--schedule-file {config.schedule}: train takes synchronous schedules from a file, this one "
                        f"has policy {schedule.policy.value}; use -s NAME for an asynchronous schedule")
    for flag, given, own in (("--stages", config.num_stages, schedule.num_ranks),
                             ("--microbatches", config.num_microbatches, schedule.num_microbatches)):
        if given != own:
            raise UserError(f"{flag} {given} conflicts with --schedule-file {config.schedule}, which has {own}; "
                            f"drop {flag} (the file sets it)")
    if config.num_chunks is not None and config.num_chunks != schedule.num_chunks:
        raise UserError(f"--chunks {config.num_chunks} conflicts with --schedule-file {config.schedule}, which has "
                        f"{schedule.num_chunks} per rank; drop --chunks (the file sets it)")


def _check_types(config: TrainConfig) -> None:
    """Each value of ``config`` has its field's type (a bool is not an integer here)."""
    for name in (f.name for f in fields(config)):
        value = getattr(config, name)
        if name in _OPTIONAL_INTS + _OPTIONAL_STRS and value is None:
            continue
        if name in _INTS + _OPTIONAL_INTS:
            ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer >= 1"
        elif name in _FLOATS:
            ok, want = isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"
        elif name in _STRS + _OPTIONAL_STRS:
            ok, want = isinstance(value, str), "a string"
        elif name in _BOOLS:
            ok, want = isinstance(value, bool), "True or False"
        else:
            continue
        if not ok:
            raise UserError(f"{name}={value!r} is a {type(value).__name__}; give {want}")
