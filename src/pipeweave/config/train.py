"""``TrainConfig``: a training run's whole configuration, one section per concern, declared once.

``pipeweave train``'s options are generated from these fields (``config.cli``),
files hold the same fields as TOML (``config.toml``), and
``pipeweave.train(config)`` takes it. Each section checks its own fields; what
follows from several together (defaults that depend on the model or the
schedule, options that apply to some schedules only) is resolved here, in
``TrainConfig.__post_init__``. What needs the model itself (the split a
partitioner chooses, a searched schedule's costs, a schedule file) is resolved
once per run by ``runtime.run.resolve``.

Example:
    >>> config = TrainConfig(num_stages=4, tensor_parallel=2, steps=5)
    >>> config.schedule.num_stages, config.parallel.tensor_parallel, config.training.optimizer
    (4, 2, 'adamw')
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

from pipeweave.config.model import ModelSpec
from pipeweave.config.policy import PolicyOptions
from pipeweave.config.run_sections import CheckpointConfig, LaunchConfig, LoggingConfig, TrainingConfig
from pipeweave.config.schema import check_section, flag_of, hints, sections
from pipeweave.config.sections import (
    GENERATOR_OPTIONS,
    DataConfig,
    MemoryConfig,
    ParallelConfig,
    PartitionConfig,
    ScheduleConfig,
)
from pipeweave.errors import UserError
from pipeweave.schedule.registry import SCHEDULES, schedule_defaults

DEFAULT_SCHEDULE = "zb-h1"
"""The schedule of a run without ``-s``."""
DEFAULT_STAGES, DEFAULT_MICROBATCHES = 2, 4
PRIMARY = {"schedule": "name", "data": "path"}
"""Sections that a plain string names: ``schedule="1f1b"``, ``data="corpus.txt"``."""
POLICY_TAKERS = {
    "anneal_steps": "pipemare",
    "decay": "pipemare",
    "correction": "pipemare",
    "averaging_rate": "avgpipe",
    "averaging_period": "avgpipe",
}
"""``PolicyOptions`` field -> the schedule whose policy reads it."""


def default_model() -> ModelSpec:
    """``pipeweave train``'s model: a gpt small enough to train 30 steps in a few seconds on 2 cores."""
    return ModelSpec(kind="gpt", layers=4, hidden=128, heads=4, seq_len=64)


@dataclass(frozen=True, kw_only=True, init=False)
class TrainConfig:
    """Everything a rank needs to take part in a run (picklable); its defaults are ``pipeweave train``'s.

    Give whole sections (``parallel=ParallelConfig(tensor_parallel=2)``) or any section's fields by name
    (``tensor_parallel=2``: names are unique over the sections); a field given by name overrides its section.
    ``schedule="1f1b"`` names the schedule and ``data="FILE"`` the text file. ``dataclasses.replace`` takes
    the same names.
    """

    model: ModelSpec = field(default_factory=default_model)
    """The model: built in (gpt, mlp), your own (``FILE.py:NAME``) or a Hugging Face one (``hf:TYPE``)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Which schedule runs, on how many ranks and microbatches."""
    data: DataConfig = field(default_factory=DataConfig)
    """What the model trains on, in what batches."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor and data parallelism beside the pipeline."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """The memory levers."""
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    """How the layers are split over the stages."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Steps, optimizer, precision, clipping."""
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    """The asynchronous schedules' weight-policy hyperparameters."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints saved and resumed."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """What the run shows and writes."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """How the ranks start and talk."""

    def __init__(self, **given: Any) -> None:
        owner = field_owners(type(self))
        by_section: dict[str, dict[str, Any]] = {}
        for key, value in given.items():
            if key in PRIMARY and isinstance(value, str):
                key = PRIMARY[key]
            key = _FORMER[key][1] if key in _FORMER else key
            if key in owner:
                by_section.setdefault(owner[key], {})[key] = value
            elif key not in hints(type(self)):
                raise UserError(f"{key!r} is no field of TrainConfig; see pipeweave train --help")
        for f in dataclasses.fields(self):
            value = given.get(f.name)
            if value is None or (f.name in PRIMARY and isinstance(value, str)):
                value = f.default_factory()  # type: ignore[misc]
            if f.name in by_section and dataclasses.is_dataclass(value):
                value = dataclasses.replace(value, **by_section[f.name])
            object.__setattr__(self, f.name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        for name, cls in sections(type(self)):
            if not isinstance(getattr(self, name), cls):
                raise UserError(
                    f"{name}={getattr(self, name)!r} is a {type(getattr(self, name)).__name__}; give a {cls.__name__}"
                )
        _resolve_schedule(self)
        _resolve_training(self)
        if self.data.data_seed is None:
            _set(self, "data", data_seed=self.model.seed)
        _check_replicas(self)
        _check_applies(self)
        if self.parallel.zero and self.parallel.data_parallel == 1:
            raise UserError(
                f"--zero {self.parallel.zero} shards over the --data-parallel replicas and this run has one; give "
                "--data-parallel 2 or more, or drop --zero"
            )
        if self.parallel.context_parallel > 1:
            _check_context_parallel(self)
        if self.parallel.expert_parallel > 1:
            _check_expert_parallel(self)
        if self.data.min_seq_len is not None:
            _check_min_seq_len(self, self.data.min_seq_len)
        _check_documents(self)
        _check_loss_scaling(self)

    def check(self) -> None:
        """Check every section's fields again (a config is checked on construction; this is for one changed by force).

        Raises:
            UserError: a value of the wrong type or out of range.
        """
        for name, _ in sections(type(self)):
            check_section(getattr(self, name))

    def get(self, name: str) -> Any:
        """The value of a section's field by its name alone: ``config.get("tensor_parallel")``."""
        return getattr(getattr(self, field_owners(type(self))[name]), name)

    def __getattr__(self, name: str) -> Any:
        """A section's field read by its name alone (``config.tensor_parallel``), or a section's property
        (``config.recomputes``); the library itself reads through the sections."""
        owner = field_owners(type(self)).get(name) or _PROPERTIES.get(name)
        if name in _FORMER:
            owner, name = _FORMER[name]
        if owner is None or name.startswith("__"):
            raise AttributeError(f"'TrainConfig' object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, owner), name)

    def replace(self, **flat: Any) -> TrainConfig:
        """A copy with fields changed, by name or whole sections (``dataclasses.replace`` does the same).

        Example:
            >>> TrainConfig(steps=5).replace(steps=7, data_parallel=2).training.steps
            7
        """
        return dataclasses.replace(self, **{PRIMARY.get(k, k) if isinstance(v, str) else k: v for k, v in flat.items()})

    @property
    def is_stream(self) -> bool:
        """An asynchronous schedule: one stream of ``steps`` mini-batches (``runtime.stream``)."""
        if self.schedule.written is not None:
            return False
        info = SCHEDULES.get(self.schedule.name or "")
        return info is not None and not info.synchronous

    @property
    def clips_by_collective(self) -> bool:
        """``--clip-grad-norm`` with tensor, context or data parallelism: one all-reduce of the norm at ``U``
        (``runtime.clip``) instead of post-validation, which passes whole stages' norms down one pipeline."""
        return self.training.post_validation is not None and (
            self.parallel.per_stage_rank > 1 or self.parallel.data_parallel > 1
        )

    @property
    def variable_shapes(self) -> bool:
        """Whether the per-sample shapes of the messages change from microbatch to microbatch."""
        return self.data.min_seq_len is not None


_PROPERTIES = {"recompute_of": "memory", "recomputes": "memory", "lr_scheduled": "training"}
"""Section methods and properties ``TrainConfig.__getattr__`` reads by name."""
_FORMER = {"schedule_options": ("schedule", "options"), "schedule_file": ("schedule", "written")}
"""Names the flat configuration had for internal fields, read as before."""


@functools.cache
def field_owners(cls: type = TrainConfig) -> dict[str, str]:
    """Each section field's name -> its section's name (names are unique over the sections)."""
    owner: dict[str, str] = {}
    for name, section in sections(cls):
        for f in dataclasses.fields(section):
            if f.name in owner:
                raise TypeError(f"{f.name} is a field of both [{owner[f.name]}] and [{name}]; rename one")
            owner[f.name] = name
    return owner


def _set(config: TrainConfig, section: str, **values: Any) -> None:
    """Fill resolved values into a section of a config under construction."""
    object.__setattr__(config, section, dataclasses.replace(getattr(config, section), **values))


def _resolve_schedule(config: TrainConfig) -> None:
    """The schedule's name, sizes and generator options, from the fields given and the schedule file."""
    s = config.schedule
    if s.schedule_path is not None and s.name is not None and s.name != s.schedule_path:
        raise UserError(f"-s {s.name} and --schedule-file {s.schedule_path} both name the schedule; give one of them")
    name = s.schedule_path if s.schedule_path is not None else s.name or DEFAULT_SCHEDULE
    written = s.written
    unread = s.schedule_path is not None and written is None  # sized by the file once it is read (resolve)
    stages = s.num_stages if s.num_stages is not None or unread else written.num_ranks if written else DEFAULT_STAGES
    if s.num_stages is None and s.stage_replicas is not None:  # one process per replica
        stages = sum(s.stage_replicas)
    micro = (
        s.num_microbatches
        if s.num_microbatches is not None or unread
        else written.num_microbatches
        if written
        else DEFAULT_MICROBATCHES
    )
    options = dict(s.options)
    for key, keyword in GENERATOR_OPTIONS.items():
        value = getattr(s, key)
        if value is not None:
            options[keyword] = value
    _set(config, "schedule", name=name, num_stages=stages, num_microbatches=micro, options=tuple(options.items()))
    if written is not None:
        _check_schedule_file(config, written)


def _resolve_training(config: TrainConfig) -> None:
    """The optimizer, learning rate and momentum left to their defaults, which depend on the model and schedule."""
    t = config.training
    optimizer = t.optimizer or ("sgd" if config.model.kind == "mlp" else "adamw")
    lr = t.lr if t.lr is not None else (0.1 if optimizer in ("sgd", "nesterov") else 3e-3)
    momentum = (
        t.momentum
        if t.momentum is not None
        else 0.9
        if optimizer == "nesterov"
        else float(schedule_defaults(config.schedule.name or "").get("momentum", 0.0))
    )
    if optimizer == "nesterov" and not momentum:
        raise UserError("--optimizer nesterov needs a momentum; give --momentum 0.9 (or drop --momentum 0)")
    _set(config, "training", optimizer=optimizer, lr=lr, momentum=momentum)


def _check_loss_scaling(config: TrainConfig) -> None:
    """fp16's loss scaling needs a step to skip; its options apply to fp16 alone."""
    training = config.training
    if training.precision == "fp16" and config.is_stream:
        raise UserError(
            f"--precision fp16 skips the update of a step whose gradients overflow, and {config.schedule.name} "
            "updates per microbatch with no step to skip; give --precision bf16 or a synchronous schedule"
        )
    if training.precision != "fp16":
        default = TrainingConfig()
        for f in dataclasses.fields(TrainingConfig):
            if f.name.startswith("loss_scale") and getattr(training, f.name) != getattr(default, f.name):
                raise UserError(f"{flag_of(f)} applies to --precision fp16; give --precision fp16 or drop it")


def _check_replicas(config: TrainConfig) -> None:
    """``--stage-replicas``: pipedream's alone, one process per replica, no other parallelism around it."""
    replicas = config.schedule.stage_replicas
    if replicas is None:
        return
    text, name = ",".join(map(str, replicas)), config.schedule.name
    if name != "pipedream":
        kind = "synchronous" if not config.is_stream else "asynchronous"
        raise UserError(
            f"--stage-replicas {text} deals microbatches to replicated parts, which pipedream's 1F1B-RR runs and "
            f"{name} ({kind}) cannot; give -s pipedream, or replicate whole pipelines with --data-parallel"
        )
    if sum(replicas) != config.schedule.num_stages:
        raise UserError(
            f"--stage-replicas {text} needs {sum(replicas)} processes but --stages is {config.schedule.num_stages}; "
            f"give --stages {sum(replicas)} or counts summing to {config.schedule.num_stages}"
        )
    if config.model.is_transformer and config.model.tie_embeddings:  # a tie's exchange knows one pipeline's ends
        raise UserError(
            f"--stage-replicas {text} routes microbatches through several pipelines, whose ends a tie cannot pair; "
            "drop --tie-embeddings (or --stage-replicas)"
        )
    for flag, value in (
        ("--data-parallel", config.parallel.data_parallel),
        ("--tensor-parallel", config.parallel.tensor_parallel),
    ):
        if value != 1:
            raise UserError(
                f"--stage-replicas {text} runs one process per replica, without {flag} {value}; drop one of them"
            )


def _check_expert_parallel(config: TrainConfig) -> None:
    """--expert-parallel E splits E of the synchronous run's data-parallel replicas' experts among them; the
    model's own rules (it has experts, E divides them) are the plan's (``runtime.run.resolve``)."""
    ep, parallel = config.parallel.expert_parallel, config.parallel
    if parallel.data_parallel % ep:
        raise UserError(
            f"--expert-parallel {ep} splits the experts over that many of the --data-parallel "
            f"{parallel.data_parallel} replicas; give a divisor of {parallel.data_parallel}, or a multiple of {ep} as --data-parallel"
        )
    if parallel.zero:
        raise UserError(
            f"--zero {parallel.zero} does not shard expert-parallel experts; drop --zero or --expert-parallel"
        )
    if config.is_stream:
        raise UserError(
            f"--expert-parallel {ep} needs a synchronous schedule (its replicas exchange tokens within one step); "
            f"{config.schedule.name} is asynchronous: choose e.g. 1f1b"
        )


def _check_applies(config: TrainConfig) -> None:
    """Generator and policy options given to a schedule that does not take them: one line each."""
    name = config.schedule.name
    info = SCHEDULES.get(name or "")
    if info is None:
        return
    for key, keyword in GENERATOR_OPTIONS.items():
        if getattr(config.schedule, key) is not None and keyword not in inspect.signature(info.generator).parameters:
            takers = [n for n, i in SCHEDULES.items() if keyword in inspect.signature(i.generator).parameters]
            flag = flag_of(next(f for f in dataclasses.fields(ScheduleConfig) if f.name == key))
            raise UserError(f"{flag} applies to {', '.join(takers)}, not {name}; drop it")
    default = PolicyOptions()
    for f in dataclasses.fields(PolicyOptions):
        taker = POLICY_TAKERS[f.name]
        if getattr(config.policy, f.name) != getattr(default, f.name) and name != taker:
            raise UserError(f"{flag_of(f)} applies to {taker}, not {name}; drop it")


def _check_schedule_file(config: TrainConfig, schedule: Any) -> None:
    """A schedule from a file is synchronous, and the run's sizes are its own (one line otherwise)."""
    s = config.schedule
    if not schedule.is_synchronous:
        raise UserError(
            f"--schedule-file {s.name}: train takes synchronous schedules from a file, this one "
            f"has policy {schedule.policy.value}; use -s NAME for an asynchronous schedule"
        )
    for flag, given, own in (
        ("--stages", s.num_stages, schedule.num_ranks),
        ("--microbatches", s.num_microbatches, schedule.num_microbatches),
    ):
        if given != own:
            raise UserError(
                f"{flag} {given} conflicts with --schedule-file {s.name}, which has {own}; "
                f"drop {flag} (the file sets it)"
            )
    if s.num_chunks is not None and s.num_chunks != schedule.num_chunks:
        raise UserError(
            f"--chunks {s.num_chunks} conflicts with --schedule-file {s.name}, which has "
            f"{schedule.num_chunks} per rank; drop --chunks (the file sets it)"
        )


def _check_documents(config: TrainConfig) -> None:
    """--tokenizer, --text-field and --eval-data read --data's documents, --eval-data for --eval-every."""
    data = config.data
    if data.path is None and (data.tokenizer is not None or data.eval_path is not None):
        flag = "--tokenizer" if data.tokenizer is not None else "--eval-data"
        raise UserError(f"{flag} encodes the documents of --data and none is given; give --data FILE or drop {flag}")
    if data.eval_path is not None and data.eval_every is None:
        raise UserError(f"--eval-data {data.eval_path} is evaluated by --eval-every; give --eval-every N")
    if config.model.kind == "mlp" and data.path is not None:
        raise UserError("--data applies to --model gpt, llama or hf:; the mlp fits fixed random targets: drop --data")


def _check_context_parallel(config: TrainConfig) -> None:
    """``--context-parallel C``: a built-in transformer whose sequences cut into 2C equal chunks, without the
    options it does not compose with yet (one line each)."""
    c, spec = config.parallel.context_parallel, config.model
    if not spec.is_transformer:
        raise UserError(
            f"--context-parallel {c} splits the sequence of the gpt's or the llama's attention; --model "
            f"{spec.entry if spec.kind == 'custom' else spec.kind} has no such attention: drop --context-parallel"
        )
    if spec.seq_len % (2 * c):
        raise UserError(
            f"--seq-len {spec.seq_len} is not divisible by 2 x --context-parallel {c} = {2 * c} (the load-balanced "
            f"chunks); give a sequence length that is a multiple of {2 * c}"
        )
    unsupported = (
        (config.is_stream, f"the asynchronous {config.schedule.name}", "use a synchronous schedule (1f1b, zb-h1, ...)"),
        (config.parallel.zero, f"--zero {config.parallel.zero}", "use --zero 0"),
        (config.data.min_seq_len is not None, "--min-seq-len", "drop --min-seq-len"),
        (config.memory.balance_activations, "--balance-activations", "drop --balance-activations"),
        (config.training.compile, "--compile", "drop --compile"),
        (
            bool(spec.moe_experts),
            f"--moe-experts {spec.moe_experts}",
            "drop --context-parallel (the load-balancing loss would be a slice's, not the sequence's)",
        ),
    )
    for on, what, fix in unsupported:
        if on:
            raise UserError(f"--context-parallel {c} with {what} is not supported yet; {fix}")


def _check_min_seq_len(config: TrainConfig, length: int) -> None:
    """Variable lengths: a model of sequences (the gpt's corpus, a custom model's dataset), cut no longer than
    its sequences, on a synchronous schedule."""
    from pipeweave.data import longest_sequence
    from pipeweave.models.hf import is_hf

    longest = longest_sequence(config.model)
    if not 1 <= length <= longest:
        where = "" if config.model.is_transformer or is_hf(config.model.entry) else " (the dataset's sequences)"
        flag = "--seq-len " if not where else ""
        raise UserError(f"--min-seq-len {length} is invalid; give a length in [1, {flag}{longest}]{where}")
    if config.is_stream:
        raise UserError(
            f"--min-seq-len applies to synchronous schedules; {config.schedule.name} is asynchronous; "
            "drop --min-seq-len or use a synchronous schedule"
        )
