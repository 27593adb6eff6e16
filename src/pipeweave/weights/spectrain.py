"""SpecTrain (Chen et al., arXiv 1809.02839, 2018): weight prediction for momentum SGD.

Momentum SGD moves the weights by about lr v per update (v the velocity,
PyTorch's ``momentum_buffer``), so the weights s updates ahead are predicted as
w_hat = w - s lr v. Every forward and backward of a stage computes on the
weights predicted for the version its gradient will be applied to; s is that
distance, per stage and pass: ``sim.versions.read_versions(schedule)[a].distance``.
Only momentum SGD (weight decay and Nesterov ignored, as in the paper).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def predict(weights: Sequence[torch.Tensor], velocity: Sequence[torch.Tensor], lr: float, distance: int) -> list[torch.Tensor]:
    """w_hat = w - s lr v, elementwise.

    Example:
        >>> round(predict([torch.tensor([1.0])], [torch.tensor([0.5])], lr=0.1, distance=2)[0].item(), 6)
        0.9
    """
    with torch.no_grad():
        return [w - distance * lr * v for w, v in zip(weights, velocity)]


class SpecTrainPredictor:
    """Predicted weights of one stage, from its ``torch.optim.SGD`` momentum buffers.

    Args:
        params: the stage's live parameters.
        optimizer: the stage's SGD (momentum > 0) over ``params``.

    Example:
        >>> p = torch.nn.Parameter(torch.tensor([1.0]))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.tensor([2.0]); opt.step()            # v = 2, w = 1 - 0.2 = 0.8
        >>> round(SpecTrainPredictor([p], opt).weights_for(3)[0].item(), 6)   # 0.8 - 3 * 0.1 * 2
        0.2
    """

    def __init__(self, params: Sequence[torch.Tensor], optimizer: torch.optim.SGD) -> None:
        self.params = list(params)
        self.optimizer = optimizer

    def velocity(self) -> list[torch.Tensor]:
        """The momentum buffers (zeros before the first step)."""
        state = self.optimizer.state
        return [state[p]["momentum_buffer"] if "momentum_buffer" in state[p] else torch.zeros_like(p)
                for p in self.params]

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def weights_for(self, distance: int) -> list[torch.Tensor]:
        """The weights ``distance`` updates ahead (the live ones when 0)."""
        if distance == 0:
            return self.params
        return predict(self.params, self.velocity(), self.lr(), distance)
