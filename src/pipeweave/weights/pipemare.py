"""PipeMare (Yang et al., MLSys 2021): learning-rate rescheduling and discrepancy correction.

Two techniques for asynchronous pipelines without stashing:

- **learning-rate rescheduling** (the paper's T1): stage i, whose gradients lag
  tau_i updates, steps with alpha_i(k) = alpha / tau_i ** p(k),
  p(k) = 1 - min(k / K, 1): alpha / tau_i at step 0, annealed (geometrically,
  the exponent linearly) back to alpha at step K. tau_i comes from the order:
  ``sim.versions.staleness(schedule)[i]`` (a stage with tau_i <= 1 keeps alpha).
- **discrepancy correction** (T2): the backward of a microbatch runs on the
  current weights extrapolated back to the forward's version,
  u = w - (tau_fwd - tau_bkwd) delta, with delta an exponential moving
  average of the stage's weight updates, delta <- gamma delta + (1 - gamma)
  (w_new - w_old) (one velocity buffer per stage: the extra M_theta).

The optional synchronous warm-up is a property of the schedule
(``schedule.pipemare.pipemare(..., warmup_steps=)``).

Defaults: K (``anneal_steps``) and gamma (``decay``) are tuned per task in the
paper; ours are ``DEFAULT_ANNEAL_STEPS`` and ``DEFAULT_DECAY``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_ANNEAL_STEPS = 1000
"""K: optimizer steps over which the rescheduled step size returns to alpha."""
DEFAULT_DECAY = 0.9
"""gamma: weight of the old velocity in the moving average of updates."""


def rescheduled_lr(base_lr: float, delay: int, step: int, anneal_steps: int = DEFAULT_ANNEAL_STEPS) -> float:
    """PipeMare's step size for a stage with gradient delay ``delay`` at optimizer step ``step``.

    Args:
        base_lr: alpha, the step size of synchronous training.
        delay: tau_i, updates the stage's gradients lag (values below 1 count as 1).
        step: k, the optimizer step (0-based).
        anneal_steps: K (0: no rescheduling).

    Example:
        >>> rescheduled_lr(0.1, 4, 0, 10), rescheduled_lr(0.1, 4, 5, 10), rescheduled_lr(0.1, 4, 10, 10)
        (0.025, 0.05, 0.1)
    """
    if anneal_steps < 0 or step < 0:
        raise ValueError(f"anneal_steps={anneal_steps} and step={step} must be >= 0")
    progress = 1.0 if anneal_steps == 0 else min(step / anneal_steps, 1.0)
    return float(base_lr / max(delay, 1) ** (1.0 - progress))


class DiscrepancyCorrection:
    """One stage's velocity estimate and the backward weights it extrapolates.

    Args:
        params: the stage's live parameters (updated in place by its optimizer).
        decay: gamma of the moving average.

    Example:
        >>> p = [torch.tensor([1.0])]
        >>> dc = DiscrepancyCorrection(p, decay=0.5)
        >>> dc.before_update(); p[0] += 2.0; dc.after_update()   # delta = 0.5 * 0 + 0.5 * 2 = 1
        >>> dc.weights_for_backward(gap=2)[0].item()              # 3 - 2 * 1
        1.0
    """

    def __init__(self, params: Sequence[torch.Tensor], decay: float = DEFAULT_DECAY) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} is invalid; give 0 <= decay < 1")
        self.params = list(params)
        self.decay = decay
        self.velocity = [torch.zeros_like(p) for p in self.params]
        self._before: list[torch.Tensor] | None = None

    def weights_for_forward(self) -> list[torch.Tensor]:
        """Forwards read the current weights."""
        return self.params

    def weights_for_backward(self, gap: int) -> list[torch.Tensor]:
        """Current weights extrapolated back ``gap`` versions (the forward's version: tau_fwd - tau_bkwd)."""
        if gap == 0:
            return self.params
        with torch.no_grad():
            return [p - gap * v for p, v in zip(self.params, self.velocity)]

    def before_update(self) -> None:
        self._before = [p.detach().clone() for p in self.params]

    def after_update(self) -> None:
        """Fold the update just made into the velocity."""
        if self._before is None:
            raise RuntimeError("call before_update() before the optimizer step")
        with torch.no_grad():
            for v, p, old in zip(self.velocity, self.params, self._before):
                v.mul_(self.decay).add_(p - old, alpha=1.0 - self.decay)
        self._before = None
