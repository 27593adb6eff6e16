"""Learning-rate schedules: linear warm-up, then constant, cosine or linear decay.

The learning rate of optimizer step ``k`` (counted over the whole training,
across ``--resume``) is

- ``lr * (k + 1) / warmup`` for ``k < warmup``;
- then ``constant``: ``lr``; ``cosine``: from ``lr`` down to ``MIN_RATIO * lr``
  along half a cosine between ``warmup`` and ``decay_steps``; ``linear``: the
  same endpoints along a line; ``MIN_RATIO * lr`` from ``decay_steps`` on.

It is a function of the step alone, so a resumed run continues it exactly
when given the same ``decay_steps``. Every stage sets it on its own optimizer
before each step (``set_lr``): no message is needed. An asynchronous stream
has no global step: a stage's k-th update takes the rate of step k
(``runtime.stage.policy.RankPolicy``).

Example:
    >>> schedule = LrSchedule("cosine", lr=1.0, warmup=2, decay_steps=6)
    >>> [round(schedule.at(k), 3) for k in range(8)]
    [0.5, 1.0, 1.0, 0.868, 0.55, 0.232, 0.1, 0.1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipeweave.errors import UserError
from pipeweave.runtime.stage.post_validation import ValidatedOptimizer

KINDS = ("constant", "cosine", "linear")
MIN_RATIO = 0.1
"""The decayed learning rate, as a fraction of the peak (GPT-style training decays to a tenth)."""


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of every optimizer step (see the module docstring)."""

    kind: str
    lr: float
    warmup: int = 0
    decay_steps: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"--lr-schedule {self.kind!r} is unknown; choose one of: {', '.join(KINDS)}")
        if self.warmup < 0:
            raise UserError(f"--lr-warmup {self.warmup} is invalid; give an integer >= 0")
        if self.kind != "constant" and self.decay_steps <= self.warmup:
            raise UserError(
                f"--lr-decay-steps {self.decay_steps} (where the decay ends; default: the run's last "
                f"step) must exceed --lr-warmup {self.warmup}; give a later one or a shorter warm-up"
            )

    def at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based, over the whole training)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.kind == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup) / (self.decay_steps - self.warmup))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1.0 - progress
        return self.lr * (MIN_RATIO + (1.0 - MIN_RATIO) * shape)


def set_lr(optimizer: Any, lr: float) -> None:
    """Give ``optimizer`` (a torch optimizer, or the post-validated step of ``runtime.stage.post_validation``) rate ``lr``."""
    if isinstance(optimizer, ValidatedOptimizer):
        optimizer.step_state.optimizer.lr = lr
        return
    for group in optimizer.param_groups:
        group["lr"] = lr
