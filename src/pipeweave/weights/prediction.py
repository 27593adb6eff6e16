"""Weight prediction (SpecTrain, XPipe): the weights s updates ahead, along the optimizer's next step.

SpecTrain (``weights.spectrain``, Chen et al., arXiv 1809.02839) predicts
w - s lr v with v momentum SGD's velocity; XPipe (``weights.xpipe``, Guan et
al., arXiv 1911.04610) w - s lr m_hat / (sqrt(v_hat) + eps) with Adam's
moments. ``update_direction`` gives lr v or lr m_hat / (sqrt(v_hat) + eps) by
the optimizer's type, so both schedules run with either optimizer. Which action
predicts, for which s, and how long a prediction is kept is ``runtime.stage.policy``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeweave.errors import UserError
from pipeweave.weights.spectrain import predict
from pipeweave.weights.xpipe import adam_direction


def update_direction(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The optimizer's next step per parameter, from its state: lr v (momentum SGD), lr m_hat/(sqrt(v_hat)+eps) (Adam).

    Raises:
        UserError: an optimizer without such a state (plain SGD, others).

    Example:
        >>> p = torch.nn.Parameter(torch.tensor([1.0]))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.tensor([2.0]); opt.step()
        >>> round(update_direction(opt, [p])[0].item(), 6)   # lr x momentum buffer = 0.1 x 2
        0.2
    """
    group = optimizer.param_groups[0]
    lr = float(group["lr"])
    out = []
    for p in params:
        state = optimizer.state.get(p, {})
        if isinstance(optimizer, torch.optim.SGD):
            buf = state.get("momentum_buffer")
            out.append(torch.zeros_like(p) if buf is None else lr * buf)
        elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            if not state:
                out.append(torch.zeros_like(p))
                continue
            step = int(state["step"])
            out.append(lr * adam_direction(state["exp_avg"], state["exp_avg_sq"], step, group["betas"], group["eps"]))
        else:
            raise UserError(f"weight prediction needs momentum SGD or Adam(W), not {type(optimizer).__name__}")
    return out


def predict_weights(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    distance: int,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The weights ``distance`` steps ahead, ``p - distance x update_direction``, into ``out`` if given.

    With momentum SGD it is SpecTrain's fused pass (``weights.spectrain.predict``).

    Example:
        >>> p = torch.nn.Parameter(torch.tensor([1.0]))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.tensor([2.0]); opt.step()          # v = 2, w = 0.8
        >>> round(predict_weights(opt, [p], 3)[0].item(), 6)  # 0.8 - 3 x 0.1 x 2
        0.2
    """
    targets = list(out) if out is not None else [torch.empty_like(p) for p in params]
    if isinstance(optimizer, torch.optim.SGD):
        velocity = [optimizer.state.get(p, {}).get("momentum_buffer") for p in params]
        return predict(params, velocity, float(optimizer.param_groups[0]["lr"]), distance, out=targets)
    with torch.no_grad():
        for p, d, t in zip(params, update_direction(optimizer, params), targets):
            torch.sub(p, d, alpha=distance, out=t)
    return targets


def check_predictable(optimizer: torch.optim.Optimizer) -> None:
    """Raise UserError unless prediction has a direction to follow."""
    if isinstance(optimizer, torch.optim.SGD) and not optimizer.param_groups[0]["momentum"]:
        raise UserError(
            "spectrain/xpipe predict weights from the optimizer's momentum; "
            "give --momentum 0.9 (sgd) or --optimizer adamw"
        )
    if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)):
        raise UserError(f"weight prediction needs momentum SGD or Adam(W), not {type(optimizer).__name__}")
