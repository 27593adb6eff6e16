"""What a run is made of, resolved once from its configuration: schedule, streams, parts, rates, resume point.

``prepare(config)`` checks everything that can be checked without spawning --
the sizes first, before the schedule is generated (``sizes.check_sizes``: the
batch makes its microbatches, a layer per part, the schedule fits in
memory), then the schedule builds and validates, the model has a layer for every part, the
batch makes its microbatches, a custom model runs, the checkpoint to resume
fits, the data and evaluation options hold -- so an invalid run is one line
naming the value and the fix, not a failure on every rank. It returns a
``RunPlan``: what every rank of the run needs, computed once (the resumed
checkpoint's metadata is read here, once). Ranks receive the plan.

An asynchronous run is a sequence of streams (``segments``): a stream has no
step boundary to evaluate or save at, so the run drains it after every
``eval_every``-th and ``save_every``-th step and starts the next
(``runtime.stream``); the run's schedule is its streams concatenated
(``schedule.stream.concatenate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeweave.config import TrainConfig
from pipeweave.data import data_source
from pipeweave.errors import UserError
from pipeweave.models.build import check_selective, check_tensor_parallel
from pipeweave.models.hf import is_hf
from pipeweave.models.spec import uniform_parts
from pipeweave.partition.methods import PartitionContext, explicit
from pipeweave.partition.problem import LayerCosts, Partition
from pipeweave.runtime.process import device_for
from pipeweave.runtime.run import checkpoint, checkpoint_files
from pipeweave.runtime.run.checkpoint_files import Checkpoint
from pipeweave.runtime.run.sizes import check_batch, check_layers, check_sizes, microbatch_sizes, probe_model
from pipeweave.runtime.run.streams import segments, stream_schedules
from pipeweave.runtime.stage.lr_schedule import LrSchedule
from pipeweave.runtime.stage.post_validation import check_post_validation
from pipeweave.runtime.stage.tensor_parallel import check_plans
from pipeweave.runtime.stage.tied import tied_groups
from pipeweave.runtime.stage.worker import OptimizerFactory
from pipeweave.runtime.stream import check_stream_model, stream_updates
from pipeweave.schedule import SCHEDULES, DataParallel, Schedule, generate, validate
from pipeweave.schedule.data_parallel import data_parallel
from pipeweave.schedule.levers import parse_offload
from pipeweave.schedule.stream import concatenate
from pipeweave.weights.optimizers import build_optimizer
from pipeweave.weights.prediction import check_predictable


@dataclass(frozen=True)
class RunPlan:
    """A checked run: its configuration and what follows from it, the same on every rank (picklable)."""

    config: TrainConfig
    schedule: Schedule
    """The run's schedule: one step of a synchronous one, every stream of an asynchronous one concatenated."""
    streams: tuple[Schedule, ...]
    """An asynchronous run's streams, one per ``segments`` entry (empty for a synchronous run)."""
    parts: tuple[range, ...]
    """The layers of each part."""
    steps_done: int = 0
    """Steps (mini-batches) trained before this run: the resumed checkpoint's, else 0."""
    updates_done: int = 0
    """Updates each stage made before this run (a synchronous run's equal its steps)."""
    resumed: Checkpoint | None = None
    """The checkpoint resumed: its folder and manifest (``runtime.run.checkpoint_files``), read and checked once."""
    run_id: str = ""
    """The run's id in its checkpoints' manifests: the resumed checkpoint's, else a new one."""

    @property
    def segments(self) -> list[tuple[int, int]]:
        """``segments(config)``: the run's streams as ``(first step of this run, steps)``."""
        return segments(self.config)

    @property
    def microbatch_sizes(self) -> list[int]:
        return microbatch_sizes(self.config)

    @property
    def num_processes(self) -> int:
        """P x D x C x N: the schedule's ranks (P replicas of D; an asynchronous schedule's D, run by P replicas
        outside it), each C context-parallel groups of N tensor-parallel processes."""
        outside = self.config.parallel.data_parallel if self.config.is_stream else 1
        return self.schedule.num_ranks * outside * self.config.parallel.per_stage_rank


def prepare(config: TrainConfig) -> RunPlan:
    """Check the run ``config`` describes and resolve what its ranks need.

    ``--resume auto`` is resolved here (``resolve_auto``): the plan's config then names the checkpoint resumed
    (or none) and the steps left. A resumed checkpoint's parts are checked against its manifest (sizes, sha256).

    Raises:
        UserError: one line naming the value and the fix.
    """
    config = resolve_auto(config)
    check_sizes(config)  # before anything large is built: the schedule is generated below
    resumed = checkpoint_files.find(config.checkpoint.resume) if config.checkpoint.resume is not None else None
    meta = None if resumed is None else resumed.manifest
    steps_done = 0 if meta is None else int(meta["steps"])
    updates_done = 0 if meta is None else checkpoint.updates(meta)
    streams = stream_schedules(config, steps_done) if config.is_stream else []
    schedule = concatenate(streams) if streams else build_schedule(config)
    _check_schedule(config, schedule)
    check_nccl_groups(config, schedule, device_for(0))
    parts = layer_ranges(config, schedule)
    if config.model.kind == "custom":
        probe_model(config.model, config.data.data_seed)
    if config.clips_by_collective:
        _check_clip(config, schedule)
    elif config.training.post_validation is not None:
        check_post_validation(schedule, device_for(0))  # the ranks' device kind (CUDA wherever it is available)
        if config.training.optimizer not in ("sgd", "adamw"):
            raise UserError(
                f"--clip-grad-norm's post-validated step inverts sgd or adamw, not --optimizer "
                f"{config.training.optimizer}; give --optimizer sgd or adamw, or drop --clip-grad-norm"
            )
    run_id = _check_checkpoints(config, resumed)
    source = None
    if config.data.path is not None or (config.model.is_transformer and config.model.vocab < 256):
        # the file is read (and its documents encoded into the cache the ranks map) here, before any rank
        # starts: a bad one is one line here, not a failing rank
        source = run_data(config)
    if config.is_stream:
        stream_rates(config, schedule, updates_done)
    else:
        learning_rates(config, steps_done)
    if config.data.eval_every is not None:
        _check_evaluation(config, source)
    return RunPlan(config, schedule, tuple(streams), tuple(parts), steps_done, updates_done, resumed, run_id)


class AlreadyTrained(UserError):
    """``--resume auto`` found a checkpoint holding ``--steps`` steps already: nothing is left to train."""


def resolve_auto(config: TrainConfig) -> TrainConfig:
    """``--resume auto``: resume the newest complete checkpoint in ``--save`` for the steps left of ``--steps``
    (which counts the whole training, so a restarted command ends where the first would have), or start afresh
    where there is none. Other configurations are returned as they are.

    Raises:
        AlreadyTrained: the newest checkpoint holds ``--steps`` steps or more.
    """
    if config.checkpoint.resume != "auto":
        return config
    assert config.checkpoint.save is not None
    found = checkpoint_files.newest(Path(config.checkpoint.save))
    if found is None:
        return config.replace(resume=None)
    if found.steps >= config.training.steps:
        raise AlreadyTrained(
            f"--resume auto: {found.folder} holds {found.steps} steps of --steps {config.training.steps}; "
            "nothing is left to train (give a larger --steps to train on)"
        )
    return config.replace(resume=str(found.folder), steps=config.training.steps - found.steps)


def _check_checkpoints(config: TrainConfig, resumed: Checkpoint | None) -> str:
    """The checkpoint resumed fits this run and is whole; ``--save`` holds no other run's. The run's id."""
    if resumed is not None:
        assert config.checkpoint.resume is not None
        checkpoint.check(config, resumed.manifest)
        checkpoint_files.verify(resumed, config.checkpoint.resume)
    run_id = resumed.run if resumed is not None and resumed.run else checkpoint_files.new_run_id()
    if config.checkpoint.save is not None:
        checkpoint_files.check_save(config.checkpoint.save, run_id, resumed, config.checkpoint.overwrite)
    return run_id


def check_nccl_groups(config: TrainConfig, schedule: Schedule, device: torch.device) -> None:
    """On NCCL, a schedule of one stage per rank: with two (interleaved chunks, a V, two pipelines), a rank's
    groups of sends and receives can wait on a neighbour's in a cycle under NCCL's one stream per rank (rank 0
    sends to rank 1 in one gap and receives from it in a later one while rank 1 does the same the other way
    round: ``tests/runtime/test_batched_p2p.py`` replays interleaved-1f1b and zb-v), which a message larger
    than NCCL's buffers turns into a hang.

    Raises:
        UserError: a schedule of several stages per rank on CUDA ranks that talk over NCCL.
    """
    if device.type != "cuda" or config.launch.transport == "host" or schedule.num_ranks == 1:
        return
    stages = len(schedule.placement.stage_rank) // schedule.num_ranks
    if stages > 1:
        raise UserError(
            f"-s {config.schedule.name} puts {stages} stages on a rank, whose point-to-point groups can wait on "
            "each other in a cycle under NCCL (not yet NCCL-safe); give a schedule of one stage per rank (1f1b, "
            "zb-h1, ...), or --transport host for ranks sharing one GPU"
        )


def _check_schedule(config: TrainConfig, schedule: Schedule) -> None:
    """The schedule is valid, and the model and the batch are large enough for it."""
    if not schedule.is_synchronous and config.parallel.data_parallel != 1:
        _check_stream_data_parallel(config)
    if not schedule.is_synchronous and config.training.on_nonfinite == "skip":
        raise UserError(
            f"--on-nonfinite skip applies to synchronous schedules; {config.schedule.name} is asynchronous "
            "(its stages update per microbatch: no step to skip); use --on-nonfinite stop"
        )
    if not schedule.is_synchronous:
        check_stream_model(config.model, config.schedule.name, config.training.lr_scheduled)
    if schedule.policy.predicts:
        check_predictable(optimizer_factory(config)([torch.nn.Parameter(torch.zeros(1))]))  # before spawning
    validate(schedule)
    _check_levers(config, schedule)
    _check_parallel(config, schedule)
    check_layers(config, schedule.num_parts)
    if "selective" in config.memory.recompute_of(schedule.num_parts):
        check_selective(config.model)
    check_batch(
        config,
        config.schedule.num_microbatches * config.parallel.data_parallel
        if config.is_stream
        else schedule.num_microbatches,
    )


def offloaded(config: TrainConfig, schedule: Schedule) -> frozenset[int]:
    """The parts ``--offload`` names."""
    return parse_offload(config.memory.offload or "none", schedule.num_parts)


def _check_levers(config: TrainConfig, schedule: Schedule) -> None:
    """``--offload`` and ``--compress-activations``: parts that exist, a synchronous schedule, no recomputation."""
    if (
        not config.memory.offload
        and config.memory.compress_activations is None
        and not config.memory.balance_activations
    ):
        return
    flag = (
        "--offload"
        if config.memory.offload
        else "--balance-activations"
        if config.memory.balance_activations
        else "--compress-activations"
    )
    if config.memory.balance_activations and (config.parallel.data_parallel > 1 or config.parallel.tensor_parallel > 1):
        raise UserError("--balance-activations pairs the ranks of one pipeline; drop --data-parallel/--tensor-parallel")
    if config.memory.offload:
        parse_offload(config.memory.offload, schedule.num_parts)  # one line naming a part that is not one
    if not schedule.is_synchronous:
        raise UserError(f"{flag} applies to synchronous schedules; {config.schedule.name} is asynchronous")
    if config.memory.recomputes:
        raise UserError(f"{flag} with --recompute: a recomputed stage keeps only its input; drop one of them")


def _check_stream_data_parallel(config: TrainConfig) -> None:
    """A stream takes ``--data-parallel`` where its entry says so (``DataParallel.ASYNCHRONOUS``: PipeDream's)."""
    if SCHEDULES[config.schedule.name].data_parallel is not DataParallel.ASYNCHRONOUS:
        takers = [n for n, info in SCHEDULES.items() if info.data_parallel is DataParallel.ASYNCHRONOUS]
        raise UserError(
            f"--data-parallel with the asynchronous {config.schedule.name} is not supported; use one of "
            f"{', '.join(takers)}, a synchronous schedule, or --data-parallel 1"
        )


def _check_parallel(config: TrainConfig, schedule: Schedule) -> None:
    """Tensor parallelism splits this model evenly; it and ZeRO compose with the run's other options."""
    if config.parallel.zero:
        _check_zero(config, schedule)
    if config.parallel.expert_parallel > 1:
        _check_expert_parallel(config)
    n = config.parallel.tensor_parallel
    if config.parallel.sequence_parallel:
        _check_sequence_parallel(config)
    if n == 1:
        return
    check_tensor_parallel(config.model, n)
    check_plans(config.model, n)


def _check_expert_parallel(config: TrainConfig) -> None:
    """Expert parallelism splits the model's experts evenly over the ``ep`` group."""
    ep, experts = config.parallel.expert_parallel, config.model.moe_experts or 0
    if is_hf(config.model.entry):
        raise UserError(
            f"--expert-parallel {ep} splits pipeweave's own MoE layers, not the experts of --model "
            f"{config.model.entry} (transformers' own, kept whole on each stage); drop --expert-parallel, or use "
            f"--model llama --moe-experts E (E a multiple of {ep})"
        )
    if not experts:
        raise UserError(
            f"--expert-parallel {ep} splits a mixture of experts' experts and --model {config.model.kind} has none; "
            f"give --moe-experts (a multiple of {ep}), or drop --expert-parallel"
        )
    if experts % ep:
        raise UserError(
            f"--moe-experts {experts} is not divisible by --expert-parallel {ep}; give a multiple of {ep} experts, "
            f"or an --expert-parallel dividing {experts}"
        )


def _check_sequence_parallel(config: TrainConfig) -> None:
    """Sequence parallelism shards a transformer's sequence evenly over the tensor-parallel group, ZeRO and ties aside."""
    n, spec = config.parallel.tensor_parallel, config.model
    if n == 1:
        raise UserError(
            "--sequence-parallel shards activations over the tensor-parallel group; give --tensor-parallel N > 1"
        )
    if spec.kind == "custom":
        raise UserError(
            f"--sequence-parallel applies to the built-in gpt and llama, whose norms run on a sequence shard; "
            f"--model {spec.entry} computes positions and masks from the sequence it is given, which a shard "
            "would shorten: drop --sequence-parallel"
        )
    if not spec.is_transformer:
        raise UserError(
            f"--sequence-parallel applies to the gpt and the llama (a sequence to shard); --model {spec.kind} "
            "has none: drop --sequence-parallel"
        )
    c = config.parallel.context_parallel  # each process holds seq / C tokens of a sequence
    if spec.seq_len // c % n:
        held = f"--seq-len {spec.seq_len}" + (f" / --context-parallel {c} = {spec.seq_len // c}" if c > 1 else "")
        raise UserError(
            f"{held} is not divisible by --tensor-parallel {n}; give a sequence "
            "length that divides evenly for --sequence-parallel"
        )
    for on, flag in (
        (config.parallel.zero, f"--zero {config.parallel.zero}"),
        (spec.tie_embeddings, "--tie-embeddings"),
        (config.data.min_seq_len is not None, "--min-seq-len"),
        (bool(spec.moe_experts), f"--moe-experts {spec.moe_experts}"),  # an expert's rows are no sequence shard
    ):
        if on:
            raise UserError(f"--sequence-parallel with {flag} is not supported; drop one of them")


def _check_clip(config: TrainConfig, schedule: Schedule) -> None:
    """Clipping by a collective (``runtime.clip``): one ``U`` per rank and step, every rank's at the step's end."""
    if config.is_stream:
        raise UserError(
            f"--clip-grad-norm with --tensor-parallel/--data-parallel applies to synchronous "
            f"schedules; {config.schedule.name} is asynchronous: drop --clip-grad-norm"
        )
    placement = schedule.placement
    if any(len(placement.stages_on(r)) != 1 for r in range(schedule.num_ranks)):
        raise UserError(
            f"--clip-grad-norm with --tensor-parallel/--data-parallel needs one stage per rank; "
            f"{config.schedule.name} places several on a rank: use 1f1b, zb-h1, zb-h2 or gpipe"
        )


def _check_zero(config: TrainConfig, schedule: Schedule) -> None:
    """ZeRO shards one replica of a part per data-parallel rank, stepped as a synchronous step's ``U``."""
    if config.is_stream:  # its replicas update at every U from a blocking all-reduce; its policies keep versions
        raise UserError(
            f"--zero {config.parallel.zero} with the asynchronous {config.schedule.name} is not supported (its "
            "weight versions are whole copies); use --zero 0 or a synchronous schedule"
        )
    base = schedule.placement.num_stages // config.parallel.data_parallel  # the stages of one pipeline replica
    if base != schedule.placement.num_parts:
        raise UserError(
            f"--zero {config.parallel.zero} shards data-parallel replicas; {config.schedule.name} replicates parts "
            "inside its pipeline: use --zero 0 with it"
        )
    if config.parallel.zero >= 2 and config.parallel.data_parallel > 1 and tied_groups(config.model):
        # A tie's two copies are summed on whole gradients (runtime.stage.tied): FSDP2 keeps them only inside its
        # backward, ZeRO-2 only inside the action that made them (runtime.replicas).
        raise UserError(
            f"--zero {config.parallel.zero} with tied parameters ({', '.join(tied_groups(config.model)[0])}) is not "
            "supported; use --zero 1 (or 0) with them"
        )
    if config.parallel.zero == 2 and config.training.precision == "fp16":
        # The overflow check reads whole gradients before U (runtime.loss_scale); ZeRO-2 keeps slices of them.
        raise UserError("--zero 2 with --precision fp16 is not supported; use --zero 1 or --precision bf16")


def run_data(config: TrainConfig) -> Any:
    """The run's data source (``data.data_source`` with the data section's every field)."""
    data = config.data
    return data_source(
        config.model,
        batch_size=data.batch_size,
        seed=data.data_seed,
        path=data.path,
        min_seq_len=data.min_seq_len,
        text_field=data.text_field,
        tokenizer=data.tokenizer,
        eval_path=data.eval_path,
    )


def _check_evaluation(config: TrainConfig, source: Any) -> None:
    """``--eval-every`` has held-out data to evaluate on (``source``: ``--data``'s corpus, if given)."""
    if config.model.kind == "mlp":
        raise UserError(
            "--eval-every applies to --model gpt, llama or a custom model (the mlp fits fixed random "
            "targets: there is nothing held out to generalise to); drop it or change --model"
        )
    if config.model.kind == "custom" and config.model.custom.eval_dataset is None:
        raise UserError(
            f"--eval-every needs held-out data and {config.model.entry} has no eval_dataset; give "
            "LayerModel(eval_dataset=...) or drop --eval-every"
        )
    if config.data.path is not None and not source.held_out:
        raise UserError(
            f"--data {config.data.path} is too short to hold out a window of seq_len+1="
            f"{config.model.seq_len + 1} tokens for evaluation; give --eval-data, a longer file or drop --eval-every"
        )


def build_schedule(config: TrainConfig, steps_done: int = 0) -> Schedule:
    """The schedule of the run (raises ScheduleError, a UserError, if it cannot be built).

    An asynchronous run: its streams (``stream_schedules``) as one schedule, ``steps_done`` mini-batches
    trained before it (PipeMare's warm-up counts them).

    Raises:
        UserError: sizes that cannot work (``sizes.check_sizes``), checked before generating.
    """
    check_sizes(config)
    if config.is_stream:
        return concatenate(stream_schedules(config, steps_done))
    if config.schedule.written is not None:
        base = config.schedule.written
    else:
        base = generate(
            config.schedule.name,
            num_stages=config.schedule.num_stages,
            num_microbatches=config.schedule.num_microbatches,
            num_chunks=config.schedule.num_chunks,
            **dict(config.schedule.options),
        )
    return data_parallel(base, config.parallel.data_parallel) if config.parallel.data_parallel != 1 else base


def layer_ranges(config: TrainConfig, schedule: Schedule) -> list[range]:
    """The layers of each part of ``schedule``: ``config.partition.layers_per_part``, checked, or uniform."""
    if config.partition.layers_per_part is None:
        return uniform_parts(config.model.num_layers, schedule.num_parts)
    counts = Partition(config.partition.layers_per_part)
    explicit(LayerCosts.uniform(config.model.num_layers), schedule.num_parts, PartitionContext(counts=counts.counts))
    return [range(a, b) for a, b in counts.bounds]


def learning_rates(config: TrainConfig, first_step: int = 0, updates: int | None = None) -> LrSchedule:
    """The learning rate of every step of the training (``stage.lr_schedule``), ``first_step`` steps done.

    An asynchronous stream counts its stages' ``updates`` (``stream_updates``) instead of steps:
    each stage's k-th update takes the rate of step k.
    """
    end = updates if updates is not None else first_step + config.training.steps
    decay = config.training.lr_decay_steps if config.training.lr_decay_steps is not None else end
    return LrSchedule(config.training.lr_schedule, config.training.lr, config.training.lr_warmup, decay)


def stream_rates(config: TrainConfig, schedule: Schedule, first_update: int = 0) -> LrSchedule:
    """The learning rates of a stream's updates: a stage's k-th update of the training takes step k's,
    the decay ending by default at this run's last update (``first_update`` made before this run)."""
    return learning_rates(config, updates=first_update + stream_updates(schedule))


def optimizer_factory(config: TrainConfig) -> OptimizerFactory:
    """Builds each stage's optimizer: ``config.training.optimizer`` of ``weights.optimizers`` at
    ``config.training.lr`` (with ``config.training.momentum`` where it takes one)."""
    name, lr, momentum = config.training.optimizer, config.training.lr, config.training.momentum or 0.0
    return lambda params: build_optimizer(name, params, lr, momentum)
