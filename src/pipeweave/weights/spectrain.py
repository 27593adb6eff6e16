"""SpecTrain (Chen et al., arXiv 1809.02839, 2018): weight prediction along momentum SGD's velocity.

Momentum SGD moves the weights by about lr v per update (v the velocity,
PyTorch's ``momentum_buffer``), so the weights s updates ahead are predicted as
w_hat = w - s lr v. Every forward and backward of a stage computes on the
weights predicted for the version its gradient will be applied to; s is that
distance, per stage and pass: ``sim.versions.read_versions(schedule)[a].distance``.
Weight decay and Nesterov are ignored, as in the paper. ``weights.prediction``
reads v and lr from the optimizer (and, for Adam, follows XPipe's direction).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def predict(
    weights: Sequence[torch.Tensor],
    velocity: Sequence[torch.Tensor | None],
    lr: float,
    distance: int,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """w_hat = w - s lr v, elementwise, into ``out`` if given (a missing velocity, before the first step: w).

    One fused pass per tensor, ``w + (-s lr) v``, reading w and v and writing the
    result (no temporary): the prediction runs inside every predicted F and B,
    where its memory traffic is the stage's overhead.

    Example:
        >>> round(predict([torch.tensor([1.0])], [torch.tensor([0.5])], lr=0.1, distance=2)[0].item(), 6)
        0.9
    """
    targets = list(out) if out is not None else [torch.empty_like(w) for w in weights]
    with torch.no_grad():
        for w, v, t in zip(weights, velocity, targets):
            if v is None:
                t.copy_(w)
            else:
                torch.add(w, v, alpha=-distance * lr, out=t)
    return targets
