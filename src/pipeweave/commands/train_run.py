"""``pipeweave train``, once parsed (``commands.train``): build the configuration, check it, launch, report.

Imported only when ``pipeweave train`` runs, so that ``pipeweave --help`` and
the other subcommands start without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pipeweave.commands.partition import check_partition_arguments, memory_profile, model_spec, parse_counts, partition_context, partition_method
from pipeweave.commands.outputs import output_folder
from pipeweave.commands.recompute_options import AUTO
from pipeweave.commands.profiled import profiled_costs
from pipeweave.commands.stash_options import train_levers
from pipeweave.commands.schedule_file import schedule_from_file
from pipeweave.commands.stream_options import async_options
from pipeweave.commands.split_names import split_line
from pipeweave.commands.train_report import build_report, output_paths, print_summary, write_outputs
from pipeweave.errors import UserError
from pipeweave.models.hf import is_hf, save_pretrained
from pipeweave.partition import LayerCosts, Partition, partition
from pipeweave.runtime.process import under_torchrun
from pipeweave.runtime.profile import profile_model
from pipeweave.runtime.run.config import TrainConfig
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, RankFailure, exit_torchrun_rank, launch
from pipeweave.runtime.run.memory import check_memory, estimate_memory
from pipeweave.runtime.run.plan import AlreadyTrained, RunPlan, build_schedule, layer_ranges, prepare, resolve_auto
from pipeweave.runtime.run.save_lock import save_lock
from pipeweave.runtime.run.sizes import largest_message_bytes
from pipeweave.runtime.stage.policy import PolicyOptions
from pipeweave.runtime.stage.post_validation import PostValidation
from pipeweave.runtime.transport import shm
from pipeweave.schedule import SCHEDULES, Schedule
from pipeweave.schedule.registry import schedule_defaults
from pipeweave.sim.recompute import spelled


DEFAULT_SCHEDULE = "zb-h1"
"""The schedule of a run without ``-s``."""
# The default gpt: small enough to train 40 steps in a few seconds on 2 cores.
DEFAULT_GPT = {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64}


MAX_TIMEOUT_S = 7 * 86400.0
"""The longest --timeout: a week. A rank blocked longer on a peer has lost it; far larger values overflow
the process group's timeout (a timedelta, then milliseconds in C++)."""


def check_arguments(args: argparse.Namespace) -> None:
    """The launcher's and the partitioner's flags, one line each before anything is built or spawned.

    Raises:
        UserError: e.g. ``--data-parallel 0 is invalid; give P >= 1 pipeline replicas``.
    """
    if args.data_parallel < 1:
        raise UserError(f"--data-parallel {args.data_parallel} is invalid; give P >= 1 pipeline replicas (1: none)")
    if args.tensor_parallel < 1:
        raise UserError(f"--tensor-parallel {args.tensor_parallel} is invalid; give N >= 1 processes per stage "
                        "(1: none)")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # nan too
        raise UserError(f"--timeout {args.timeout:g} is invalid; give the seconds a rank may wait on a peer, "
                        f"> 0 and at most {MAX_TIMEOUT_S:.0f} (a week); default 25")
    if args.lr is not None and math.isinf(args.lr):
        raise UserError(f"--lr {args.lr} is invalid; give a finite learning rate > 0")
    check_partition_arguments(args)


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of the arguments."""
    check_arguments(args)
    spec = model_spec(args, DEFAULT_GPT)
    optimizer = args.optimizer or ("sgd" if spec.kind == "mlp" else "adamw")
    lr = args.lr if args.lr is not None else (3e-3 if optimizer == "adamw" else 0.1)
    written = schedule_from_file(args)
    schedule = args.schedule_file if written is not None else \
        args.schedule or DEFAULT_SCHEDULE
    if args.threads < 1:
        raise UserError(f"--threads {args.threads} is invalid; give at least 1")
    options, policy_kwargs = async_options(args, schedule)
    policy = PolicyOptions(**policy_kwargs)  # its values checked here
    momentum = args.momentum if args.momentum is not None else schedule_defaults(schedule).get("momentum", 0.0)
    config = TrainConfig(
        schedule=schedule, schedule_file=written, num_chunks=args.chunks,
        num_stages=_size(args.stages, DEFAULT_STAGES, None if written is None else written.num_ranks),
        num_microbatches=_size(args.microbatches, DEFAULT_MICROBATCHES,
                               None if written is None else written.num_microbatches),
        model=spec, batch_size=args.batch, steps=args.steps, lr=lr, optimizer=optimizer,
        recompute="none" if args.recompute == AUTO else args.recompute, precision=args.precision, seed=args.seed or 0, data=args.data,
        data_parallel=args.data_parallel, tensor_parallel=args.tensor_parallel, zero=args.zero,
        sequence_parallel=args.sequence_parallel,
        bucket_mb=args.bucket_mb,
        momentum=momentum, schedule_options=tuple(options.items()), policy=policy,
        post_validation=_post_validation(args), on_nonfinite=args.on_nonfinite, save=args.save,
        save_every=args.save_every,
        eval_every=args.eval_every, eval_batches=args.eval_batches, lr_schedule=args.lr_schedule,
        lr_warmup=args.lr_warmup, lr_decay_steps=args.lr_decay_steps,
        resume=args.resume, keep_checkpoints=args.keep_checkpoints, overwrite=args.overwrite,
        **train_levers(args),
        log_dir=_log_dir(args.log_dir), min_seq_len=args.min_seq_len,
        collect_parameters=_save_pretrained(args, spec) is not None,
    )
    return _with_searched_costs(_with_partition(config, args), args)


DEFAULT_STAGES, DEFAULT_MICROBATCHES = 2, 4


def _log_dir(value: str | None) -> str | None:
    """``--log-dir DIR``: a folder this command can write, and the package that writes it (one line otherwise)."""
    if value is None:
        return None
    if importlib.util.find_spec("tensorboard") is None:
        raise UserError(f"--log-dir {value} writes TensorBoard event files and needs the tensorboard package; "
                        "pip install 'pipeweave[tensorboard]', or drop --log-dir")
    output_folder("--log-dir", value)
    return value


def _size(given: int | None, default: int, written: int | None) -> int:
    """``--stages`` or ``--microbatches``: as given (a conflict with the file is ``TrainConfig``'s one line),
    else the schedule file's, else the default."""
    return given if given is not None else written if written is not None else default


def _check_transport(args: argparse.Namespace, plan: RunPlan, torchrun: bool, capacity: int | None = None) -> None:
    """``--transport shm`` needs CPU ranks spawned here on x86-64 with room in /dev/shm (one line otherwise)."""
    if args.transport != "shm":
        return
    if torchrun:
        raise UserError("--transport shm needs ranks spawned by pipeweave on one host, not torchrun; "
                        "use --transport gloo")
    why = shm.unavailable(plan.num_processes, capacity or shm.DEFAULT_CAPACITY)
    if why is not None:
        raise UserError(f"--transport shm cannot run here: {why}; use --transport gloo")


def _ring_capacity(args: argparse.Namespace, plan: RunPlan, torchrun: bool) -> int | None:
    """Shared-memory rings sized for this run's largest message (``shm.capacity_for``), if rings may be used."""
    if args.transport == "gloo" or torchrun:
        return None
    return shm.capacity_for(largest_message_bytes(plan.config, plan.schedule, plan.parts))


def _uses_rings(args: argparse.Namespace, plan: RunPlan, capacity: int | None) -> bool:
    """Whether the launcher allocates shared-memory rings for this run (``--transport shm``, or auto where they work)."""
    if capacity is None:
        return False
    return args.transport == "shm" or shm.unavailable(plan.num_processes, capacity) is None


def _check_world(plan: RunPlan) -> None:
    """Under torchrun, the processes started are the run's P x D x N (one line before any group forms)."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if under_torchrun() and world != plan.num_processes:
        c = plan.config
        raise UserError(f"torchrun started {world} processes but --data-parallel {c.data_parallel} x "
                        f"{plan.schedule.num_ranks // c.data_parallel} stage ranks x --tensor-parallel "
                        f"{c.tensor_parallel} need {plan.num_processes}; give --nnodes x --nproc-per-node = "
                        f"{plan.num_processes}")


def _post_validation(args: argparse.Namespace) -> Any:
    if args.clip_grad_norm is None:
        return None
    return PostValidation(max_norm=args.clip_grad_norm)


def _searched(config: TrainConfig) -> bool:
    """The run's schedule is searched for the run's own costs (``ScheduleInfo.searched``: zb-auto, zb-v-auto)."""
    info = SCHEDULES.get(config.schedule)
    return info is not None and info.searched


def _with_searched_costs(config: TrainConfig, args: argparse.Namespace) -> TrainConfig:
    """zb-auto/zb-v-auto: plan with this model's per-part F, I, W times, profiled per layer (cached).

    ``--memory-limit K`` is their activation limit (K x the 1F1B peak) unless it is
    the memory partitioner's byte budget. The numbers travel in the config, so every
    rank searches the same instance and builds the same schedule.
    """
    if not _searched(config):
        return config
    options = dict(config.schedule_options)
    if args.memory_limit is not None and args.partition != "memory":
        options["memory_limit"] = args.memory_limit
    parts = build_schedule(dataclasses.replace(config, data_parallel=1))
    microbatch = max(1, config.batch_size // (config.num_microbatches * config.data_parallel))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    costs = profile_model(config.model, microbatch, device=device, precision=config.precision)
    ranges = layer_ranges(config, parts)
    for key, per_layer in (("time_f", costs.forward), ("time_b", costs.input_grad), ("time_w", costs.weight_grad)):
        options[key] = tuple(sum(per_layer[i] for i in r) for r in ranges)
    return dataclasses.replace(config, schedule_options=tuple(options.items()))


def _with_partition(config: TrainConfig, args: argparse.Namespace) -> TrainConfig:
    """``config`` with the layer counts of ``--partition`` (profiled on this machine's device, cached)."""
    if args.memory_limit is not None and args.partition != "memory" and not _searched(config):
        # Otherwise --memory-limit would be ignored: say so instead.
        raise UserError(f"--memory-limit {args.memory_limit:g} applies to --partition memory (bytes per rank) and to "
                        f"zb-auto/zb-v-auto (K x the 1F1B peak); add one of them or drop it")
    base = build_schedule(dataclasses.replace(config, data_parallel=1))  # one replica: the parts
    microbatch = max(1, config.batch_size // (config.num_microbatches * config.data_parallel))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.recompute == AUTO and partition_method(args) != "memory":
        raise UserError("--recompute auto is chosen by --partition memory under --memory-limit; add them, or give "
                        "the modes (none, selective, full or one per part)")
    plan = layers_per_part(args, config.model, base, microbatch, device)
    if plan is None:
        return config
    chosen = {"recompute": spelled(plan.recompute)} if args.recompute == AUTO else {}
    return dataclasses.replace(config, layers_per_part=plan.counts, **chosen)


def layers_per_part(
    args: argparse.Namespace, spec: Any, schedule: Schedule, microbatch_size: int, device: str
) -> Partition | None:
    """For ``train``: the partition ``--partition`` gives for ``schedule`` (None: uniform), with its recomputation
    per part (``--recompute auto``: chosen by ``--partition memory``).

    Costs come from ``--costs`` or the profiler (cached) on ``device``.

    Raises:
        UserError: the method's errors, or a PipeDream plan that replicates parts.
    """
    method = partition_method(args)
    if method == "uniform":
        return None
    counts = parse_counts(args.layers_per_stage)
    if counts is not None and sum(counts) != spec.num_layers:  # the layers named: a gpt has more than --layers
        raise UserError(f"--layers-per-stage {args.layers_per_stage} sums to {sum(counts)} layers but the model has "
                        f"{spec.layers_described}; make the counts sum to {spec.num_layers}")
    if method == "explicit" or args.costs:
        costs = LayerCosts.load(args.costs) if args.costs else LayerCosts.uniform(spec.num_layers)
    else:
        costs = profiled_costs(args, spec, microbatch_size, device)
    if costs.num_layers != spec.num_layers:
        raise UserError(f"--costs has {costs.num_layers} layers for a model of {spec.num_layers}; profile this model")
    profile = memory_profile(schedule, args)
    plan = partition(method, costs, schedule.num_parts, partition_context(args, profile))
    if plan.num_parts != schedule.num_parts:
        raise UserError(
            f"--partition {method} replicates parts {list(plan.replicas)}; train one replica per part "
            "with --partition time, or replicate whole pipelines with --data-parallel"
        )
    return plan


def train(args: argparse.Namespace) -> int:
    """``pipeweave train ARGS``: check, launch, report; the exit code."""
    code = _train(args)
    if under_torchrun():
        exit_torchrun_rank(code)  # does not return
    return code


def _train(args: argparse.Namespace) -> int:
    config = build_config(args)
    if config.save is not None:
        output_folder("--save", config.save)  # where the lock goes: a file in the way is one line here
    # One run at a time writes into a folder: locked before anything reads or writes it (rank 0 under torchrun).
    out = None if args.json and args.trace and args.plot else args.out  # where the default outputs go
    if out is not None:
        output_folder("--out", Path(out))  # where its lock goes: a file in the way is one line here
    same = out is not None and config.save is not None and Path(out).resolve() == Path(config.save).resolve()
    with save_lock(config.save if _rank() == 0 else None), \
            save_lock(out if _rank() == 0 and not same else None, flag="--out"):
        try:
            config = resolve_auto(config)
        except AlreadyTrained as done:  # a restarted command whose training had finished: nothing to do
            print(f"pipeweave train: {done}", file=sys.stderr)
            return 0
        return _launch(args, config)


def _launch(args: argparse.Namespace, config: TrainConfig) -> int:
    plan = prepare(config)  # one line before anything is spawned
    schedule = plan.schedule
    split = split_line(config.model, plan.parts)  # where a module cut at names is split: said once, by rank 0
    if split is not None and not args.quiet and _rank() == 0:
        print(split)
    output_paths(args)  # likewise: a run must not learn at its end that it cannot write its record
    progress = _Progress(plan.config, schedule.num_ranks, quiet=args.quiet or (under_torchrun() and _rank() != 0))
    capacity = _ring_capacity(args, plan, under_torchrun())
    _check_transport(args, plan, under_torchrun(), capacity)
    _check_world(plan)
    memory = estimate_memory(plan, capacity if _uses_rings(args, plan, capacity) else None)
    check_memory(memory, config, on_cpu=not torch.cuda.is_available())  # one line before anything is spawned
    options = LaunchOptions(threads=args.threads, timeout_s=args.timeout, transport=args.transport,
                            shm_capacity=capacity)
    try:
        with progress:
            record = launch(run_rank, plan, plan.num_processes, options, on_progress=progress.update)
    except RankFailure as failure:
        return failure.exit_code
    if record is None:  # a rank other than 0 under torchrun
        return 0
    report = build_report(schedule, record, memory)
    unsaved = record.final_save_failure  # why the last checkpoint is not there: said once the record is safe
    try:
        paths = write_outputs(schedule, record, report, args)
    except BaseException:
        if unsaved:
            print(f"pipeweave train: error: {unsaved}", file=sys.stderr)
        raise
    if not args.quiet:
        print_summary(report, paths)
    folder = _save_pretrained(args, config.model)
    if folder is not None:
        save_pretrained(config.model.entry, config.model.hf_config, _final_parameters(record), folder)
        if not args.quiet:
            print(f"saved (transformers): {folder}")
    if unsaved:
        print(f"pipeweave train: error: {unsaved}", file=sys.stderr)
        return 1
    return 0


def _save_pretrained(args: argparse.Namespace, spec: Any) -> str | None:
    """``--save-pretrained DIR`` (one line if the model is not a Hugging Face one)."""
    folder = getattr(args, "save_pretrained", None)
    if folder is not None and not is_hf(spec.entry):
        raise UserError(f"--save-pretrained {folder} applies to --model hf:TYPE; use --save for a checkpoint")
    return folder  # type: ignore[no-any-return]


def _final_parameters(record: Any) -> dict[str, torch.Tensor]:
    """Every stage's final parameters by global name (the first replica's where parts are replicated)."""
    out: dict[str, torch.Tensor] = {}
    for rank in record.ranks:
        for params in rank.parameters.values():
            for name, value in params.items():
                out.setdefault(name, value)
    return out


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _Progress:
    """A rich progress bar fed by the ranks' per-step reports (loss shares summed over ranks)."""

    def __init__(self, config: TrainConfig, world: int, quiet: bool) -> None:
        self.config, self.quiet = config, quiet
        self.world = world
        self.shares: dict[int, dict[int, float]] = {}
        self.eval_shares: dict[int, dict[int, float]] = {}
        self.eval_text = self.loss_text = self.rate_text = ""
        self.bar: Any = None
        self.started = time.perf_counter()

    def __enter__(self) -> _Progress:
        if not self.quiet:
            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[status]}"), TimeElapsedColumn(), transient=False)
            self.bar.start()
            self.task = self.bar.add_task("train", total=self.config.steps, status="starting ranks...")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, rank: int, value: dict[str, Any]) -> None:
        if "checkpoint_failed" in value:  # shown now (above the bar); the run goes on, its record is kept
            print(f"pipeweave train: warning: {value['checkpoint_failed']}", file=sys.stderr)
            return
        if "eval" in value:  # a held-out loss share: shown beside the training loss once every rank's is in
            shares = self.eval_shares.setdefault(value["eval"], {})
            shares[rank] = value["loss"]
            if len(shares) == self._num_reporting() and self._sees_every_share:
                self.eval_text = f"  held-out {sum(shares.values()):.4f}"
                if self.bar is not None:
                    self.bar.update(self.task, status=f"{self.loss_text}{self.eval_text}{self.rate_text}")
            return
        step = value["step"]
        self.shares.setdefault(step, {})[rank] = value["loss"]
        if self.bar is None or len(self.shares[step]) < self._num_reporting():
            return
        if step == 0 or self.config.is_stream:  # a stream reports its mini-batches at its end: no rate
            self.started = time.perf_counter()
            rate = ""
        else:
            rate = f"  {self.config.batch_size * step / (time.perf_counter() - self.started):.1f} samples/s"
        loss = f"loss {sum(self.shares[step].values()):.4f}" if self._sees_every_share else ""
        self.loss_text, self.rate_text = loss, rate
        self.bar.update(self.task, completed=step + 1, status=f"{loss}{self.eval_text}{rate}")

    @property
    def _sees_every_share(self) -> bool:
        """Whether the losses shown are whole: under torchrun rank 0 sees only its own share (the rate alone shows)."""
        return not (self._num_reporting() == 1 and self.world > 1)

    def _num_reporting(self) -> int:
        return 1 if under_torchrun() else self.world
