"""The sections of a training run's configuration that say how it runs: optimizer, checkpoints, outputs, launch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pipeweave.config.policy import PostValidation
from pipeweave.config.schema import at_least, check_section, option
from pipeweave.errors import UserError

PRECISIONS = ("fp32", "bf16", "fp16")
MAX_TIMEOUT_S = 7 * 86400.0
"""The longest --timeout: a week. A rank blocked longer on a peer has lost it; far larger values overflow
the process group's timeout (a timedelta, then milliseconds in C++)."""


def check_precision(precision: str, flag: str = "--precision") -> None:
    """One line unless ``precision`` is one of ``PRECISIONS``.

    Raises:
        UserError: e.g. ``bfloat16`` (the name is bf16).
    """
    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision!r} is unknown; give one of: {', '.join(PRECISIONS)}")


def _lr(value: float, flag: str) -> None:
    if math.isinf(value):
        raise UserError(f"--lr {value} is invalid; give a finite learning rate > 0")
    if not value > 0:
        raise UserError(f"--lr {value} is invalid; give a learning rate > 0")


def _momentum(value: float, flag: str) -> None:
    if not 0.0 <= value < 1.0:
        raise UserError(f"--momentum {value} is invalid; give 0 <= momentum < 1")


def _scale(value: float, flag: str) -> None:
    if not 0 < value < math.inf:  # nan too
        raise UserError(f"{flag} {value} is invalid; give a finite loss scale > 0 (default 65536.0, 2**16)")


def _growth(value: float, flag: str) -> None:
    if not 1 < value < math.inf:
        raise UserError(f"{flag} {value} is invalid; give a finite factor > 1 (default 2.0)")


def _backoff(value: float, flag: str) -> None:
    if not 0 < value < 1:
        raise UserError(f"{flag} {value} is invalid; give a factor in (0, 1) (default 0.5)")


def _norm(value: float, flag: str) -> None:
    if not value > 0:
        raise UserError(f"--clip-grad-norm {value} is invalid; give a norm > 0")


OptimizerName = Literal["sgd", "nesterov", "adam", "adamw", "rmsprop", "adabelief"]
"""The optimizers of ``weights.optimizers.OPTIMIZERS`` (a test keeps the two the same)."""


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How long and with what optimizer the model trains, at what precision, and what a bad step does.

    Example:
    >>> TrainingConfig(optimizer="adamw", lr=3e-4, clip_grad_norm=1.0).post_validation.max_norm
    1.0
    """

    steps: int = option(30, check=at_least(1))
    """Optimizer steps (an asynchronous schedule: mini-batches of its stream)."""
    optimizer: OptimizerName | None = option(None)
    """The optimizer (default sgd for the mlp, adamw otherwise): sgd (with --momentum), nesterov (SGD with
    Nesterov momentum), adam, adamw, rmsprop (with --momentum), adabelief; spectrain/xpipe predict weights
    along its own next step."""
    lr: float | None = option(None, check=_lr)
    """Learning rate (default 0.1 for sgd and nesterov, 3e-3 for the others)."""
    momentum: float | None = option(None, check=_momentum)
    """Momentum of sgd, nesterov and rmsprop (default: 0.9 for nesterov, else the schedule's, 0.9 for
    spectrain/xpipe which predict along it; 0 otherwise)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = option("constant")
    """After --lr-warmup, keep --lr or decay it to a tenth by --lr-decay-steps; an asynchronous schedule counts
    each stage's updates as steps."""
    lr_warmup: int = option(0, metavar="N", check=at_least(0, "give an integer >= 0"))
    """Steps of linear warm-up to --lr."""
    lr_decay_steps: int | None = option(None, metavar="N")
    """The step where the decay ends (default: the last step, or a stream's last update, of this run; give the
    same one when resuming)."""
    precision: Literal["fp32", "bf16", "fp16"] = option("fp32", check=check_precision)
    """bf16: mixed precision, every forward under torch.autocast to bfloat16 (parameters, gradients and
    optimizer state float32); fp16: the same in float16 with dynamic loss scaling, torch.amp.GradScaler's
    (--loss-scale...; synchronous schedules)."""
    loss_scale: float = option(65536.0, metavar="S", check=_scale)
    """--precision fp16: the loss scale of the first step (torch.amp.GradScaler's init_scale, 2**16); a resumed
    run goes on with its checkpoint's."""
    loss_scale_growth: float = option(2.0, metavar="F", check=_growth)
    """--precision fp16: the factor the loss scale grows by after --loss-scale-interval steps in a row without an
    overflow (GradScaler's growth_factor)."""
    loss_scale_backoff: float = option(0.5, metavar="F", check=_backoff)
    """--precision fp16: the factor the loss scale is lowered by at a step whose gradients overflow (inf or NaN
    on any rank), whose update every stage skips (GradScaler's backoff_factor)."""
    loss_scale_interval: int = option(2000, metavar="N", check=at_least(1))
    """--precision fp16: steps in a row without an overflow before the loss scale grows (GradScaler's
    growth_interval)."""
    clip_grad_norm: float | None = option(None, metavar="NORM", check=_norm)
    """Clip the global gradient norm; steps are post-validated (optimistic step, exact rollback on NaN/inf or
    clipping), so no global barrier precedes the update; a NaN/inf norm stops the run, or skips the step with
    --on-nonfinite skip; with --tensor-parallel/--data-parallel: one all-reduce of the norm at each update
    instead."""
    on_nonfinite: Literal["stop", "skip"] = option("stop")
    """A step whose loss (or, with --clip-grad-norm, gradient norm) is NaN or inf: stop the run there, exit code
    1, the last checkpoint kept; or skip that step's update on every stage and go on (synchronous schedules)."""
    compile: bool = option(False)
    """Run each layer through torch.compile (inductor), the split backward (I, then W) kept: the deferrable
    linear layers stay eager, what lies between them is compiled; the compile time is reported apart from the
    step time."""
    post_validation: PostValidation | None = option(None, internal=True)
    """Clip and skip without a barrier (``runtime.stage.post_validation``): made from ``clip_grad_norm``."""

    def __post_init__(self) -> None:
        if (
            self.post_validation is None
            and isinstance(self.clip_grad_norm, (int, float))
            and not isinstance(self.clip_grad_norm, bool)
        ):
            object.__setattr__(self, "post_validation", PostValidation(max_norm=self.clip_grad_norm))
        check_section(self)

    @property
    def lr_scheduled(self) -> bool:
        """Whether the learning rate moves (a warm-up or a decay): each update then sets its own."""
        return self.lr_schedule != "constant" or self.lr_warmup > 0


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """What the run saves, and where it starts from.

    Example:
    >>> CheckpointConfig(save="ckpt", save_every=100).keep_checkpoints
    2
    """

    save: str | None = option(None, metavar="DIR")
    """After the last step, write a checkpoint into DIR: a folder DIR/step-NNNNNN of every part's parameters and
    optimizer state (and an asynchronous policy's state), made current atomically once whole; a DIR holding
    another run's checkpoint is refused."""
    save_every: int | None = option(None, metavar="N")
    """With --save: also write a checkpoint every N steps; an asynchronous schedule drains its stream there."""
    keep_checkpoints: int = option(
        2, metavar="K", check=at_least(1, "give an integer >= 1 (the newest checkpoints kept in --save)")
    )
    """The newest checkpoints of this run kept in --save DIR."""
    overwrite: bool = option(False)
    """Save into a DIR holding another run's checkpoints, removing them once this run's first checkpoint is
    whole."""
    resume: str | None = option(None, metavar="DIR|auto")
    """Start from the newest checkpoint in DIR (or from DIR/step-NNNNNN) and train --steps more steps, the data
    going on from where it stopped; any schedule, D or partition of the same model. auto: from the newest
    checkpoint in --save DIR if there is one, else from scratch, --steps counting the whole training (for
    torchrun --max-restarts)."""
    save_pretrained: str | None = option(None, metavar="DIR")
    """hf: models: after training, write the model into DIR as transformers' from_pretrained loads it: sharded
    safetensors (each rank writes its own parts') with model.safetensors.index.json, config.json, and the tokenizer
    of an hf:PATH folder."""
    collect_parameters: bool = option(False, internal=True)
    """Send every stage's final parameters to rank 0 (tests)."""

    def __post_init__(self) -> None:
        check_section(self)
        if self.save_every is not None and (self.save_every < 1 or self.save is None):
            raise UserError(f"--save-every {self.save_every} is invalid; give an integer >= 1 together with --save DIR")
        if self.resume == "auto" and self.save is None:
            raise UserError(
                "--resume auto resumes the newest checkpoint in --save DIR; give --save DIR too (or --resume DIR)"
            )


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """What the run shows and writes: the progress bar and summary, its record, trace, plot, TensorBoard.

    Example:
    >>> LoggingConfig(quiet=True).out
    'pipeweave-out'
    """

    out: str = option("pipeweave-out", metavar="DIR")
    """Folder of the default outputs."""
    json: str | None = option(None, metavar="FILE")
    """Write the JSON record here (default OUT/train.json)."""
    plot: str | None = option(None, metavar="FILE")
    """Write the measured timeline plot here (default OUT/timeline.png)."""
    trace: str | None = option(None, metavar="FILE")
    """Write the Chrome trace here (default OUT/trace.json)."""
    quiet: bool = option(False)
    """No progress bar and no summary."""
    log_dir: str | None = option(None, metavar="DIR")
    """Write every step's loss, learning rate, throughput, bubble and memory as TensorBoard event files into
    DIR/<run id>, a folder per run (a resumed run continues its run's; tensorboard --logdir DIR); needs pip install
    'pipeweave[tensorboard]'."""
    trace_steps: int = option(64, metavar="N", check=at_least(1))
    """Keep the times of every action for the first N steps only: the trace, the plot, the bubble and the
    profiled costs cover those; every step's loss and time are kept whatever N (a long run's memory stays flat)."""

    def __post_init__(self) -> None:
        check_section(self)


def _timeout(value: float, flag: str) -> None:
    if not 0 < value <= MAX_TIMEOUT_S:  # nan too
        raise UserError(
            f"--timeout {value:g} is invalid; give the seconds a rank may wait on a peer, "
            f"> 0 and at most {MAX_TIMEOUT_S:.0f} (a week); default 25"
        )


def _delay(value: float, flag: str) -> None:
    if not 0 <= value <= MAX_TIMEOUT_S * 1000:  # nan too
        raise UserError(f"{flag} {value:g} is invalid; give milliseconds >= 0 (0: no delay)")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How the ranks are started and talk: threads, the wait for a peer, the point-to-point transport.

    Example:
    >>> LaunchConfig(threads=2, transport="gloo").timeout
    25.0
    """

    threads: int = option(1, check=at_least(1, "give at least 1"))
    """Intra-op threads per rank."""
    timeout: float = option(25.0, check=_timeout)
    """Seconds a rank may wait on a peer before failing (under torchrun no launcher watches the other node: this
    timeout is what ends a rank whose remote peer died)."""
    transport: Literal["auto", "gloo", "shm", "host"] = option("auto")
    """Point-to-point messages of spawned CPU ranks: shm, shared-memory rings between the ranks on this host that
    exchange messages, each sized for the largest (collectives stay on gloo), or gloo; auto: shm on x86-64 with
    room for the rings in /dev/shm and the address space, gloo otherwise and under torchrun, NCCL on CUDA; host:
    ranks sharing one GPU (more ranks than GPUs), their messages staged through pinned host buffers over gloo -- a
    harness to check CUDA paths on one GPU, not a fast mode; refused under torchrun (NCCL)."""
    comm_delay_ms: float = option(0.0, metavar="MS", check=_delay)
    """A testing aid: every message between pipeline ranks (and any collective routed through
    ``RankContext.delayed``) completes MS milliseconds after its transfer, as over a link that much slower; the
    delay runs beside the rank's compute, so a schedule can hide it (F&B pairs; docs/guide/dualpipe.md). Needs
    --transport gloo; 0: off."""

    def __post_init__(self) -> None:
        check_section(self)
        if self.comm_delay_ms and self.transport != "gloo":
            raise UserError(
                f"--comm-delay-ms {self.comm_delay_ms:g} delays the process group's messages, and --transport "
                f"{self.transport} may carry them otherwise; give --transport gloo"
            )
