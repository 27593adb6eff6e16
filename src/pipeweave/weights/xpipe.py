"""XPipe (Guan et al., arXiv 1911.04610, 2019): weight prediction from Adam's update direction.

Adam's next update is lr m_hat / (sqrt(v_hat) + eps), so the weights s updates
ahead are predicted as w_hat = w - s lr m_hat / (sqrt(v_hat) + eps), with the
bias-corrected moments of PyTorch's Adam state. The "bellwether", the first
microbatch of each mini-batch at a stage, computes s and the prediction once
per pass (forward, backward); the mini-batch's other microbatches reuse it
(the cached prediction: one extra M_theta per live pass,
``sim.versions.stage_weights``). s comes from
``sim.versions.read_versions(schedule)[bellwether action].distance``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def adam_direction(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, betas: tuple[float, float], eps: float
) -> torch.Tensor:
    """m_hat / (sqrt(v_hat) + eps) after ``step`` Adam steps (zeros at step 0).

    Example:
        >>> d = adam_direction(torch.tensor([0.1]), torch.tensor([0.01]), 1, (0.9, 0.99), 0.0)
        >>> round(d.item(), 6)    # m_hat = 0.1 / 0.1 = 1, v_hat = 0.01 / 0.01 = 1
        1.0
    """
    if step == 0:
        return torch.zeros_like(exp_avg)
    m_hat = exp_avg / (1 - betas[0] ** step)
    v_hat = exp_avg_sq / (1 - betas[1] ** step)
    return m_hat / (v_hat.sqrt() + eps)


class XPipePredictor:
    """Bellwether-cached predicted weights of one stage, from its ``torch.optim.Adam`` state.

    Args:
        params: the stage's live parameters.
        optimizer: the stage's Adam over ``params``.

    Example:
        >>> p = torch.nn.Parameter(torch.tensor([1.0]))
        >>> opt = torch.optim.Adam([p], lr=0.1, betas=(0.9, 0.99), eps=0.0)
        >>> p.grad = torch.tensor([1.0]); opt.step()                 # w = 1 - 0.1 = 0.9
        >>> xp = XPipePredictor([p], opt)
        >>> round(xp.weights_for("F", mini_batch=1, distance=2)[0].item(), 6)   # 0.9 - 2 * 0.1 * 1
        0.7
    """

    def __init__(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Adam) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self._cache: dict[tuple[str, int], list[torch.Tensor]] = {}

    def predict(self, distance: int) -> list[torch.Tensor]:
        """w_hat for ``distance`` updates ahead, from the optimizer state now."""
        group = self.optimizer.param_groups[0]
        lr, betas, eps = float(group["lr"]), group["betas"], float(group["eps"])
        out = []
        with torch.no_grad():
            for p in self.params:
                st = self.optimizer.state[p]
                if not st:
                    out.append(p.detach().clone())
                    continue
                step = int(st["step"])
                out.append(p - distance * lr * adam_direction(st["exp_avg"], st["exp_avg_sq"], step, betas, eps))
        return out

    def weights_for(self, pass_: str, mini_batch: int, distance: int) -> list[torch.Tensor]:
        """The prediction of ``pass_`` ("F" or "B") for ``mini_batch``: computed by its first caller, the bellwether."""
        key = (pass_, mini_batch)
        if key not in self._cache:
            self._cache[key] = self.predict(distance)
        return self._cache[key]

    def release(self, pass_: str, mini_batch: int) -> None:
        """The mini-batch's last microbatch has run this pass: drop its cached prediction."""
        self._cache.pop((pass_, mini_batch), None)

    def cached(self) -> int:
        """Predictions held now (in M_theta of this stage)."""
        return len(self._cache)
