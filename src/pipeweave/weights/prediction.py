"""Weight prediction (SpecTrain, XPipe, XGrad): the weights s updates ahead, along the optimizer's own next step.

SpecTrain (Chen et al., arXiv 1809.02839) predicts w - s lr v with v momentum
SGD's velocity; XPipe (``weights.xpipe``, Guan et al., arXiv 1911.04610)
w - s lr m_hat / (sqrt(v_hat) + eps) with Adam's moments; XGrad (Guan et al., arXiv 2305.18352) generalises both to whichever
optimizer trains the weights. Here every optimizer of ``weights.optimizers``
declares its next update from its state (direction and decoupled decay), and
the prediction is that update taken s times (``optimizers.look_ahead``), so
both schedules run with any of them. Which action predicts, for which s, and
how long a prediction is kept is ``runtime.stage.policy``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeweave.errors import UserError
from pipeweave.weights.optimizers import look_ahead, next_steps, optimizer_entry


def update_direction(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The direction of the optimizer's next step per parameter (``weights.optimizers``): lr v (momentum SGD),
    lr m_hat/(sqrt(v_hat)+eps) (Adam), ... (zeros before its first step; a decoupled decay is apart).

    Raises:
        UserError: an optimizer outside the registry.

    Example:
        >>> p = torch.nn.Parameter(torch.tensor([1.0]))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.tensor([2.0]); opt.step()
        >>> round(update_direction(opt, [p])[0].item(), 6)   # lr x momentum buffer = 0.1 x 2
        0.2
    """
    return [torch.zeros_like(p) if s is None else s.direction for p, s in zip(params, next_steps(optimizer, params))]


def predict_weights(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    distance: int,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The weights ``distance`` steps ahead (the optimizer's next step taken ``distance`` times), into ``out``.

    Example:
        >>> p = torch.nn.Parameter(torch.tensor([1.0]))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.tensor([2.0]); opt.step()          # v = 2, w = 0.8
        >>> round(predict_weights(opt, [p], 3)[0].item(), 6)  # 0.8 - 3 x 0.1 x 2
        0.2
    """
    targets = list(out) if out is not None else [torch.empty_like(p) for p in params]
    for p, step, t in zip(params, next_steps(optimizer, params), targets):
        look_ahead(p, step, distance, t)
    return targets


def check_predictable(optimizer: torch.optim.Optimizer) -> None:
    """Raise UserError unless prediction has a direction to follow (SGD needs momentum)."""
    optimizer_entry(optimizer)
    if isinstance(optimizer, torch.optim.SGD) and not optimizer.param_groups[0]["momentum"]:
        raise UserError(
            "spectrain/xpipe predict weights from the optimizer's momentum; "
            "give --momentum 0.9 (sgd) or another --optimizer (adam, adamw, rmsprop, adabelief)"
        )
