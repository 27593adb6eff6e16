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

from pipeweave.config.policy import DEFAULT_ANNEAL_STEPS, DEFAULT_DECAY  # PipeMare's K and gamma


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
    """One stage's velocity estimate, and its backward weights extrapolated back in place.

    The backward's weights are the live ones moved back ``gap`` versions and
    moved forward again afterwards (``extrapolate``, ``restore``): no third copy
    of the weights, at the price of a round trip that rounds to within an ulp.

    Args:
        params: the stage's live parameters (updated in place by its optimizer).
        decay: gamma of the moving average.
        velocity: a velocity to start from (a previous stream's), copied; zeros if None.

    Example:
        >>> p = [torch.tensor([1.0])]
        >>> dc = DiscrepancyCorrection(p, decay=0.5)
        >>> dc.before_update(); p[0] += 2.0; dc.after_update()   # delta = 0.5 * 0 + 0.5 * 2 = 1
        >>> dc.extrapolate(gap=2); p[0].item()                    # 3 - 2 * 1
        1.0
        >>> dc.restore(gap=2); p[0].item()
        3.0
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        decay: float = DEFAULT_DECAY,
        velocity: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} is invalid; give 0 <= decay < 1")
        self.params = list(params)
        self.decay = decay
        self.velocity = [torch.zeros_like(p) for p in self.params]
        for v, before in zip(self.velocity, velocity or ()):
            v.copy_(before)
        self._before: list[torch.Tensor] | None = None

    def extrapolate(self, gap: int) -> None:
        """Move the live weights back ``gap`` versions (tau_fwd - tau_bkwd), in place: u = w - gap delta."""
        with torch.no_grad():
            for p, v in zip(self.params, self.velocity):
                p.sub_(v, alpha=gap)

    def restore(self, gap: int) -> None:
        """Undo ``extrapolate(gap)`` once the backward is done: w = u + gap delta."""
        with torch.no_grad():
            for p, v in zip(self.params, self.velocity):
                p.add_(v, alpha=gap)

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
