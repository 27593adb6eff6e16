"""AvgPipe (Chen et al., PPoPP 2023): elastic averaging of the P pipelines' replicas.

Each pipeline trains its own replica; every ``period`` updates the replicas of
a part are pulled toward their mean: x_i <- x_i + alpha (mean - x_i). This is
elastic averaging (Zhang, Choromanska and LeCun, NeurIPS 2015, "EASGD") with
the centre variable taken as the replicas' mean, so no extra copy is held
(P M_theta per rank). alpha = 1 is plain model averaging, alpha = 0 none.
Default alpha = 0.9 / P: EASGD's recommended beta = P alpha = 0.9. When to
average (once every replica has made a round's update, every ``period``-th
round) is ``runtime.stage.policy``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_BETA = 0.9
"""EASGD's beta = P alpha."""


def default_alpha(num_pipelines: int) -> float:
    """alpha = 0.9 / P.

    Example:
        >>> default_alpha(2)
        0.45
    """
    return DEFAULT_BETA / num_pipelines


def elastic_average(replicas: Sequence[Sequence[torch.Tensor]], alpha: float) -> None:
    """Pull every replica toward the replicas' mean, in place.

    Args:
        replicas: per replica, its parameter tensors (same shapes across replicas).
        alpha: the moving rate in [0, 1].

    Example:
        >>> a, b = [torch.tensor([0.0])], [torch.tensor([4.0])]
        >>> elastic_average([a, b], alpha=0.25)   # mean 2: 0 -> 0.5, 4 -> 3.5
        >>> a[0].item(), b[0].item()
        (0.5, 3.5)
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} is invalid; give 0 <= alpha <= 1")
    with torch.no_grad():
        for tensors in zip(*replicas):
            mean = torch.stack([t.detach() for t in tensors]).mean(dim=0)
            for t in tensors:
                t.add_(mean - t, alpha=alpha)
