"""``pipeweave train``: train a model with a schedule on local ranks (or under torchrun), measured.

With no arguments it trains the byte-level gpt on the Python standard
library's sources, on 2 ranks with a zero-bubble schedule where the registry
has one (1F1B otherwise), shows a progress bar, and ends with a summary --
loss first -> last, throughput, measured beside simulated bubble, memory per
rank -- and a JSON record, a Chrome trace and a timeline plot under
``./pipeweave-out/``.

Asynchronous schedules (pipedream, pipedream-2bw, pipemare, spectrain, xpipe,
ampnet, wpipe, avgpipe) run as one stream of ``--steps`` mini-batches
(``runtime.stream``), drained and restarted where ``--eval-every`` or
``--save-every`` stop it; their options are in the "asynchronous schedules" group
of ``--help``, and the summary shows the steady-state bubble and the weight
bytes held (every version and buffer) beside the simulator's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from pipeweave.commands.partition import add_model_arguments, add_partition_arguments, layers_per_part, model_spec
from pipeweave.commands.stream_options import add_async_arguments, async_options
from pipeweave.commands.train_report import build_report, output_paths, print_summary, write_outputs
from pipeweave.errors import UserError

DEFAULT_OUT = Path("pipeweave-out")
# Preferred defaults, first one present in the registry wins (zero bubble is
# registered by another part of the project; 1F1B always is).
DEFAULT_SCHEDULES = ("zb-h1", "1f1b")
# The default gpt: small enough to train 40 steps in a few seconds on 2 cores.
DEFAULT_GPT = {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "train", help="train a model with a pipeline schedule on local ranks, measured",
        description="Train on torch.distributed with any schedule; measure bubble, memory, throughput. "
        "An asynchronous schedule runs as one stream of --steps mini-batches, drained where --eval-every or "
        "--save-every stop it.",
    )
    p.add_argument("-s", "--schedule", help="schedule name (default: zb-h1 if registered, else 1f1b)")
    p.add_argument("--stages", type=int, default=2, help="D, pipeline ranks (default 2)")
    p.add_argument("--microbatches", type=int, default=4, help="T, microbatches per step (default 4)")
    p.add_argument("--chunks", type=int, help="v, chunks per rank, for schedules that take it")
    add_model_arguments(p)
    add_partition_arguments(p)
    p.add_argument("--data-parallel", type=int, default=1, metavar="P",
                   help="pipeline replicas, gradients all-reduced across them; ranks P x D (default 1)")
    p.add_argument("--batch", "--batch-size", dest="batch", type=int, default=16,
                   help="samples per step, split into T microbatches (default 16)")
    p.add_argument("--data", metavar="FILE", help="gpt: a text file to train on (default: the stdlib sources)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--lr", type=float, help="learning rate (default 3e-3 for adamw, 0.1 for sgd)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), help="default sgd for the mlp, adamw otherwise")
    p.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"), default="constant",
                   help="after --lr-warmup, keep --lr or decay it to a tenth by --lr-decay-steps (default constant); "
                        "an asynchronous schedule counts each stage's updates as steps")
    p.add_argument("--lr-warmup", type=int, default=0, metavar="N",
                   help="steps of linear warm-up to --lr (default 0)")
    p.add_argument("--lr-decay-steps", type=int, metavar="N",
                   help="the step where the decay ends (default: the last step, or a stream's last update, of "
                        "this run; give the same one when resuming)")
    p.add_argument("--recompute", action="store_true", help="activation recomputation on every stage")
    p.add_argument("--precision", default="fp32", metavar="fp32|bf16",
                   help="bf16: mixed precision, every forward under torch.autocast to bfloat16 (parameters, "
                        "gradients and optimizer state float32); default fp32")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="NORM",
                   help="clip the global gradient norm; steps are post-validated (optimistic step, exact "
                        "rollback on NaN/inf or clipping), so no global barrier precedes the update")
    p.add_argument("--eval-every", type=int, metavar="N",
                   help="every N steps and after the last, the mean loss of held-out batches through a "
                        "forward-only pipeline (gpt: one block in 20 of the corpus, never trained on; a custom "
                        "model: its eval_dataset); an asynchronous schedule drains its stream there")
    p.add_argument("--eval-batches", type=int, default=4, metavar="K",
                   help="held-out batches per evaluation, the same every time (default 4)")
    p.add_argument("--save", metavar="DIR",
                   help="after the last step, write a checkpoint here: every part's parameters and optimizer "
                        "state (and an asynchronous policy's state)")
    p.add_argument("--save-every", type=int, metavar="N",
                   help="with --save: also write the checkpoint every N steps (each replaces the last); an "
                        "asynchronous schedule drains its stream there")
    p.add_argument("--resume", metavar="DIR",
                   help="start from the checkpoint in DIR (written by --save) and train --steps more steps, the "
                        "data going on from where it stopped; any schedule, D or partition of the same model")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    # Under torchrun no launcher watches the other node: the process-group timeout
    # is what ends a rank whose remote peer died, so it stays under the 30 s promise.
    p.add_argument("--timeout", type=float, default=25.0,
                   help="seconds a rank may wait on a peer before failing (default 25)")
    p.add_argument("--transport", choices=("auto", "gloo", "shm"), default="auto",
                   help="point-to-point messages of spawned CPU ranks: shm, shared-memory rings between the "
                        "ranks on this host (collectives stay on gloo), or gloo; auto (default): shm on x86-64 "
                        "with room in /dev/shm, gloo otherwise and under torchrun, NCCL on CUDA")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder of the default outputs (default ./pipeweave-out)")
    p.add_argument("--json", metavar="FILE", help="write the JSON record here (default OUT/train.json)")
    p.add_argument("--plot", metavar="FILE", help="write the measured timeline plot here (default OUT/timeline.png)")
    p.add_argument("--trace", metavar="FILE", help="write the Chrome trace here (default OUT/trace.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    add_async_arguments(p)
    return p


MAX_TIMEOUT_S = 7 * 86400.0
"""The longest --timeout: a week. A rank blocked longer on a peer has lost it; far larger values overflow
the process group's timeout (a timedelta, then milliseconds in C++)."""


def check_arguments(args: argparse.Namespace) -> None:
    """The launcher's and the partitioner's flags, one line each before anything is built or spawned.

    Raises:
        UserError: e.g. ``--data-parallel 0 is invalid; give P >= 1 pipeline replicas``.
    """
    from pipeweave.commands.partition import check_partition_arguments

    if args.data_parallel < 1:
        raise UserError(f"--data-parallel {args.data_parallel} is invalid; give P >= 1 pipeline replicas (1: none)")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # nan too
        raise UserError(f"--timeout {args.timeout:g} is invalid; give the seconds a rank may wait on a peer, "
                        f"> 0 and at most {MAX_TIMEOUT_S:.0f} (a week); default 25")
    if args.lr is not None and math.isinf(args.lr):
        raise UserError(f"--lr {args.lr} is invalid; give a finite learning rate > 0")
    check_partition_arguments(args)


def build_config(args: argparse.Namespace) -> Any:
    """The ``TrainConfig`` of the arguments (torch is imported only here)."""
    from pipeweave.runtime.config import TrainConfig
    from pipeweave.schedule import SCHEDULES

    check_arguments(args)
    if args.model == "gpt":
        for name, value in DEFAULT_GPT.items():
            if getattr(args, name, None) is None:
                setattr(args, name, value)
    spec = model_spec(args)
    optimizer = args.optimizer or ("sgd" if spec.kind == "mlp" else "adamw")
    lr = args.lr if args.lr is not None else (3e-3 if optimizer == "adamw" else 0.1)
    schedule = args.schedule or next(n for n in DEFAULT_SCHEDULES if n in SCHEDULES)
    if args.threads < 1:
        raise UserError(f"--threads {args.threads} is invalid; give at least 1")
    options, policy = async_options(args, schedule)
    momentum = args.momentum if args.momentum is not None else (0.9 if schedule in ("spectrain", "xpipe") else 0.0)
    config = TrainConfig(
        schedule=schedule, num_stages=args.stages, num_microbatches=args.microbatches, num_chunks=args.chunks,
        model=spec, batch_size=args.batch, steps=args.steps, lr=lr, optimizer=optimizer,
        recompute=args.recompute, precision=args.precision, seed=args.seed or 0, data=args.data,
        data_parallel=args.data_parallel,
        momentum=momentum, schedule_options=tuple(options.items()), policy=policy,
        post_validation=_post_validation(args), save=args.save, save_every=args.save_every,
        eval_every=args.eval_every, eval_batches=args.eval_batches, lr_schedule=args.lr_schedule,
        lr_warmup=args.lr_warmup, lr_decay_steps=args.lr_decay_steps,
        resume=args.resume,
    )
    return _with_searched_costs(_with_partition(config, args), args)


def _check_transport(args: argparse.Namespace, schedule: Any, torchrun: bool, capacity: int | None = None) -> None:
    """``--transport shm`` needs CPU ranks spawned here on x86-64 with room in /dev/shm (one line otherwise)."""
    if args.transport != "shm":
        return
    from pipeweave.runtime import shm

    if torchrun:
        raise UserError("--transport shm needs ranks spawned by pipeweave on one host, not torchrun; "
                        "use --transport gloo")
    why = shm.unavailable(schedule.num_ranks, capacity or shm.DEFAULT_CAPACITY)
    if why is not None:
        raise UserError(f"--transport shm cannot run here: {why}; use --transport gloo")


def _ring_capacity(args: argparse.Namespace, config: Any, schedule: Any, torchrun: bool) -> int | None:
    """Shared-memory rings sized for this run's largest message (``shm.capacity_for``), if rings may be used."""
    if args.transport == "gloo" or torchrun:
        return None
    from pipeweave.runtime import shm

    return shm.capacity_for(config.largest_message_bytes(schedule))


def _post_validation(args: argparse.Namespace) -> Any:
    if args.clip_grad_norm is None:
        return None
    from pipeweave.runtime.validation_step import PostValidation  # torch: only when training

    return PostValidation(max_norm=args.clip_grad_norm)


SEARCHED = ("zb-auto", "zb-v-auto")
"""Schedules searched for the run's own costs (pipeweave.search)."""


def _with_searched_costs(config: Any, args: argparse.Namespace) -> Any:
    """zb-auto/zb-v-auto: plan with this model's per-part F, I, W times, profiled per layer (cached).

    ``--memory-limit K`` is their activation limit (K x the 1F1B peak) unless it is
    the memory partitioner's byte budget. The numbers travel in the config, so every
    rank searches the same instance and builds the same schedule.
    """
    if config.schedule not in SEARCHED:
        return config
    import dataclasses

    import torch

    from pipeweave.runtime.profile import profile_model

    options = dict(config.schedule_options)
    if args.memory_limit is not None and args.partition != "memory":
        options["memory_limit"] = args.memory_limit
    parts = dataclasses.replace(config, data_parallel=1).build_schedule()
    microbatch = max(1, config.batch_size // (config.num_microbatches * config.data_parallel))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    costs = profile_model(config.model, microbatch, device=device, precision=config.precision)
    ranges = config.layer_ranges(parts)
    for key, per_layer in (("time_f", costs.forward), ("time_b", costs.input_grad), ("time_w", costs.weight_grad)):
        options[key] = tuple(sum(per_layer[i] for i in r) for r in ranges)
    return dataclasses.replace(config, schedule_options=tuple(options.items()))


def _with_partition(config: Any, args: argparse.Namespace) -> Any:
    """``config`` with the layer counts of ``--partition`` (profiled on this machine's device, cached)."""
    import dataclasses

    if args.memory_limit is not None and args.partition != "memory" and config.schedule not in SEARCHED:
        # Otherwise --memory-limit would be ignored: say so instead.
        raise UserError(f"--memory-limit {args.memory_limit:g} applies to --partition memory (bytes per rank) and to "
                        f"zb-auto/zb-v-auto (K x the 1F1B peak); add one of them or drop it")

    import torch

    base = dataclasses.replace(config, data_parallel=1).build_schedule()  # one replica: the parts
    microbatch = max(1, config.batch_size // (config.num_microbatches * config.data_parallel))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    counts = layers_per_part(args, config.model, base, microbatch, device)
    return dataclasses.replace(config, layers_per_part=counts) if counts is not None else config


def run(args: argparse.Namespace) -> int:
    from pipeweave.runtime.launch import exit_torchrun_rank, under_torchrun

    code = _train(args)
    if under_torchrun():
        exit_torchrun_rank(code)  # does not return
    return code


def _train(args: argparse.Namespace) -> int:
    from pipeweave.runtime.job import run_rank
    from pipeweave.runtime.launch import LaunchOptions, RankFailure, launch, under_torchrun

    config = build_config(args)
    schedule = config.check()  # one line before anything is spawned
    output_paths(args)  # likewise: a run must not learn at its end that it cannot write its record
    progress = _Progress(config, quiet=args.quiet or (under_torchrun() and _rank() != 0))
    capacity = _ring_capacity(args, config, schedule, under_torchrun())
    _check_transport(args, schedule, under_torchrun(), capacity)
    options = LaunchOptions(threads=args.threads, timeout_s=args.timeout, transport=args.transport,
                            shm_capacity=capacity)
    try:
        with progress:
            record = launch(run_rank, config, schedule.num_ranks, options, on_progress=progress.update)
    except RankFailure as failure:
        return failure.exit_code
    if record is None:  # a rank other than 0 under torchrun
        return 0
    report = build_report(schedule, record)
    paths = write_outputs(schedule, record, report, args)
    if not args.quiet:
        print_summary(report, paths)
    return 0


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


class _Progress:
    """A rich progress bar fed by the ranks' per-step reports (loss shares summed over ranks)."""

    def __init__(self, config: Any, quiet: bool) -> None:
        self.config, self.quiet = config, quiet
        self.world = config.build_schedule().num_ranks
        self.shares: dict[int, dict[int, float]] = {}
        self.eval_shares: dict[int, dict[int, float]] = {}
        self.eval_text = self.loss_text = self.rate_text = ""
        self.bar: Any = None
        self.started = time.perf_counter()

    def __enter__(self) -> _Progress:
        if not self.quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[status]}"), TimeElapsedColumn(), transient=False)
            self.bar.start()
            self.task = self.bar.add_task("train", total=self.config.steps, status="starting ranks...")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, rank: int, value: dict[str, Any]) -> None:
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
        from pipeweave.runtime.launch import under_torchrun

        return 1 if under_torchrun() else self.world
