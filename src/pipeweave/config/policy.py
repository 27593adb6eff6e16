"""The sections of the optimizer's neighbours: the asynchronous policies' hyperparameters and post-validation.

Both were the runtime's own option classes (``runtime.stage.reads``,
``runtime.stage.post_validation``, which re-export them); as sections of the
configuration they have flags and file keys like every other field.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeweave.config.schema import at_least, check_section, option
from pipeweave.errors import UserError

DEFAULT_ANNEAL_STEPS = 1000
"""PipeMare's K: updates over which the rescheduled step size returns to lr (the paper leaves it to tuning)."""
DEFAULT_DECAY = 0.9
"""PipeMare's gamma: weight of the old velocity in the moving average of updates."""


def _fraction_below_one(value: float, flag: str) -> None:
    if not 0.0 <= value < 1.0:
        raise UserError(f"{flag} {value} is invalid; give 0 <= gamma < 1")


def _rate(value: float, flag: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise UserError(f"{flag} {value} is invalid; give 0 <= alpha <= 1")


@dataclass(frozen=True, kw_only=True)
class PolicyOptions:
    """Run-time hyperparameters of the asynchronous policies (the schedules carry the rest).

    Example:
    >>> PolicyOptions(anneal_steps=100).decay
    0.9
    """

    anneal_steps: int = option(DEFAULT_ANNEAL_STEPS, metavar="K", check=at_least(0, "give K >= 0 (0: no rescheduling)"))
    """pipemare: updates over which the step size lr/tau returns to lr (PipeMare's K; 0: off)."""
    decay: float = option(DEFAULT_DECAY, check=_fraction_below_one)
    """pipemare: velocity moving-average weight gamma."""
    correction: bool = option(True, flags=("--no-correction",), negate=True)
    """pipemare: discrepancy correction of the backward weights (``--no-correction``: none)."""
    averaging_rate: float | None = option(None, metavar="ALPHA", check=_rate)
    """avgpipe: elastic averaging rate toward the replicas' mean (None: 0.9/P, EASGD's beta = 0.9)."""
    averaging_period: int = option(
        1, flags=("--avg-every", "--averaging-period"), metavar="N", check=at_least(1, "give N >= 1 rounds")
    )
    """avgpipe: average the pipelines' replicas every N update rounds (AvgPipe's communication period)."""

    def __post_init__(self) -> None:
        check_section(self)


@dataclass(frozen=True, kw_only=True)
class PostValidation:
    """The run's post-validation options (``runtime.stage.post_validation``), made from ``--clip-grad-norm``.

    Attributes:
        max_norm: clip the global gradient norm to this (None: no clipping).
        fault: ``(step, stage)``: that stage's gradient is set to NaN at that
            step, before anything is measured (tests of the skip path).
    """

    max_norm: float | None = None
    fault: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.max_norm is not None and not self.max_norm > 0:
            raise UserError(f"--clip-grad-norm {self.max_norm} is invalid; give a norm > 0")
