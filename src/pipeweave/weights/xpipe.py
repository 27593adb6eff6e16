"""XPipe (Guan et al., arXiv 1911.04610, 2019): weight prediction along Adam's update direction.

Adam's next update is lr m_hat / (sqrt(v_hat) + eps), so the weights s updates
ahead are predicted as w_hat = w - s lr m_hat / (sqrt(v_hat) + eps), with the
bias-corrected moments of PyTorch's Adam state (``weights.prediction``). The
"bellwether", the first microbatch of each mini-batch at a stage, computes s and
the prediction once per pass (forward, backward); the mini-batch's other
microbatches reuse it (the cached prediction: one extra M_theta per live pass,
``sim.versions.stage_weights``; the cache is ``runtime.stage.policy``'s). s comes from
``sim.versions.read_versions(schedule)[bellwether action].distance``.
"""

from __future__ import annotations

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
