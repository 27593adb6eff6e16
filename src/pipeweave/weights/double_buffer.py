"""Double-buffered weights (PipeDream-2BW, Narayanan et al., ICML 2021): two versions per stage.

2BW coalesces the gradients of the T microbatches of a mini-batch into one
update (the executor accumulates them), forwards read the newest version and
backwards the version their forward read, so the update applies a gradient
one version old: W(t+1) = W(t) - lr grad f(W(t-1)). With T >= D no more than
two versions are ever needed; a third raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeweave.weights.stash import WeightStash


class DoubleBuffer(WeightStash):
    """A ``WeightStash`` that holds at most two versions (the current and a shadow).

    Example:
        >>> p = [torch.zeros(1)]
        >>> buf = DoubleBuffer(p)
        >>> _ = buf.weights_for_forward(0)
        >>> buf.before_update(); p[0] += 1; buf.after_update()
        >>> _ = buf.weights_for_forward(1)
        >>> buf.before_update()
        Traceback (most recent call last):
        ...
        RuntimeError: 3 weight versions held, more than 2; give more microbatches per mini-batch
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        super().__init__(params, max_versions=2)
