"""Optimizer post-validation (Qi et al., ICLR 2024, section 4): step optimistically, roll back exactly.

Zero-bubble schedules overlap a step's tail with the next step's warm-up, so no
rank may wait for a global all-reduce of the gradient norm (for clipping) and
of the inf/NaN flag (for skipping) before its optimizer step. Instead each
stage adds its part to a ``GradState`` passed along the pipeline, steps on what
it has seen, and when the completed state arrives ``validate`` either keeps the
step, undoes it (a non-finite gradient anywhere: skip the step), or undoes it
and redoes it with the clip factor. Undoing inverts SGD (momentum, weight
decay) and AdamW algebraically, in place: in float64 the result matches a
synchronous step to about 1e-15 relative (a few ulps), not bitwise, because
x - a + a is not always x in floating point.

API for the runtime, per stage::

    state = GradState.of(params)                    # this stage's part
    state = incoming.combine(state)                 # from the previous stage
    stage_opt.step_optimistic(state)                # may step now
    ...                                             # send state on; later:
    stage_opt.validate(total_state, max_norm)       # "kept", "skipped" or "clipped"
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GradState:
    """What post-validation passes along the pipeline: a sum of squares and a non-finite flag."""

    sq_norm: float = 0.0
    nonfinite: bool = False

    @staticmethod
    def of(params: list[torch.Tensor]) -> GradState:
        """This stage's share, from its parameters' ``.grad``."""
        grads = [p.grad for p in params if p.grad is not None]
        sq = float(sum(float(g.double().pow(2).sum()) for g in grads))
        return GradState(sq, not math.isfinite(sq) or any(not bool(torch.isfinite(g).all()) for g in grads))

    def combine(self, other: GradState) -> GradState:
        return GradState(self.sq_norm + other.sq_norm, self.nonfinite or other.nonfinite)

    @property
    def norm(self) -> float:
        return math.sqrt(self.sq_norm)


class SGD:
    """SGD with momentum (dampening 0) and L2 weight decay, torch.optim.SGD's update, invertible."""

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        if momentum < 0 or lr <= 0:
            raise ValueError(f"lr={lr}, momentum={momentum}: give lr > 0 and momentum >= 0")
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buf: dict[int, torch.Tensor | None] = {}

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, grads)):
                d = g + self.weight_decay * p
                if self.momentum:
                    prev = self.buf.get(i)
                    d = d.clone() if prev is None else prev.mul_(self.momentum).add_(d)
                    self.buf[i] = d
                p.sub_(self.lr * d)

    def undo(self, params: list[torch.Tensor], grads: list[torch.Tensor], first: bool) -> None:
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, grads)):
                if not self.momentum:
                    p.add_(self.lr * (g + self.weight_decay * p)).div_(1 - self.lr * self.weight_decay)
                    continue
                buf = self.buf[i]
                assert buf is not None
                p.add_(self.lr * buf)
                if first:
                    self.buf[i] = None
                else:
                    buf.sub_(g + self.weight_decay * p).div_(self.momentum)


class AdamW:
    """AdamW (decoupled weight decay, bias-corrected), torch.optim.AdamW's update, invertible."""

    def __init__(
        self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01
    ) -> None:
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.t = 0
        self.m: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def _direction(self, i: int) -> torch.Tensor:
        b1, b2 = self.betas
        mhat = self.m[i] / (1 - b1**self.t)
        return mhat / ((self.v[i] / (1 - b2**self.t)).sqrt() + self.eps)

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        b1, b2 = self.betas
        self.t += 1
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, grads)):
                p.mul_(1 - self.lr * self.weight_decay)
                self.m[i] = self.m.get(i, torch.zeros_like(p)).mul_(b1).add_((1 - b1) * g)
                self.v[i] = self.v.get(i, torch.zeros_like(p)).mul_(b2).add_((1 - b2) * g * g)
                p.sub_(self.lr * self._direction(i))

    def undo(self, params: list[torch.Tensor], grads: list[torch.Tensor], first: bool) -> None:
        b1, b2 = self.betas
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, grads)):
                p.add_(self.lr * self._direction(i)).div_(1 - self.lr * self.weight_decay)
                self.m[i].sub_((1 - b1) * g).div_(b1)
                self.v[i].sub_((1 - b2) * g * g).div_(b2)
        self.t -= 1


class PostValidatedStep:
    """One stage's optimizer under post-validation (see the module docstring).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float64)); w.grad = torch.full((2,), 3.0, dtype=torch.float64)
        >>> opt = PostValidatedStep([w], SGD(lr=0.1), max_norm=1.0)
        >>> opt.step_optimistic(GradState.of([w])); opt.validate(GradState.of([w]))
        'clipped'
    """

    def __init__(self, params: list[torch.Tensor], optimizer: SGD | AdamW, max_norm: float | None = None) -> None:
        self.params, self.optimizer, self.max_norm = params, optimizer, max_norm
        self.steps = 0
        self._stepped: list[torch.Tensor] | None = None

    def _grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient: the optimizers index their state by position."""
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:
            raise ValueError(f"parameters {missing} have no gradient; post-validation steps every parameter")
        return [p.grad.detach() for p in self.params if p.grad is not None]

    def step_optimistic(self, partial: GradState) -> None:
        """Step on unclipped gradients unless what is known already says to skip."""
        self._stepped = None
        if partial.nonfinite:
            return
        grads = [g.clone() for g in self._grads()]
        self.optimizer.step(self.params, grads)
        self._stepped = grads

    def validate(self, total: GradState) -> str:
        """Make the step the one a synchronous optimizer would have taken; say which it was."""
        stepped = self._stepped
        if total.nonfinite:
            if stepped is not None:
                self.optimizer.undo(self.params, stepped, first=self.steps == 0)
            return "skipped"
        if self.max_norm is not None and total.norm > self.max_norm:
            if stepped is not None:
                self.optimizer.undo(self.params, stepped, first=self.steps == 0)
            factor = self.max_norm / (total.norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s factor
            self.optimizer.step(self.params, [g * factor for g in self._grads()])
            self.steps += 1
            return "clipped"
        if stepped is None:  # skipped on partial news that turned out fine: cannot happen
            raise RuntimeError("partial state was non-finite but the total is finite")
        self.steps += 1
        return "kept"
