"""``pipeweave train``, once parsed (``commands.train``): build the configuration, check it, launch, report.

Imported only when ``pipeweave train`` runs, so that ``pipeweave --help`` and
the other subcommands start without torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pipeweave.commands.outputs import output_folder
from pipeweave.commands.split_names import split_line
from pipeweave.commands.train_report import build_report, output_paths, print_summary, write_outputs
from pipeweave.config import TrainConfig
from pipeweave.config.cli import from_arguments
from pipeweave.config.toml import dumps as dump_toml
from pipeweave.config.toml import load as load_toml
from pipeweave.errors import UserError
from pipeweave.host import cpu_cores
from pipeweave.models.export import finish
from pipeweave.runtime.process import under_torchrun
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import HOST_UNDER_NCCL, LaunchOptions, RankFailure, exit_torchrun_rank, launch
from pipeweave.runtime.run.memory import check_memory, estimate_memory
from pipeweave.runtime.run.prepare import AlreadyTrained, RunPlan, prepare, resolve_auto
from pipeweave.runtime.run.resolve import resolve
from pipeweave.runtime.run.save_lock import save_lock
from pipeweave.runtime.run.sizes import message_rings
from pipeweave.runtime.run.step_log import log_folder
from pipeweave.runtime.transport import shm
from pipeweave.side_output import OUTPUT_FAILED, SideOutput


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The resolved ``TrainConfig`` of the command line: ``--config FILE`` under the options given, then
    ``runtime.run.resolve`` (the schedule file, the split, a searched schedule's costs)."""
    base = load_toml(args.config, TrainConfig) if getattr(args, "config", None) else None
    return resolve(from_arguments(args, TrainConfig, base))


def _check_transport(launch_: Any, plan: RunPlan, torchrun: bool, rings: shm.Rings | None = None) -> None:
    """``--transport shm`` needs CPU ranks spawned here on x86-64 with room for its rings; ``--transport host``
    ranks spawned here (NCCL's group under torchrun); more CUDA ranks than GPUs need ``--transport host`` (one
    line otherwise)."""
    if launch_.transport == "host" and torchrun:
        raise UserError(HOST_UNDER_NCCL)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and not torchrun and launch_.transport != "host" and plan.num_processes > gpus:
        raise UserError(
            f"{plan.num_processes} ranks on {gpus} GPU(s): NCCL refuses two ranks on one GPU; give --transport host "
            "(messages staged through host memory: a check harness, not a fast mode) or as many GPUs as ranks"
        )
    if launch_.transport != "shm":
        return
    if torchrun:
        raise UserError(
            "--transport shm needs ranks spawned by pipeweave on one host, not torchrun; use --transport gloo"
        )
    why = shm.unavailable(rings if rings is not None else shm.all_pairs(plan.num_processes))
    if why is not None:
        raise UserError(f"--transport shm cannot run here: {why}; use --transport gloo")


def _rings(config: TrainConfig, plan: RunPlan, torchrun: bool) -> shm.Rings | None:
    """The shared-memory rings of this run (``sizes.message_rings``) where rings may be used: ``--transport shm``,
    or auto where ``shm.unavailable`` finds nothing against them; None otherwise."""
    if config.launch.transport in ("gloo", "host") or torchrun:
        return None
    rings = message_rings(plan.config, plan.schedule, plan.num_processes)
    if config.launch.transport == "auto" and shm.unavailable(rings) is not None:
        return None
    return rings


PROCESSES_PER_CORE = 16
"""Most rank processes ``train`` spawns per CPU core: beyond it each gets too little time to answer its peers
within ``--timeout`` (the 16 ranks of a 4 x 4 mesh still run on 1 core)."""


def _check_world(plan: RunPlan) -> None:
    """Under torchrun, the processes started are the run's P x D x C x N; spawned CPU ranks, at most
    ``PROCESSES_PER_CORE`` per core (one line before any group forms)."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if under_torchrun() and world != plan.num_processes:
        c = plan.config.parallel
        raise UserError(
            f"torchrun started {world} processes but --data-parallel {c.data_parallel} x "
            f"{plan.schedule.num_ranks // c.data_parallel} stage ranks x {_inner(c)} need {plan.num_processes}; give --nnodes x --nproc-per-node = "
            f"{plan.num_processes}"
        )
    cores = cpu_cores()
    if not under_torchrun() and not torch.cuda.is_available() and plan.num_processes > PROCESSES_PER_CORE * cores:
        c = plan.config.parallel
        raise UserError(
            f"--data-parallel {c.data_parallel} x {plan.schedule.num_ranks // c.data_parallel} stage ranks x "
            f"{_inner(c)} = {plan.num_processes} processes on {cores} CPU cores: over "
            f"{PROCESSES_PER_CORE} a core, ranks starve and time out waiting on each other; give at most "
            f"{PROCESSES_PER_CORE * cores} processes here, or spread them over hosts with torchrun"
        )


def _inner(c: Any) -> str:
    """A stage rank's processes as the messages above name them: ``--tensor-parallel N``, with context
    parallelism ``--context-parallel C x --tensor-parallel N``."""
    cp = f"--context-parallel {c.context_parallel} x " if c.context_parallel > 1 else ""
    return f"{cp}--tensor-parallel {c.tensor_parallel}"


def train(args: argparse.Namespace) -> int:
    """``pipeweave train ARGS``: check, launch, report; the exit code (``--print-config``: the resolved
    configuration as TOML, nothing trained)."""
    config = build_config(args)
    if getattr(args, "print_config", False):
        print(dump_toml(config), end="")
        return 0
    code = run_config(config)
    if under_torchrun():
        exit_torchrun_rank(code)  # does not return
    return code


def run_config(config: TrainConfig, on_record: Any = None) -> int:
    """Train a resolved configuration: lock its folders, launch its ranks, write and show its record; the exit
    code. ``on_record(record)`` receives rank 0's record (``pipeweave.train``)."""
    if config.checkpoint.save is not None:
        output_folder("--save", config.checkpoint.save)  # where the lock goes: a file in the way is one line here
    if config.checkpoint.save_pretrained is not None:  # where the ranks write their shards, checked before training
        output_folder("--save-pretrained", config.checkpoint.save_pretrained)
    # One run at a time writes into a folder: locked before anything reads or writes it (rank 0 under torchrun).
    log = config.logging
    out = None if log.json and log.trace and log.plot else log.out  # where the default outputs go
    if out is not None:
        output_folder("--out", Path(out))  # where its lock goes: a file in the way is one line here
    same = (
        out is not None
        and config.checkpoint.save is not None
        and Path(out).resolve() == Path(config.checkpoint.save).resolve()
    )
    with (
        save_lock(config.checkpoint.save if _rank() == 0 else None),
        save_lock(out if _rank() == 0 and not same else None, flag="--out"),
    ):
        try:
            config = resolve_auto(config)
        except AlreadyTrained as done:  # a restarted command whose training had finished: nothing to do
            print(f"pipeweave train: {done}", file=sys.stderr)
            return 0
        return _launch(config, on_record)


def _launch(config: TrainConfig, on_record: Any = None) -> int:
    plan = prepare(config)  # one line before anything is spawned
    schedule = plan.schedule
    split = split_line(config.model, plan.parts)  # where a module cut at names is split: said once, by rank 0
    quiet = config.logging.quiet
    if split is not None and not quiet and _rank() == 0:
        print(split)
    output_paths(config)  # likewise: a run must not learn at its end that it cannot write its record
    progress = _Progress(plan.config, schedule.num_ranks, quiet=quiet or (under_torchrun() and _rank() != 0))
    rings = _rings(config, plan, under_torchrun())
    _check_transport(config.launch, plan, under_torchrun(), rings)
    _check_world(plan)
    memory = estimate_memory(plan, rings)
    check_memory(memory, config, on_cpu=not torch.cuda.is_available())  # one line before anything is spawned
    launch_ = config.launch
    options = LaunchOptions(
        threads=launch_.threads, timeout_s=launch_.timeout, transport=launch_.transport, shm_rings=rings
    )
    try:
        with progress:
            record = launch(run_rank, plan, plan.num_processes, options, on_progress=progress.update)
    except RankFailure as failure:
        return failure.exit_code
    if record is None:  # a rank other than 0 under torchrun
        return 0
    if on_record is not None:
        on_record(record)
    report = build_report(schedule, record, memory)
    if config.logging.log_dir is not None:  # each run its own folder there (runtime.run.step_log)
        report["log_dir"] = str(log_folder(config.logging.log_dir, plan.run_id))
    paths, failed = write_outputs(schedule, record, report, config)
    if "log_dir" in report and record.log_failure is None:
        paths["log"] = report["log_dir"]
    if not quiet:
        print_summary(report, paths)
    folder = config.checkpoint.save_pretrained
    if folder is not None:  # a side output too: a failed write is one line, after the record is safe
        export = SideOutput(folder)
        ranks = plan.streams[0].num_ranks if plan.streams else schedule.num_ranks  # the shards the ranks wrote
        export.attempt(lambda: finish(config.model.entry or "", config.model.hf_config, folder, ranks))
        if export.failure is not None:
            failed.append(export)
        elif not quiet:
            print(f"saved (transformers): {folder}")
    return _said_failures(record, failed)


def _said_failures(record: Any, failed: list[SideOutput]) -> int:
    """The exit code of a run that trained: ``OUTPUT_FAILED`` where an output is missing or incomplete, each
    failure said once (``side_output``): the log's and a save's before the last were said in the run, the files
    at its end in one line."""
    unsaved = record.final_save_failure
    if unsaved is not None and record.save_failures == [unsaved]:  # the first failed save: not said yet
        print(f"pipeweave train: error: {unsaved}", file=sys.stderr)
    if failed:
        nor = "".join(f"; nor {o.path}" for o in failed[1:])
        print(f"pipeweave train: error: {failed[0].failure}{nor}", file=sys.stderr)
    incomplete = unsaved is not None or failed or record.log_failure is not None
    return OUTPUT_FAILED if incomplete else 0


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
            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            self.bar.start()
            self.task = self.bar.add_task("train", total=self.config.training.steps, status="starting ranks...")
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
            if len(shares) == self._num_reporting():
                del self.eval_shares[value["eval"]]  # whole: nothing is kept per evaluation
                if self._sees_every_share:
                    self.eval_text = f"  held-out {sum(shares.values()):.4f}"
                    if self.bar is not None:
                        self.bar.update(self.task, status=f"{self.loss_text}{self.eval_text}{self.rate_text}")
            return
        step = value["step"]
        shares = self.shares.setdefault(step, {})
        shares[rank] = value["loss"]
        if len(shares) < self._num_reporting():
            return
        del self.shares[step]  # whole: nothing is kept per step, so a long run's launcher stays flat (soak)
        if self.bar is None:
            return
        if step == 0 or self.config.is_stream:  # a stream reports its mini-batches at its end: no rate
            self.started = time.perf_counter()
            rate = ""
        else:
            rate = f"  {self.config.data.batch_size * step / (time.perf_counter() - self.started):.1f} samples/s"
        loss = f"loss {sum(shares.values()):.4f}" if self._sees_every_share else ""
        self.loss_text, self.rate_text = loss, rate
        self.bar.update(self.task, completed=step + 1, status=f"{loss}{self.eval_text}{rate}")

    @property
    def _sees_every_share(self) -> bool:
        """Whether the losses shown are whole: under torchrun rank 0 sees only its own share (the rate alone shows)."""
        return not (self._num_reporting() == 1 and self.world > 1)

    def _num_reporting(self) -> int:
        return 1 if under_torchrun() else self.world
