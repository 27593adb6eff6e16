"""AvgPipe (Chen et al., PPoPP 2023): elastic averaging of the P pipelines' replicas.

Each pipeline trains its own replica; every ``period`` updates the replicas of
a part are pulled toward their mean: x_i <- x_i + alpha (mean - x_i). This is
elastic averaging (Zhang, Choromanska and LeCun, NeurIPS 2015, "EASGD") with
the centre variable taken as the replicas' mean, so no extra copy is held
(P M_theta per rank). alpha = 1 is plain model averaging, alpha = 0 none.
Default alpha = 0.9 / P: EASGD's recommended beta = P alpha = 0.9.
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


class ElasticAveraging:
    """Averages a part's replicas after every ``period``-th round of their updates.

    Example:
        >>> a, b = [torch.tensor([0.0])], [torch.tensor([2.0])]
        >>> avg = ElasticAveraging([a, b], alpha=1.0, period=2)
        >>> avg.after_update(), avg.after_update(), a[0].item()
        (False, True, 1.0)
    """

    def __init__(self, replicas: Sequence[Sequence[torch.Tensor]], alpha: float | None = None, period: int = 1) -> None:
        if period < 1:
            raise ValueError(f"period={period} is invalid; give >= 1")
        self.replicas = [list(r) for r in replicas]
        self.alpha = default_alpha(len(self.replicas)) if alpha is None else alpha
        self.period = period
        self.rounds = 0

    def after_update(self) -> bool:
        """Every replica has made one more update; average when the period is complete."""
        self.rounds += 1
        if self.rounds % self.period:
            return False
        elastic_average(self.replicas, self.alpha)
        return True
