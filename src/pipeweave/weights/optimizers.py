"""The optimizers of ``--optimizer``, one registry: how each is built, and its next step from its state.

Every entry builds a ``torch.optim.Optimizer`` (torch's own class where torch
has one; AdaBelief, which torch lacks, is ``AdaBelief`` below) and declares its
next update as a pure function of that optimizer's state (``Step``): the
update w <- (1 - decay) w - direction, with no new gradient, as XGrad (Guan et
al., arXiv 2305.18352) predicts weights from whichever optimizer trains them:

========== ===================================================== ==================
name       direction                                             decay
========== ===================================================== ==================
sgd        lr v (v the momentum buffer; SpecTrain's)             0
nesterov   lr v (a constant velocity makes g + mu v = v)         0
adam       lr m_hat / (sqrt(v_hat) + eps) (XPipe's)              0
adamw      lr m_hat / (sqrt(v_hat) + eps)                        lr weight_decay
rmsprop    lr v (its momentum buffer), or without momentum       0
           lr g / (sqrt(square_avg) + eps), g the last gradient
adabelief  lr m_hat / (sqrt(s_hat) + eps), s the belief term     lr weight_decay
========== ===================================================== ==================

Plain training, the runtime's stages and the reference executor build their
optimizer with ``build``; weight prediction (``weights.prediction``) follows
``next_step``. Nothing here imports the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeweave.errors import UserError
from pipeweave.weights.xpipe import adam_direction


@dataclass(frozen=True)
class Step:
    """One update with no new gradient: w <- (1 - decay) w - direction."""

    direction: torch.Tensor
    decay: float = 0.0


class AdaBelief(torch.optim.Optimizer):
    """AdaBelief (Zhuang et al., NeurIPS 2020, Algorithm 2), with decoupled weight decay.

    m_t = b1 m + (1 - b1) g;  s_t = b2 s + (1 - b2) (g - m_t)^2 + eps;
    w <- w (1 - lr wd) - lr m_t/(1 - b1^t) / (sqrt(s_t/(1 - b2^t)) + eps).
    State per parameter: ``step`` (a 0-d tensor, as torch's Adam keeps it), ``exp_avg`` (m),
    ``exp_avg_var`` (s, the belief in the gradient).

    Example:
        >>> p = nn.Parameter(torch.tensor([1.0]))
        >>> opt = AdaBelief([p], lr=0.1, eps=0.0)
        >>> p.grad = torch.tensor([2.0]); opt.step()   # m = 0.2, s = 1e-3 x 1.8^2: m_hat = 2, sqrt(s_hat) = 1.8
        >>> round(p.item(), 4)                          # 1 - 0.1 x 2 / 1.8
        0.8889
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-16,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_var"] = torch.zeros_like(p)
                state["step"] += 1
                g, m, s = p.grad, state["exp_avg"], state["exp_avg_var"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                diff = g - m
                s.mul_(b2).addcmul_(diff, diff, value=1 - b2).add_(eps)
                if wd:
                    p.mul_(1 - lr * wd)
                p.sub_(belief_direction(m, s, int(state["step"]), (b1, b2), eps), alpha=lr)
        return loss


def belief_direction(
    exp_avg: torch.Tensor, exp_avg_var: torch.Tensor, step: int, betas: tuple[float, float], eps: float
) -> torch.Tensor:
    """AdaBelief's m_hat / (sqrt(s_hat) + eps) after ``step`` steps: Adam's form, the belief s for v."""
    return adam_direction(exp_avg, exp_avg_var, step, betas, eps)


class RMSprop(torch.optim.RMSprop):
    """torch's RMSprop, keeping the last gradient (``state["grad"]``) when it has no momentum buffer.

    Its next step, lr g / (sqrt(square_avg) + eps), needs g; with momentum the buffer holds it already.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = super().step(closure)
        for group in self.param_groups:
            if group["momentum"]:
                continue
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if "grad" in state:
                        state["grad"].copy_(p.grad)
                    else:
                        state["grad"] = p.grad.detach().clone()
        return loss


def _momentum_step(state: dict[str, Any], group: dict[str, Any]) -> Step | None:
    buf = state.get("momentum_buffer")
    return None if buf is None else Step(group["lr"] * buf)


def _adam_step(state: dict[str, Any], group: dict[str, Any]) -> Step | None:
    if not state or int(state["step"]) == 0:
        return None
    d = adam_direction(state["exp_avg"], state["exp_avg_sq"], int(state["step"]), group["betas"], group["eps"])
    return Step(group["lr"] * d)


def _adamw_step(state: dict[str, Any], group: dict[str, Any]) -> Step | None:
    step = _adam_step(state, group)
    return None if step is None else Step(step.direction, group["lr"] * group["weight_decay"])


def _rmsprop_step(state: dict[str, Any], group: dict[str, Any]) -> Step | None:
    if group["momentum"]:
        return _momentum_step(state, group)
    if "grad" not in state:
        return None
    return Step(group["lr"] * state["grad"] / (state["square_avg"].sqrt() + group["eps"]))


def _adabelief_step(state: dict[str, Any], group: dict[str, Any]) -> Step | None:
    if not state or int(state["step"]) == 0:
        return None
    d = belief_direction(state["exp_avg"], state["exp_avg_var"], int(state["step"]), group["betas"], group["eps"])
    return Step(group["lr"] * d, group["lr"] * group["weight_decay"])


Build = Callable[[list[nn.Parameter], float, float], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerInfo:
    """One optimizer of the registry."""

    build: Build
    """(params, lr, momentum) -> the optimizer."""
    next_step: Callable[[dict[str, Any], dict[str, Any]], Step | None]
    """(a parameter's state, its group) -> its next update without a new gradient; None before any step."""
    state_copies: Callable[[float], int]
    """Copies of the weights its state keeps, given the momentum."""
    kind: type[torch.optim.Optimizer]
    """The class ``build`` returns (an optimizer of it is this entry's)."""
    uses_momentum: bool = False
    """Whether ``--momentum`` applies to it."""


OPTIMIZERS: dict[str, OptimizerInfo] = {
    "sgd": OptimizerInfo(
        lambda ps, lr, mu: torch.optim.SGD(ps, lr=lr, momentum=mu),
        _momentum_step,
        lambda mu: 1 if mu else 0,
        torch.optim.SGD,
        uses_momentum=True,
    ),
    "nesterov": OptimizerInfo(
        lambda ps, lr, mu: torch.optim.SGD(ps, lr=lr, momentum=mu, nesterov=True),
        _momentum_step,
        lambda mu: 1,
        torch.optim.SGD,
        uses_momentum=True,
    ),
    "adam": OptimizerInfo(lambda ps, lr, mu: torch.optim.Adam(ps, lr=lr), _adam_step, lambda mu: 2, torch.optim.Adam),
    "adamw": OptimizerInfo(
        lambda ps, lr, mu: torch.optim.AdamW(ps, lr=lr), _adamw_step, lambda mu: 2, torch.optim.AdamW
    ),
    "rmsprop": OptimizerInfo(
        lambda ps, lr, mu: RMSprop(ps, lr=lr, momentum=mu), _rmsprop_step, lambda mu: 2, RMSprop, uses_momentum=True
    ),
    "adabelief": OptimizerInfo(lambda ps, lr, mu: AdaBelief(ps, lr=lr), _adabelief_step, lambda mu: 2, AdaBelief),
}
"""``--optimizer``'s names (``config.run_sections.OptimizerName``) -> their entries."""


def optimizer_entry(optimizer: torch.optim.Optimizer) -> OptimizerInfo:
    """The registry's entry of ``optimizer`` (by its class; AdamW before Adam, its base).

    Raises:
        UserError: an optimizer of no entry's class.
    """
    for entry in sorted(OPTIMIZERS.values(), key=lambda e: -len(e.kind.__mro__)):
        if isinstance(optimizer, entry.kind):
            return entry
    raise UserError(
        f"optimizer {type(optimizer).__name__} has no next-step rule; give --optimizer one of: {', '.join(OPTIMIZERS)}"
    )


def next_steps(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> list[Step | None]:
    """Each parameter's next update from the optimizer's state (None: no state yet, the weights stay)."""
    entry = optimizer_entry(optimizer)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    return [entry.next_step(optimizer.state.get(p, {}), group_of.get(id(p), optimizer.param_groups[0])) for p in params]


def look_ahead(w: torch.Tensor, step: Step | None, distance: int, out: torch.Tensor) -> torch.Tensor:
    """The weights after ``distance`` updates of ``step``, into ``out``: w - s d (no decay), else
    c^s w - d (1 - c^s) / (1 - c) with c = 1 - decay (the decay compounds, the direction is kept)."""
    with torch.no_grad():
        if step is None:
            return out.copy_(w)
        if not step.decay:
            return torch.add(w, step.direction, alpha=-distance, out=out)
        c = (1.0 - step.decay) ** distance
        torch.mul(w, c, out=out)
        return out.sub_(step.direction, alpha=(1.0 - c) / step.decay)


def build_optimizer(
    name: str, params: Iterable[nn.Parameter], lr: float, momentum: float = 0.0
) -> torch.optim.Optimizer:
    """``--optimizer name`` over ``params`` at ``lr`` (``momentum`` for sgd, nesterov and rmsprop).

    Example:
        >>> type(build_optimizer("adabelief", [nn.Parameter(torch.zeros(1))], lr=1e-3)).__name__
        'AdaBelief'
    """
    if name not in OPTIMIZERS:
        raise UserError(f"--optimizer {name!r} is unknown; give one of: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name].build(list(params), lr, momentum)
